"""Keras 3 ``DistributedOptimizer``: Horovod's ``create_distributed_optimizer``, adapted to Keras 3.

Keras 3 optimizers funnel every update through ``apply(grads, trainable_variables)``
(``apply_gradients`` calls it, and so does ``Model.fit``'s ``train_step`` through
``apply_gradients``). The wrapper overrides ``apply`` only: the core's scheduler runs the step
(:class:`tf_plugin.reducer.GradientReducer`, any schedule), and the model update it leaves to the
wrapped optimizer (the reduced gradients, under the synchronous schedule) goes through the
wrapped optimizer's own ``apply`` unchanged (loss scaling, clipping, EMA, gradient accumulation,
constraints), in the traced graph (see :mod:`tf_plugin.host` for how the update is deferred).

Like ``torch_plugin.DistributedOptimizer``, the optimizer is converted *in place* (its class
becomes a dynamic subclass with the same name) and returned: its variables, its learning-rate
variable and anything already traced against them stay valid, and ``isinstance`` checks and
``get_config()`` keep working. Horovod 0.28 instead rebuilt the optimizer from its config, which
on Keras 3 loses built state (and its TF module is broken on TF >= 2.16).

``model.fit`` traces ``train_step`` in a ``tf.function``: the reduction is one ``tf.py_function``
per step (see :mod:`tf_plugin.bridge`); compile with ``jit_compile=False`` on GPUs.
"""
from __future__ import annotations

import contextlib

import tensorflow as tf

from hvd_commopt.engine.args import check_backward_passes
from hvd_commopt.errors import ConfigError
from hvd_commopt.reduce import Average

from ._compat import built_variables
from .aggregation import LocalAggregation
from .functions import _comm
from .host import KerasScheduleHost
from .reducer import GradientReducer

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizerMixin:
    """Methods grafted onto the wrapped optimizer's class."""

    _hco_reducer: GradientReducer

    def apply(self, grads, trainable_variables=None):
        if self._hco_bypass or len(grads) == 0:
            return self._hco_base.apply(self, grads, trainable_variables)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else built_variables(self))
        if not self.built:
            with tf.name_scope(self.name):
                self.build(variables)
        if self._hco_aggregation is not None:  # backward_passes_per_step > 1 (tf_plugin/aggregation.py)
            self._hco_aggregation.apply(self, list(grads), variables,
                                        lambda agg: self._hco_step(agg, variables, trainable_variables))
            return None
        return self._hco_step(list(grads), variables, trainable_variables)

    def _hco_step(self, grads, variables, trainable_variables):
        # The core's scheduler runs the step (any schedule); what it leaves for this optimizer
        # to apply to the model is applied here, in the traced graph under model.fit.
        update, do_apply = self._hco_reducer.step(list(grads), variables, self._hco_host_for)
        if tf.executing_eagerly():
            return self._hco_base.apply(self, update, trainable_variables) if bool(do_apply) else None

        def _apply():
            self._hco_base.apply(self, update, trainable_variables)
            return tf.constant(True)
        tf.cond(do_apply, _apply, lambda: tf.constant(False))
        return None

    def _hco_host_for(self, engine, names, variables):
        if engine.host is None:
            engine.attach_host(KerasScheduleHost(self, names, variables))
        return engine.host

    def finalize(self) -> None:
        """End of training (eagerly, on every rank, after the last step): wait for the rounds in
        flight, apply them, and leave the model at the global model (the replica w_g for
        OD/SSD/CD; the average of the workers' models for CoCoD/local SGD; nothing for sync)."""
        if self.comm_engine is not None:
            self.comm_engine.finalize()

    def drain(self) -> None:
        """Wait for and apply every round in flight (value-neutral; the model is unchanged)."""
        if self.comm_engine is not None:
            self.comm_engine.drain()

    def use_global_weights(self):
        """Within the block the model holds the global replica w_g (drained first), e.g. to
        evaluate it; under schedules without a replica the model is unchanged."""
        e = self.comm_engine
        return contextlib.nullcontext() if e is None else e.use_global_weights()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Apply gradients as given (already reduced, e.g. by a DistributedGradientTape)."""
        self._hco_bypass += 1
        try:
            yield
        finally:
            self._hco_bypass -= 1

    @property
    def comm_engine(self):
        """The engine that ran the last step (None before the first)."""
        return self._hco_reducer.last_engine

    @property
    def comm_stats(self) -> dict:
        """Traffic and wait time of the last step (bytes sent/received, seconds, per bucket)."""
        e = self.comm_engine
        return {} if e is None else e.last_stats.as_dict()


def DistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression=None, sparse_as_dense: bool = True, gradient_predivide_factor: float = 1.0,
                         op: str = Average, backward_passes_per_step: int = 1, fusion_threshold: int | None = None,
                         schedule=None, communicator=None, fusion: str = "threshold", fusion_options=None,
                         average_aggregated_gradients: bool = False, process_set=None, num_groups: int = 0,
                         groups=None):
    """Wrap a Keras 3 optimizer so that it applies gradients averaged over all ranks.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (converted in place and returned).
        name: accepted for Horovod compatibility (names the graph op).
        device_dense, device_sparse: accepted for Horovod compatibility; ignored.
        compression: ``hco.Compression.none`` (default), ``.fp16``, ``.bf16``, or a sparse
            compression (``Compression.topk(...)``, ...).
        sparse_as_dense: IndexedSlices gradients are always reduced densely (True only).
        gradient_predivide_factor: with Average, divide by f before the sum, by size/f after.
        op: ``hco.Average`` (default), ``hco.Sum`` or ``hco.Adasum`` (docs/adasum.md#optimizer).
        backward_passes_per_step: N > 1 accumulates N batches' gradients locally and reduces and
            applies them every N-th batch (one reduction per N batches; see
            :mod:`tf_plugin.aggregation`).
        average_aggregated_gradients: with N > 1, divide the accumulated sum by N (default:
            the sum, Horovod's default).
        fusion_threshold: fusion buffer size in bytes (0 = no fusion); default 25 MiB or the
            environment's HVD_COMMOPT_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD.
        schedule: ``hco.Schedule.sync()`` (default), ``.od()``, ``.ssd()``, ``.cd()``,
            ``.cocod(period)``, ``.local_sgd(period)`` (the core's schedulers). Non-sync schedules
            update the weights themselves inside ``apply``: the model holds the local weights
            during training; call ``finalize()`` after the last step to get the global model.
        communicator: a core Communicator; default: the one ``init()`` made.
        process_set: reduce over a registered ``ProcessSet``'s ranks.
        num_groups, groups: Horovod's explicit grouping; accepted, the fusion buckets group instead.
        fusion, fusion_options: the bucketing strategy (see ``torch_plugin.DistributedOptimizer``).

    Example::

        opt = hco.DistributedOptimizer(keras.optimizers.SGD(0.01 * hco.size()))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    """
    import keras  # noqa: PLC0415 - Keras 3 is only needed by this entry point

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer (Keras 3), got "
                          f"{type(optimizer).__name__}; for a custom loop use DistributedGradientTape")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ConfigError("this optimizer is already a DistributedOptimizer; wrap it once")
    if not sparse_as_dense:
        raise ConfigError("sparse_as_dense=False is not supported by the Keras wrapper: IndexedSlices are reduced "
                          "densely (DistributedGradientTape(sparse_as_dense=False) allgathers them)")
    aggregation = LocalAggregation(check_backward_passes(backward_passes_per_step), average_aggregated_gradients)
    del device_dense, device_sparse, num_groups, groups
    if process_set is not None:
        communicator = _comm(communicator, process_set)
    reducer = GradientReducer(compression=compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
                              fusion_threshold=fusion_threshold, schedule=schedule, communicator=communicator,
                              name=name or "DistributedOptimizer_Allreduce", cache={}, fusion=fusion,
                              fusion_options=fusion_options)
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizerMixin, base), {"_hco_base": base})
    cls.__module__ = base.__module__
    optimizer.__class__ = cls
    optimizer._hco_reducer = reducer
    optimizer._hco_bypass = 0
    optimizer._hco_aggregation = aggregation if aggregation.steps > 1 else None
    return optimizer
