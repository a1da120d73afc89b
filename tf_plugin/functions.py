"""Tensor collectives and broadcasts for TensorFlow (Horovod's names and argument names), a thin
layer over :mod:`hvd_commopt.collectives`: flatten, call the core, reshape.

Each works eagerly and inside ``tf.function`` (as one ``tf.py_function``; see
:mod:`tf_plugin.bridge`). Collectives go through the process communicator that ``init()`` made.
"""
from __future__ import annotations

import pickle
from typing import Any, Sequence

import tensorflow as tf

from hvd_commopt import collectives
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.errors import ConfigError
from hvd_commopt.process_sets import communicator_of as _comm, root_in_set as _root
from hvd_commopt.reduce import Average, Sum

from .bridge import host_call
from .errors import tf_errors
from .ops import TFOps

__all__ = ["allreduce", "allgather", "broadcast", "broadcast_", "broadcast_variables", "broadcast_object"]

_ops = TFOps()


_GRAD_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _differentiable(tensor, forward, backward):
    """``forward(tensor)`` with ``backward(dy)`` as its gradient (tf.custom_gradient) for
    floating tensors; integer tensors have no gradient in TensorFlow."""
    if tensor.dtype not in _GRAD_DTYPES:
        return forward(tensor)

    @tf.custom_gradient
    def op(x):
        return forward(x), backward
    return op(tensor)


def _allreduce_sparse(tensor: tf.IndexedSlices, op: str, prescale_factor: float, postscale_factor: float,
                      label: str, communicator) -> tf.IndexedSlices:
    """Horovod's IndexedSlices allreduce: allgather values and indices (duplicates stay, a
    consumer sums them); Average divides the values by the size."""
    if op not in (Average, Sum):
        raise NotImplementedError("only Sum and Average are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("prescale_factor/postscale_factor are not supported with tf.IndexedSlices")
    values = allgather(tensor.values, name=f"{label}.values", communicator=communicator)
    indices = allgather(tensor.indices, name=f"{label}.indices", communicator=communicator)
    if op == Average:
        values = values / _comm(communicator).size
    return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)


def _allreduce_raw(tensor, op, compression, prescale_factor, postscale_factor, label, communicator):
    def run(t):
        with tf_errors():
            out = collectives.allreduce(_comm(communicator), _ops, _ops.flatten(t), shape=tuple(t.shape), op=op,
                                        compression=compression,
                                        prescale_factor=prescale_factor, postscale_factor=postscale_factor, name=label)
        return [tf.reshape(out, tf.shape(t))]

    return host_call(run, [tensor], [tensor.dtype], [tensor.shape], label)[0]


def allreduce(tensor, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression=None, op: str | None = None, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, communicator=None,
              ignore_name_scope: bool = False, process_set=None):
    """Average (default), sum or Adasum of ``tensor`` over all ranks, as a new tensor.

    Differentiable: the gradient is the same allreduce of the incoming gradient.

    Args:
        tensor: a dense tensor, or ``tf.IndexedSlices`` (allgathered, Horovod's sparse rule:
            the result is an IndexedSlices with every rank's rows; Sum/Average only).
        average: Horovod's old flag (True: Average, False: Sum); giving it with ``op`` is an error.
        compression: ``Compression.fp16``/``bf16`` cast for the wire (dense compressors only).
        op: ``hco.Average``, ``hco.Sum`` or ``hco.Adasum`` (docs/adasum.md#adasum).
        prescale_factor, postscale_factor: multiply before / after the reduction (integer
            tensors: in float64, truncated back, as Horovod).
        communicator: a core Communicator (default: the one ``init()`` made); every function
            here takes it, for in-process ranks in tests and for sub-communicators.
        process_set: a registered ``ProcessSet`` (``add_process_set``): reduce over its ranks.
    """
    del ignore_name_scope
    communicator = _comm(communicator, process_set)
    op = collectives.resolve_op(average, op)
    label = name or "allreduce"
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, prescale_factor, postscale_factor, label, communicator)
    tensor = tf.convert_to_tensor(tensor)

    def forward(x):
        return _allreduce_raw(x, op, compression, prescale_factor, postscale_factor, label, communicator)

    def backward(dy):
        return _allreduce_raw(tf.convert_to_tensor(dy), op, compression, prescale_factor, postscale_factor,
                              f"{label}.grad", communicator)

    return _differentiable(tensor, forward, backward)


def _allgather_raw(tensor, label, communicator):
    if tensor.shape.rank is None:
        raise ConfigError("allgather needs a tensor of known rank")
    rest_static = tensor.shape[1:] if tensor.shape.rank > 0 else tf.TensorShape([])

    def run(t):
        rest = tuple(int(d) for d in t.shape[1:]) if t.shape.rank > 0 else ()
        with tf_errors():
            out = collectives.allgather(_comm(communicator), _ops, _ops.flatten(t), rest, label)
        return [tf.reshape(out, (-1,) + rest) if t.shape.rank > 0 else out]

    out_shape = tf.TensorShape([None]).concatenate(rest_static) if tensor.shape.rank > 0 else tf.TensorShape([None])
    return host_call(run, [tensor], [tensor.dtype], [out_shape], label)[0]


def allgather(tensor, name: str | None = None, communicator=None, ignore_name_scope: bool = False,
              process_set=None) -> tf.Tensor:
    """Concatenation of every rank's tensor along dim 0 (dim 0 may differ; the others must not).

    Differentiable: a rank's gradient is its rows of the average of the incoming gradients."""
    del ignore_name_scope
    communicator = _comm(communicator, process_set)
    tensor = tf.convert_to_tensor(tensor)
    label = name or "allgather"

    def backward(dy):
        return _allgather_grad(tf.convert_to_tensor(dy), tensor, f"{label}.grad", communicator)

    return _differentiable(tensor, lambda x: _allgather_raw(x, label, communicator), backward)


def _allgather_grad(dy, x, label, comm):
    """The gradient of an allgather of ``x``: this rank's rows of the averaged incoming gradient."""
    summed = _allreduce_raw(dy, Average, None, 1.0, 1.0, label, comm)
    rows = _allgather_raw(tf.shape(x, out_type=tf.int64)[:1], f"{label}.rows", comm)
    start = tf.reduce_sum(rows[:comm.rank])
    return summed[start:start + rows[comm.rank]]


def _broadcast_raw(tensor, root_rank, label, communicator):
    def run(t):
        with tf_errors():
            out = collectives.broadcast(_comm(communicator), _ops, _ops.flatten(t), root_rank, label,
                                        shape=tuple(t.shape))
        return [tf.reshape(out, tf.shape(t))]

    return host_call(run, [tensor], [tensor.dtype], [tensor.shape], label)[0]


def broadcast(tensor, root_rank: int = 0, name: str | None = None, communicator=None,
              ignore_name_scope: bool = False, process_set=None) -> tf.Tensor:
    """Root's ``tensor`` on every rank, as a new tensor (``root_rank``: a global rank).

    Differentiable: the root's gradient is the average of the incoming gradients, the others' zero."""
    del ignore_name_scope
    communicator = _comm(communicator, process_set)
    root_rank = _root(root_rank, process_set)
    tensor = tf.convert_to_tensor(tensor)
    label = name or "broadcast"

    def backward(dy):
        g = _allreduce_raw(tf.convert_to_tensor(dy), Average, None, 1.0, 1.0, f"{label}.grad", communicator)
        return g if _comm(communicator).rank == root_rank else tf.zeros_like(g)

    return _differentiable(tensor, lambda x: _broadcast_raw(x, root_rank, label, communicator), backward)


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int = 0, name: str | None = None,
                        communicator=None, process_set=None, inplace: bool = False):
    """Assign root's values to ``variables`` on every rank (fused per dtype).

    The names, shapes and dtypes are checked across ranks first, so a model that differs fails
    with :class:`~hvd_commopt.errors.RankMismatchError` instead of a mismatched broadcast.
    Eagerly it returns None; inside ``tf.function`` it returns the group of assign ops.
    """
    del inplace
    communicator = _comm(communicator, process_set)
    root_rank = _root(root_rank, process_set)
    variables = list(variables)
    label = name or "broadcast_variables"
    names = [f"{i}:{str(getattr(v, 'name', 'v')).split(':')[0]}" for i, v in enumerate(variables)]
    if not variables:
        return None
    values = [tf.convert_to_tensor(v) for v in variables]

    def run(*vals):
        specs = [TensorSpec(n, tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name) for n, v in zip(names, vals)]
        flats = collectives.broadcast_tensors(_comm(communicator), _ops, specs, [_ops.flatten(v) for v in vals],
                                              root_rank, what="set of variables to broadcast", label=label)
        return [tf.reshape(f, v.shape) for f, v in zip(flats, vals)]

    new = host_call(run, values, [v.dtype for v in values], [v.shape for v in values], label)
    if _comm(communicator).size == 1 and tf.executing_eagerly():
        return None
    assigns = [v.assign(x) for v, x in zip(variables, new)]
    return None if tf.executing_eagerly() else tf.group(assigns)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, communicator=None,
                     process_set=None) -> Any:
    """Root's picklable Python object on every rank (TF tensors are pickled as their values).

    Eager only: a Python object cannot cross a ``tf.function`` boundary.
    """
    if not tf.executing_eagerly():
        raise ConfigError("broadcast_object runs eagerly only; call it outside tf.function")
    comm = _comm(communicator, process_set)
    root_rank = _root(root_rank, process_set)
    data = pickle.dumps(obj) if comm.rank == root_rank else None
    data = comm.broadcast_object(data, root_rank, name or "broadcast_object")
    return pickle.loads(data)


def broadcast_(variables: Sequence[tf.Variable], root_rank: int = 0, name: str | None = None,
               process_set=None, communicator=None) -> list:
    """In-place broadcast (Horovod's ``broadcast_``): assign root's values to ``variables`` and
    return them."""
    variables = list(variables)
    broadcast_variables(variables, root_rank, name=name or "broadcast_", communicator=communicator,
                        process_set=process_set)
    return variables
