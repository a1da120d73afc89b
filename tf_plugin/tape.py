"""``DistributedGradientTape``: Horovod's ``_DistributedGradientTape`` on the core engine.

``gradient()`` calls the wrapped tape's own ``gradient``, hands the gradients to the engine in
backward order (through :class:`tf_plugin.reducer.GradientReducer`) and returns the reduced
gradients in the structure and order of ``sources``. Works eagerly and inside ``tf.function``
(one ``tf.py_function`` per ``gradient()`` call; see :mod:`tf_plugin.bridge`).
"""
from __future__ import annotations


import tensorflow as tf

from hvd_commopt.errors import ConfigError
from hvd_commopt.reduce import Average
from hvd_commopt.schedule import require_gradient_schedule

from .reducer import GradientReducer

__all__ = ["DistributedGradientTape"]


class _DistributedGradientTape:
    """Methods grafted onto the wrapped tape's class."""

    _hco_reducer: GradientReducer

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._hco_base.gradient(self, target, sources, output_gradients=output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        if len(flat_grads) != len(flat_sources):  # a single source gives a single gradient
            flat_grads = [grads]
        reduced = self._hco_reducer.reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(sources, reduced)

    @property
    def comm_engine(self):
        """The engine that reduced the last ``gradient()`` call (None before the first)."""
        return self._hco_reducer.last_engine


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression=None, sparse_as_dense: bool = True, op: str = Average,
                            gradient_predivide_factor: float = 1.0, fusion_threshold: int | None = None,
                            schedule=None, communicator=None, backward_passes_per_step: int = 1,
                            fusion: str = "threshold", fusion_options=None) -> tf.GradientTape:
    """A tape whose ``gradient()`` returns gradients averaged (or summed) over all ranks.

    Args:
        gradtape: the ``tf.GradientTape`` (wrapped after or before its ``with`` block).
        device_dense, device_sparse: accepted for Horovod compatibility; ignored (the core picks
            buffers by the gradients' devices).
        compression: ``hco.Compression.none`` (default), ``.fp16``, ``.bf16``, or a sparse
            compression (``Compression.topk(...)``, ...).
        sparse_as_dense: ``tf.IndexedSlices`` gradients are always reduced densely (True is the
            only supported value).
        op: ``hco.Average`` (default) or ``hco.Sum``.
        gradient_predivide_factor: with Average, divide by f before the sum, by size/f after.
        fusion_threshold: fusion buffer size in bytes (0 = no fusion); default from
            ``HVD_COMMOPT_FUSION_THRESHOLD`` / ``HOROVOD_FUSION_THRESHOLD``, else 25 MiB.
        schedule: ``Schedule.sync()`` only (the others update weights: use the Keras wrapper).
        communicator: a core Communicator; default: the one ``init()`` made.
        backward_passes_per_step, fusion, fusion_options: as for
            :class:`hvd_commopt.engine.CommEngine`.

    Returns:
        An object of a subclass of ``type(gradtape)`` sharing its recorded state.

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(model(x), y)
        tape = hco.DistributedGradientTape(tape)          # hvd_commopt: reduce the gradients
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    if not sparse_as_dense:
        raise ConfigError("sparse_as_dense=False (allgather of IndexedSlices) is not supported: "
                          "hvd_commopt reduces IndexedSlices gradients densely")
    del device_dense, device_sparse
    require_gradient_schedule(schedule)
    reducer = GradientReducer(compression=compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
                              fusion_threshold=fusion_threshold, schedule=schedule, communicator=communicator,
                              name="DistributedGradientTape_Allreduce", backward_passes_per_step=backward_passes_per_step,
                              fusion=fusion, fusion_options=fusion_options)
    base = type(gradtape)
    if isinstance(gradtape, _DistributedGradientTape):
        raise ConfigError("this tape is already a DistributedGradientTape; wrap it once")
    cls = type(base.__name__, (_DistributedGradientTape, base), {"_hco_base": base})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._hco_reducer = reducer
    return tape
