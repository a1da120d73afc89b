"""The glue shared by ``DistributedGradientTape`` and the Keras ``DistributedOptimizer``.

:class:`GradientReducer` hands a list of gradients (aligned with a list of variables) to the
core's :class:`~hvd_commopt.engine.CommEngine` in backward order and runs the core's step: the
tape gets the reduced gradients back (:meth:`GradientReducer.reduce`), the Keras wrapper gets the
model update to apply (:meth:`GradientReducer.step`). Nothing here decides what to send, when,
or how: that is the engine's and its scheduler's job.

Engines live in a cache keyed by the communicator, the tensor set, the variables and the
configuration as the core declares it (``Reducer.config()``, the schedule's frozen config),
not on the tape: a training loop builds a new ``tf.GradientTape`` (and wraps it) every step,
while the engine's state (step counter, error-feedback residuals, delayed rounds) must survive
from step to step and across ``tf.function`` retracing. A fresh ``Compression.topk(0.01)`` built
each step therefore maps to the engine of the first one (whose residuals it keeps); build the
compression object once, outside the loop, to call methods on it (e.g. DGC's ``set_epoch``).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable, Sequence

import tensorflow as tf

from hvd_commopt import build_engine, runtime
from hvd_commopt.engine import TensorSpec, Trainer
from hvd_commopt.engine.args import check_engine_args
from hvd_commopt.errors import ConfigError
from hvd_commopt.reduce import Average, check_op, make_reducer

from .bridge import host_call
from .ops import TFOps

__all__ = ["GradientReducer", "clear_engines", "variable_names"]

_ENGINES: dict[tuple, Trainer] = {}
_LOCK = threading.Lock()


def clear_engines() -> None:
    """Forget every cached engine (after ``shutdown()``: they hold the old communicator)."""
    with _LOCK:
        _ENGINES.clear()


def variable_names(variables: Sequence[Any]) -> list[str]:
    """Collective names: the position plus the variable's short name (Keras 3 ``name`` is the
    un-numbered leaf, e.g. ``kernel``), so they agree across ranks even when Keras' per-process
    layer numbering does not."""
    out = []
    for i, v in enumerate(variables):
        leaf = getattr(v, "name", None) or "tensor"
        out.append(f"{i}:{str(leaf).split(':')[0]}")
    return out


def _static_shape(x: Any, what: str) -> tuple[int, ...]:
    shape = tf.TensorShape(getattr(x, "shape", None))
    if not shape.is_fully_defined():
        raise ConfigError(f"{what} has shape {shape}; hvd_commopt needs fully defined shapes to plan "
                          f"its fusion buffers (gradients of variables always have them)")
    return tuple(int(d) for d in shape)


def _dense(g: Any) -> Any:
    if isinstance(g, tf.IndexedSlices):  # Horovod's sparse_as_dense: embeddings reduce densely
        return tf.convert_to_tensor(g)
    return g


class GradientReducer:
    """Reduces gradient lists with the core engine.

    Args:
        compression: ``Compression.none``/``fp16``/``bf16`` or a sparse reducer from
            ``Compression.*`` (whatever the core's engine accepts).
        op: ``Average`` or ``Sum``.
        gradient_predivide_factor: Horovod's meaning (with ``Average``).
        fusion_threshold: bytes per fusion buffer; default from the environment (25 MiB).
        schedule: a core ``Schedule.*`` value.
        communicator: default: the one ``init()`` made.
        name: prefix of the ``py_function`` op in graphs.
        cache: where engines are kept: the process-wide cache by default (a tape is rebuilt every
            step); a Keras DistributedOptimizer passes its own dict, so its engine (and schedule
            state: replica, host bound to this optimizer) is never shared with another optimizer.
        backward_passes_per_step, fusion, fusion_options: as for :class:`~hvd_commopt.engine.CommEngine`.
    """

    def __init__(self, compression=None, op: str = Average, gradient_predivide_factor: float = 1.0,
                 fusion_threshold: int | None = None, schedule=None, communicator=None,
                 name: str = "hvd_commopt_allreduce", cache: dict | None = None, backward_passes_per_step: int = 1,
                 fusion: str = "threshold", fusion_options: Any = None):
        check_engine_args(op=op, backward_passes_per_step=backward_passes_per_step,  # now, not at the first step
                          gradient_predivide_factor=gradient_predivide_factor, fusion_threshold=fusion_threshold)
        self.options = dict(compression=compression, op=check_op(op),
                            gradient_predivide_factor=float(gradient_predivide_factor),
                            fusion_threshold=fusion_threshold, schedule=schedule,
                            backward_passes_per_step=backward_passes_per_step, fusion=fusion,
                            fusion_options=fusion_options)
        # The configuration as the core declares it: the cache key, and a bad value fails here.
        declared = dict(self.options, compression=make_reducer(compression, op).config(), schedule=repr(schedule),
                        fusion_options=repr(fusion_options))
        self._config = json.dumps(declared, sort_keys=True, default=repr)
        self._communicator = communicator
        self.name = name
        self.ops = TFOps()
        self.last_engine: Trainer | None = None
        self._cache = _ENGINES if cache is None else cache

    # -- engine -------------------------------------------------------------------------------
    @property
    def communicator(self):
        return self._communicator if self._communicator is not None else runtime.communicator()

    def engine_for(self, specs: Sequence[TensorSpec], sources: tuple = ()) -> Trainer:
        """The cached engine for this configuration and tensor set (registered on first use:
        a collective check that every rank has the same tensors). ``sources``: identities of the
        variables, so two models of the same shapes do not share error-feedback state."""
        specs = tuple(specs)
        key = (id(self.communicator), self._config, specs, sources)
        with _LOCK:
            engine = self._cache.get(key)
        if engine is None or engine.comm is not self.communicator:  # (an id can be reused)
            # Registered outside the lock: register() is a collective, and in-process ranks
            # (threads) share this cache.
            engine = build_engine(self.communicator, self.ops, **self.options)
            engine.register(list(specs))
            with _LOCK:
                self._cache[key] = engine
        self.last_engine = engine
        return engine

    def engine_for_variables(self, variables: Sequence[Any]) -> Trainer:
        """The engine that reduces gradients of ``variables`` (built and registered if needed)."""
        return self.engine_for(self.specs_for(variables)[1], self.source_ids(variables))

    @staticmethod
    def source_ids(variables: Sequence[Any]) -> tuple:
        """Identities of variable sources (stable across steps); tensors count by position."""
        return tuple(id(v) if hasattr(v, "assign") else None for v in variables)

    def specs_for(self, variables: Sequence[Any]) -> tuple[list[str], tuple[TensorSpec, ...]]:
        names = variable_names(variables)
        specs = tuple(TensorSpec(n, _static_shape(v, f"source {n}"), tf.as_dtype(v.dtype).name)
                      for n, v in zip(names, variables))
        return names, specs

    def _inputs(self, grads: Sequence[Any], variables: Sequence[Any]) -> tuple[list[int], list]:
        """Positions of the present gradients, and those gradients as dense tensors of their
        variables' dtypes."""
        if len(grads) != len(variables):
            raise ConfigError(f"{len(grads)} gradients for {len(variables)} variables")
        present = [i for i, g in enumerate(grads) if g is not None]
        inputs = []
        for i in present:
            g = tf.convert_to_tensor(_dense(grads[i]))
            inputs.append(g if g.dtype == variables[i].dtype else tf.cast(g, variables[i].dtype))
        return present, inputs

    @staticmethod
    def _hand_in(engine: Trainer, names: list[str], present: list[int], values: Sequence[Any]) -> None:
        # Backward order (the last layer's gradient is ready first): each bucket launches as
        # soon as its last member is packed, while the earlier layers are still being packed.
        grad_ready = engine.engine.grad_ready  # the CommEngine's, without the Trainer's forwarding call
        for j in range(len(values) - 1, -1, -1):
            grad_ready(names[present[j]], values[j])

    # -- the tape: gradients in, reduced gradients out ------------------------------------------
    def reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list:
        """Reduced gradients, in the order of ``variables`` (one core step).

        Every variable takes part in every step (so ranks always run the same collectives): a
        ``None`` gradient contributes zeros and stays ``None`` in the result (Horovod's rule:
        Keras then skips the variable). When a gradient is ``None`` on some ranks only, those
        ranks skip the variable while the others apply the average; pass
        ``unconnected_gradients=tf.UnconnectedGradients.ZERO`` to the tape to keep ranks
        identical in that case.
        """
        grads, variables = list(grads), list(variables)
        names, specs = self.specs_for(variables)
        present, inputs = self._inputs(grads, variables)
        if not present:
            return grads
        ids = self.source_ids(variables)

        def run(*values):
            engine = self.engine_for(specs, ids)
            self._hand_in(engine, names, present, values)
            out = engine.reduce_step()
            return [tf.convert_to_tensor(out[names[i]]) for i in present]

        reduced = host_call(run, inputs, [tf.as_dtype(specs[i].dtype) for i in present],
                            [specs[i].shape for i in present], self.name)
        result: list = [None] * len(grads)
        for i, r in zip(present, reduced):
            result[i] = r
        return result

    # -- the Keras wrapper: one core step, and the model update it leaves to the optimizer ------
    def step(self, grads: Sequence[Any], variables: Sequence[Any],
             host_for: Callable[[Trainer, list[str], list[Any]], Any]) -> tuple[list, Any]:
        """One optimizer step by the core's scheduler, with the host ``host_for(engine, names,
        variables)``. Returns ``(update, apply)``: the gradients (aligned with ``variables``, None
        where there was none) the wrapped optimizer must still apply to the model, and whether it
        must (a bool, or a bool tensor in graphs). One ``py_function`` in graphs."""
        grads, variables = list(grads), list(variables)
        names, specs = self.specs_for(variables)
        present, inputs = self._inputs(grads, variables)
        ids = self.source_ids(variables)

        def run(*values):
            engine = self.engine_for(specs, ids)
            host = host_for(engine, names, variables)
            local = {n: None for n in names}
            for j, i in enumerate(present):
                local[names[i]] = values[j]
            host.set_grads(local)
            self._hand_in(engine, names, present, values)
            engine.run_step()
            update = host.take_deferred()
            if update is None:
                return [tf.zeros_like(v) for v in values] + [tf.constant(False)]
            return [tf.convert_to_tensor(update[names[i]]) for i in present] + [tf.constant(True)]

        outs = host_call(run, inputs, [g.dtype for g in inputs] + [tf.bool],
                         [g.shape for g in inputs] + [tf.TensorShape([])], self.name)
        update: list = [None] * len(grads)
        for i, r in zip(present, outs[:-1]):
            update[i] = r
        return update, outs[-1]
