"""Keras 3 ``DistributedOptimizer``: Horovod's ``create_distributed_optimizer``, adapted to Keras 3.

Keras 3 optimizers funnel every update through ``apply(grads, trainable_variables)``
(``apply_gradients`` calls it, and so does ``Model.fit``'s ``train_step`` through
``apply_gradients``). The wrapper overrides ``apply`` only: the gradients are reduced by the core
engine (:class:`tf_plugin.reducer.GradientReducer`), then the wrapped optimizer's own ``apply``
runs unchanged (loss scaling, clipping, EMA, gradient accumulation, constraints).

Like ``torch_plugin.DistributedOptimizer``, the optimizer is converted *in place* (its class
becomes a dynamic subclass with the same name) and returned: its variables, its learning-rate
variable and anything already traced against them stay valid, and ``isinstance`` checks and
``get_config()`` keep working. Horovod 0.28 instead rebuilt the optimizer from its config, which
on Keras 3 loses built state (and its TF module is broken on TF >= 2.16, horovod#4290).

``model.fit`` traces ``train_step`` in a ``tf.function``: the reduction is one ``tf.py_function``
per step (see :mod:`tf_plugin.bridge`); compile with ``jit_compile=False`` on GPUs.
"""
from __future__ import annotations

from contextlib import contextmanager

import tensorflow as tf

from hvd_commopt.errors import ConfigError, HvdCommoptError

from .reducer import Average, GradientReducer
from .schedule import KerasScheduleHost, _snapshot

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizerMixin:
    """Methods grafted onto the wrapped optimizer's class."""

    _hco_reducer: GradientReducer

    def apply(self, grads, trainable_variables=None):
        if getattr(self, "_hco_should_sync", True) and len(grads) > 0:
            variables = (list(trainable_variables) if trainable_variables is not None
                         else list(getattr(self, "_trainable_variables", [])))
            if not self.built:
                with tf.name_scope(self.name):
                    self.build(variables)
            if not self._hco_reducer.synchronous:
                # The core's scheduler reduces, steps its replica with this optimizer
                # (KerasScheduleHost.apply_optimizer) and writes the local weights.
                self._hco_reducer.scheduled_step(list(grads), variables, self._hco_make_host)
                return None
            grads = self._hco_reducer.reduce(list(grads), variables)
        return self._hco_base.apply(self, grads, trainable_variables)

    def _hco_make_host(self, names, variables):
        return KerasScheduleHost(self, names, variables)

    def _hco_engine(self):
        e = self._hco_reducer.last_engine
        if e is None:
            raise HvdCommoptError("no step has run yet")
        return e

    def finalize(self) -> None:
        """End of training (eagerly, on every rank, after the last step): wait for the rounds in
        flight, apply them, and leave the model at the global model (the replica w_g for
        OD/SSD/CD; the average of the workers' models for CoCoD/local SGD; nothing for sync)."""
        if self._hco_reducer.last_engine is not None:
            self._hco_engine().finalize()

    def drain(self) -> None:
        """Wait for and apply every round in flight (value-neutral; the model is unchanged)."""
        if self._hco_reducer.last_engine is not None:
            self._hco_engine().drain()

    @contextmanager
    def use_global_weights(self):
        """Within the block the model holds the global replica w_g (drained first), e.g. to
        evaluate it; under schedules without a replica the model is unchanged."""
        e = self._hco_reducer.last_engine
        replica = None
        if e is not None:
            e.drain()
            replica = e.scheduler.global_weights()
        host = getattr(e, "_tf_plugin_host", None)
        if replica is None or host is None:
            yield
            return
        saved = {n: _snapshot(v) for n, v in host.vars.items()}
        for n, v in host.vars.items():
            v.assign(replica[n])
        try:
            yield
        finally:
            for n, v in host.vars.items():
                v.assign(saved[n])

    @contextmanager
    def skip_synchronize(self):
        """Apply gradients as given (already reduced, e.g. by a DistributedGradientTape)."""
        self._hco_should_sync = False
        try:
            yield
        finally:
            self._hco_should_sync = True

    @property
    def comm_engine(self):
        """The engine that reduced the last step's gradients (None before the first)."""
        return self._hco_reducer.last_engine

    @property
    def comm_stats(self) -> dict:
        """Traffic and wait time of the last step (bytes sent/received, seconds, per bucket)."""
        e = self._hco_reducer.last_engine
        return {} if e is None else e.last_stats.as_dict()


def DistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression=None, sparse_as_dense: bool = True, gradient_predivide_factor: float = 1.0,
                         op: str = Average, backward_passes_per_step: int = 1, fusion_threshold: int | None = None,
                         schedule=None, communicator=None, **engine_kwargs):
    """Wrap a Keras 3 optimizer so that it applies gradients averaged over all ranks.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (converted in place and returned).
        name: accepted for Horovod compatibility (names the graph op).
        device_dense, device_sparse: accepted for Horovod compatibility; ignored.
        compression: ``hco.Compression.none`` (default), ``.fp16``, ``.bf16``, or the core's sparse
            compressions when it has them.
        sparse_as_dense: IndexedSlices gradients are always reduced densely (True only).
        gradient_predivide_factor: with Average, divide by f before the sum, by size/f after.
        op: ``hco.Average`` (default) or ``hco.Sum``.
        backward_passes_per_step: only 1. For local accumulation use Keras' own
            ``gradient_accumulation_steps=`` on the optimizer (gradients are then reduced every
            micro-step: correct, but without the traffic saving).
        fusion_threshold: fusion buffer size in bytes (0 = no fusion); default 25 MiB or the
            environment's HVD_COMMOPT_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD.
        schedule: ``hco.Schedule.sync()`` (default), ``.od()``, ``.ssd()``, ``.cd()``,
            ``.cocod(period)``, ``.local_sgd(period)`` (the core's schedulers). Non-sync schedules
            update the weights themselves inside ``apply``: the model holds the local weights
            during training; call ``finalize()`` after the last step to get the global model.
        communicator: a core Communicator; default: the one ``init()`` made.

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
    if backward_passes_per_step != 1:
        raise ConfigError("backward_passes_per_step > 1 is not supported by the Keras wrapper yet; use "
                          "the optimizer's gradient_accumulation_steps= (reduces every micro-step)")
    if not sparse_as_dense:
        raise ConfigError("sparse_as_dense=False is not supported: IndexedSlices are reduced densely")
    del device_dense, device_sparse
    reducer = GradientReducer(compression=compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
                              fusion_threshold=fusion_threshold, schedule=schedule, communicator=communicator,
                              name=name or "DistributedOptimizer_Allreduce", cache={}, **engine_kwargs)
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizerMixin, base), {"_hco_base": base})
    cls.__module__ = base.__module__
    optimizer.__class__ = cls
    optimizer._hco_reducer = reducer
    optimizer._hco_should_sync = True
    return optimizer
