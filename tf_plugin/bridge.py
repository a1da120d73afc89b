"""Eager and ``tf.function``: how the adapter reaches the core's Python engine from a TF graph.

Strategy (one rule for every collective of the adapter):

* **Eager**: the core is called directly on the eager tensors.
* **Inside ``tf.function``** (Keras ``model.fit`` traces ``train_step``): the same Python function
  is inserted as **one ``tf.py_function`` per call site** (one per step for the gradients of a
  ``DistributedGradientTape`` or a ``DistributedOptimizer``: the whole gradient list goes through
  a single call, and the engine's fusion buckets are formed inside it). The function runs eagerly
  at execution time, so the engine, its TensorOps and its communicator see eager tensors, and all
  step state lives in the engine (a Python object that outlives the trace), never in values
  captured at trace time.

Why ``py_function`` rather than a custom op: the core's engine, compressors and schedules are
Python; a C++ op would have to duplicate them (the thing the project exists to avoid). The cost
is measured by ``python -m benchmarks.tf_overhead`` (plain step vs bare py_function vs tape vs Keras
wrapper vs OD-SGD). Medians on the 2-core CI-class machine, TF 2.21 CPU, one TF thread, batch 32,
size 1 (no communication), over the plain traced step:

==========================  ===========  ==============  ==============  =============
model (params / tensors)    plain step   bare py_func    tape / Keras    OD schedule
==========================  ===========  ==============  ==============  =============
0.01M / 6                   0.6-1.0 ms   +0.2-0.3 ms     +1.3-4.2 ms     +16-18 ms
0.22M / 10                  1.3-1.6 ms   +0.4-1.3 ms     +4.8-5.5 ms     +27-33 ms
3.23M / 10 (13 MB)          19-20 ms     ~0 ms           +6.5-13 ms      +71-76 ms
==========================  ===========  ==============  ==============  =============

Leaving the graph costs little; the rest is the eager work inside it (TF's eager dispatch here
is 60-500 us per op, so :class:`~tf_plugin.ops.TFOps` packs buffers lazily and passes index
operands as NumPy arrays), plus, for the delayed schedules, the Keras optimizer run eagerly on the
replica and the local update (about 20 eager ops per variable per step). Under ``mpirun -np 2``
on the same 2 cores the real allreduce and the two ranks' contention add 15-180 ms per step.

Ordering: ranks must issue collectives in the same order. ``py_function`` ops are stateful, and
``tf.function``'s automatic control dependencies run stateful ops in program order, so two
collectives in one function run in the order they were written, on every rank.

Limits: a ``py_function`` cannot be compiled by XLA (``jit_compile=True``; Keras picks XLA by
default on GPUs with ``jit_compile="auto"``) nor exported in a SavedModel; :func:`host_call`
raises a :class:`~hvd_commopt.errors.ConfigError` naming the fix when it is traced under XLA.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from hvd_commopt.errors import ConfigError

from ._compat import in_xla_context

__all__ = ["host_call", "in_xla_context"]


def host_call(fn: Callable[..., Sequence[Any]], inputs: Sequence[Any], out_dtypes: Sequence[tf.DType],
              out_shapes: Sequence[Any], name: str) -> list:
    """``fn(*inputs)`` eagerly, or as a ``tf.py_function`` when tracing.

    Args:
        fn: a Python function of eager tensors returning a sequence of tensors.
        inputs: tensors (graph tensors when tracing).
        out_dtypes, out_shapes: of fn's outputs (shapes are set on the graph outputs; use None
            for an unknown dimension).
        name: the op's name in the graph.
    """
    if tf.executing_eagerly():
        return list(fn(*inputs))
    if in_xla_context():
        raise ConfigError(
            f"hvd_commopt's collective '{name}' cannot run inside an XLA-compiled function: the "
            f"adapter's collectives are tf.py_function calls. Use model.compile(..., "
            f"jit_compile=False) (Keras chooses XLA on GPUs when jit_compile='auto') or "
            f"tf.function(jit_compile=False).")
    if not out_dtypes:
        tf.py_function(lambda *a: (fn(*a), [])[1], list(inputs), [], name=name)
        return []
    outs = tf.py_function(fn, list(inputs), list(out_dtypes), name=name)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for o, s in zip(outs, out_shapes):
        o.set_shape(s)
    return list(outs)
