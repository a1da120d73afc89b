"""The glue shared by ``DistributedGradientTape`` and the Keras ``DistributedOptimizer``.

:class:`GradientReducer` turns a list of gradients (aligned with a list of variables) into the
list of reduced gradients, through the core's :class:`~hvd_commopt.engine.CommEngine`: it names
the tensors, hands them to the engine in backward order, and returns the engine's results in
source order. Nothing here decides what to send, when, or how: that is the engine's job.

Engines live in a process-wide cache keyed by the communicator, the configuration and the
tensor set, not on the tape: a training loop builds a new ``tf.GradientTape`` (and wraps it)
every step, while the engine's state (step counter, error-feedback residuals, delayed rounds)
must survive from step to step and across ``tf.function`` retracing.
"""
from __future__ import annotations

import hashlib
import inspect
import threading
import weakref
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from hvd_commopt import runtime
from hvd_commopt.engine import CommEngine, TensorSpec
from hvd_commopt.errors import ConfigError

from .bridge import host_call
from .schedule import TFUpdateOps

__all__ = ["GradientReducer", "Average", "Sum", "clear_engines", "variable_names"]

Average = "average"
Sum = "sum"

_ENGINES: dict[tuple, CommEngine] = {}
_LOCK = threading.Lock()
_ENGINE_PARAMS = set(inspect.signature(CommEngine.__init__).parameters)


def clear_engines() -> None:
    """Forget every cached engine (after ``shutdown()``: they hold the old communicator)."""
    with _LOCK:
        _ENGINES.clear()


def _describe(obj: Any, depth: int = 0) -> Any:
    """A hashable description of an object's configuration (its attributes, recursively)."""
    if obj is None or isinstance(obj, (str, int, float, bool, bytes)):
        return obj
    if depth > 4:
        return type(obj).__qualname__
    if isinstance(obj, (list, tuple)):
        return tuple(_describe(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return tuple(sorted((str(k), _describe(v, depth + 1)) for k, v in obj.items()))
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.shape, str(obj.dtype), hashlib.sha1(obj.tobytes()).hexdigest())
    if callable(obj) and not hasattr(obj, "__dict__"):
        return ("callable", getattr(obj, "__qualname__", repr(obj)))
    attrs = getattr(obj, "__dict__", None)
    if attrs is None:
        slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
        attrs = {s: getattr(obj, s) for s in slots if hasattr(obj, s)}
    return (type(obj).__module__, type(obj).__qualname__,
            tuple(sorted((k, _describe(v, depth + 1)) for k, v in attrs.items())))


_KEYS: dict[int, tuple[Any, Any]] = {}


def _config_key(obj: Any) -> Any:
    """The cache key of a compression/schedule *configuration*.

    ``Compression.topk(0.01)`` returns a new stateful reducer on every call; a training loop that
    wraps its tape every step (``DistributedGradientTape(tape, compression=Compression.topk(0.01))``)
    must keep using the first one (its error-feedback residuals). So an object is described by
    its attributes when it is first seen, still pristine: a fresh object built with the same
    arguments maps to the same engine. The same object seen again keeps its first key (its state
    has changed since), remembered by identity while it lives.
    """
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    hit = _KEYS.get(id(obj))
    if hit is not None and hit[0]() is obj:
        return hit[1]
    key = _describe(obj)
    try:
        ref = weakref.ref(obj)
    except TypeError:
        return key
    _KEYS[id(obj)] = (ref, key)
    weakref.finalize(obj, _KEYS.pop, id(obj), None)
    return key


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
        schedule: a core ``Schedule.*`` value, passed to the engine when the core has them.
        communicator: default: the one ``init()`` made.
        name: prefix of the ``py_function`` op in graphs.
        cache: where engines are kept: the process-wide cache by default (a tape is rebuilt every
            step); a Keras DistributedOptimizer passes its own dict, so its engine (and schedule
            state: replica, host bound to this optimizer) is never shared with another optimizer.
    """

    def __init__(self, compression=None, op: str = Average, gradient_predivide_factor: float = 1.0,
                 fusion_threshold: int | None = None, schedule=None, communicator=None,
                 name: str = "hvd_commopt_allreduce", cache: dict | None = None, **engine_kwargs):
        if op not in (Average, Sum):
            raise ConfigError(f"op must be hco.Average or hco.Sum, got {op!r}")
        if schedule is not None and "schedule" not in _ENGINE_PARAMS:
            raise ConfigError("schedule= needs the core's delayed schedules (hvd_commopt.schedule), "
                              "which this build of hvd_commopt does not have yet")
        unknown = set(engine_kwargs) - _ENGINE_PARAMS
        if unknown:
            raise ConfigError(f"unknown engine option(s) {sorted(unknown)}; the engine accepts "
                              f"{sorted(_ENGINE_PARAMS - {'self', 'comm', 'ops'})}")
        self.compression = compression
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.fusion_threshold = fusion_threshold
        self.schedule = schedule
        self.engine_kwargs = engine_kwargs
        self._communicator = communicator
        self.name = name
        self.ops = TFUpdateOps()  # TFOps + the schedules' update primitives
        self.last_engine: CommEngine | None = None
        self._cache = _ENGINES if cache is None else cache
        # Built eagerly so that a bad combination fails here, not inside a traced step.
        self._engine_options()

    # -- engine -------------------------------------------------------------------------------
    @property
    def communicator(self):
        return self._communicator if self._communicator is not None else runtime.communicator()

    def _engine_options(self) -> dict:
        opts = dict(compression=self.compression, fusion_threshold=self.fusion_threshold, op=self.op,
                    gradient_predivide_factor=self.gradient_predivide_factor, **self.engine_kwargs)
        if self.schedule is not None:
            opts["schedule"] = self.schedule
        return opts

    def _key(self, specs: tuple[TensorSpec, ...]) -> tuple:
        kw = tuple(sorted((k, _config_key(v)) for k, v in self.engine_kwargs.items()))
        return (id(self.communicator), _config_key(self.compression), self.op, self.gradient_predivide_factor,
                self.fusion_threshold, _config_key(self.schedule), kw, specs)

    def engine_for(self, specs: Sequence[TensorSpec], sources: tuple = ()) -> CommEngine:
        """The cached engine for this configuration and tensor set (registered on first use:
        a collective check that every rank has the same tensors). ``sources``: identities of the
        variables, so two models of the same shapes do not share error-feedback state."""
        specs = tuple(specs)
        key = self._key(specs) + (sources,)
        with _LOCK:
            engine = self._cache.get(key)
        if engine is None or engine.comm is not self.communicator:  # (an id can be reused)
            # Registered outside the lock: register() is a collective, and in-process ranks
            # (threads) share this cache.
            engine = CommEngine(self.communicator, self.ops, **self._engine_options())
            engine.register(list(specs))
            with _LOCK:
                self._cache[key] = engine
        self.last_engine = engine
        return engine

    @property
    def synchronous(self) -> bool:
        """False for the delayed / model-averaging schedules (they update the weights themselves)."""
        return self.schedule is None or getattr(self.schedule, "kind", "sync") == "sync"

    # -- reduction ----------------------------------------------------------------------------
    def engine_for_variables(self, variables: Sequence[Any]) -> CommEngine:
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

    def reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list:
        """Reduced gradients, in the order of ``variables``.

        Every variable takes part in every step (so ranks always run the same collectives): a
        ``None`` gradient contributes zeros and stays ``None`` in the result (Horovod's rule:
        Keras then skips the variable). When a gradient is ``None`` on some ranks only, those
        ranks skip the variable while the others apply the average; pass
        ``unconnected_gradients=tf.UnconnectedGradients.ZERO`` to the tape to keep ranks
        identical in that case.
        """
        grads, variables = list(grads), list(variables)
        if len(grads) != len(variables):
            raise ConfigError(f"{len(grads)} gradients for {len(variables)} variables")
        names, specs = self.specs_for(variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        inputs = []
        for i in present:
            g = tf.convert_to_tensor(_dense(grads[i]))
            if g.dtype != variables[i].dtype:
                g = tf.cast(g, variables[i].dtype)
            inputs.append(g)

        ids = self.source_ids(variables)

        def run(*values):
            engine = self.engine_for(specs, ids)
            # Backward order (the last layer's gradient is ready first): each bucket launches as
            # soon as its last member is packed, while the earlier layers are still being packed.
            for j in range(len(values) - 1, -1, -1):
                engine.grad_ready(names[present[j]], values[j])
            out = engine.synchronize()
            return [tf.convert_to_tensor(out[names[i]]) for i in present]

        reduced = host_call(run, inputs, [tf.as_dtype(specs[i].dtype) for i in present],
                            [specs[i].shape for i in present], self.name)
        result: list = [None] * len(grads)
        for i, r in zip(present, reduced):
            result[i] = r
        return result

    def scheduled_step(self, grads: Sequence[Any], variables: Sequence[Any], make_host) -> None:
        """One optimizer step under a non-synchronous schedule: hand the local gradients to the
        engine (backward order) and let the core's scheduler run the step (it reduces, applies
        the global update to its replica through ``make_host(names, variables)``'s
        ``apply_optimizer`` and writes the local weights). One ``py_function`` in graphs."""
        grads, variables = list(grads), list(variables)
        names, specs = self.specs_for(variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        inputs = []
        for i in present:
            g = tf.convert_to_tensor(_dense(grads[i]))
            inputs.append(g if g.dtype == variables[i].dtype else tf.cast(g, variables[i].dtype))

        ids = self.source_ids(variables)

        def run(*values):
            engine = self.engine_for(specs, ids)
            host = getattr(engine, "_tf_plugin_host", None)
            if host is None:
                host = make_host(names, variables)
                engine.attach_host(host)
                engine._tf_plugin_host = host
            local = {n: None for n in names}
            for j, i in enumerate(present):
                local[names[i]] = values[j]
            host.set_grads(local)
            for j in range(len(values) - 1, -1, -1):
                engine.grad_ready(names[present[j]], values[j])
            engine.run_step()
            return []

        host_call(run, inputs, [], [], self.name)
