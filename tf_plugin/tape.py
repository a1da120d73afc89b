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

from .functions import _comm, allreduce
from .reducer import GradientReducer

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


class _DistributedGradientTape:
    """Methods grafted onto the wrapped tape's class."""

    _hco_reducer: GradientReducer
    _hco_local: set          # ids of local sources (PartialDistributedGradientTape): not reduced
    _hco_scale_local: bool   # local gradients divided by the size (Horovod's scale_local_gradients)
    _hco_sparse: dict | None  # IndexedSlices handling when sparse_as_dense=False: allreduce options

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._hco_base.gradient(self, target, sources, output_gradients=output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        if len(flat_grads) != len(flat_sources):  # a single source gives a single gradient
            flat_grads = [grads]
        return tf.nest.pack_sequence_as(sources, self._hco_reduce(flat_grads, flat_sources))

    def _hco_reduce(self, grads: list, sources: list) -> list:
        """Reduced gradients aligned with ``sources``: local sources scaled only, IndexedSlices
        allgathered when ``sparse_as_dense=False``, the rest through the engine."""
        out = list(grads)
        engine_idx = []
        for i, (g, v) in enumerate(zip(grads, sources)):
            if id(v) in self._hco_local:
                if g is not None and self._hco_scale_local:
                    size = self._hco_reducer.communicator.size
                    out[i] = (tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                              if isinstance(g, tf.IndexedSlices) else g / size)
            elif self._hco_sparse is not None and isinstance(g, tf.IndexedSlices):
                out[i] = allreduce(g, name=f"{self._hco_reducer.name}.sparse.{i}", **self._hco_sparse)
            else:
                engine_idx.append(i)
        if engine_idx:
            reduced = self._hco_reducer.reduce([grads[i] for i in engine_idx], [sources[i] for i in engine_idx])
            for i, r in zip(engine_idx, reduced):
                out[i] = r
        return out

    def register_local_source(self, source) -> None:
        """Exclude ``source`` (a variable) from the reduction: its gradient stays local."""
        self._hco_local.add(id(source))

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, **kwargs):
        """``(local, global)``: lists of ``(variable, gradient)`` pairs for the local sources and
        the others (Horovod's PartialDistributedGradientTape helper)."""
        flat_sources = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self.gradient(target, flat_sources, output_gradients=output_gradients, **kwargs))
        local = [(v, g) for v, g in zip(flat_sources, grads) if id(v) in self._hco_local]
        glob = [(v, g) for v, g in zip(flat_sources, grads) if id(v) not in self._hco_local]
        return local, glob

    @property
    def comm_engine(self):
        """The engine that reduced the last ``gradient()`` call (None before the first)."""
        return self._hco_reducer.last_engine


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                            compression=None, sparse_as_dense: bool = True, op: str = Average,
                            gradient_predivide_factor: float = 1.0, fusion_threshold: int | None = None,
                            schedule=None, communicator=None, backward_passes_per_step: int = 1,
                            fusion: str = "threshold", fusion_options=None, process_set=None,
                            num_groups: int = 0, groups=None) -> tf.GradientTape:
    """A tape whose ``gradient()`` returns gradients averaged (or summed) over all ranks.

    Args:
        gradtape: the ``tf.GradientTape`` (wrapped after or before its ``with`` block).
        device_dense, device_sparse: accepted for Horovod compatibility; ignored (the core picks
            buffers by the gradients' devices).
        compression: ``hco.Compression.none`` (default), ``.fp16``, ``.bf16``, or a sparse
            compression (``Compression.topk(...)``, ...).
        sparse_as_dense: True (default): ``tf.IndexedSlices`` gradients are densified and reduced
            with the others; False: they are allgathered (Horovod's sparse allreduce; the
            result is an IndexedSlices holding every rank's rows).
        op: ``hco.Average`` (default), ``hco.Sum`` or ``hco.Adasum`` (docs/adasum.md#optimizer).
        gradient_predivide_factor: with Average, divide by f before the sum, by size/f after.
        fusion_threshold: fusion buffer size in bytes (0 = no fusion); default from
            ``HVD_COMMOPT_FUSION_THRESHOLD`` / ``HOROVOD_FUSION_THRESHOLD``, else 25 MiB.
        schedule: ``Schedule.sync()`` only (the others update weights: use the Keras wrapper).
        communicator: a core Communicator; default: the one ``init()`` made.
        process_set: reduce over a registered ``ProcessSet``'s ranks.
        num_groups, groups: Horovod's explicit grouping; accepted, the engine's fusion buckets
            (``fusion_threshold``/``fusion``) group the gradients instead.
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
    del device_dense, device_sparse, num_groups, groups
    require_gradient_schedule(schedule)
    if process_set is not None:
        communicator = _comm(communicator, process_set)
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
    tape._hco_local = set()
    tape._hco_scale_local = True
    tape._hco_sparse = None if sparse_as_dense else dict(op=op, communicator=communicator)
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression=None, sparse_as_dense: bool = True, op: str = Average,
                                   gradient_predivide_factor: float = 1.0, local_layers=None, process_set=None,
                                   scale_local_gradients: bool = True, **kwargs) -> tf.GradientTape:
    """A ``DistributedGradientTape`` that leaves the gradients of ``local_layers`` (a Keras layer
    or a list of them: model-parallel parts) unreduced; with ``scale_local_gradients`` (default,
    Horovod's) they are divided by the size, like the averaged ones. Other arguments as
    :func:`DistributedGradientTape`."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, process_set=process_set, **kwargs)
    if local_layers is None:
        local_layers = []
    elif not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    for layer in local_layers:
        if not hasattr(layer, "trainable_weights"):
            raise ConfigError(f"local_layers takes Keras layers, got {type(layer).__name__}")
        for v in layer.trainable_weights:
            tape.register_local_source(v)
    tape._hco_scale_local = bool(scale_local_gradients)
    return tape
