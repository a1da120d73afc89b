"""Horovod's grouped collectives, ``alltoall`` and ``reducescatter`` for TensorFlow
(docs/horovod_tf.md#gradients), over the core (:mod:`hvd_commopt.collectives`,
:mod:`hvd_commopt.scatter`): flatten, call the core, reshape, with a ``tf.custom_gradient`` for
floating tensors. Each call is one ``tf.py_function`` inside
``tf.function`` (:mod:`tf_plugin.bridge`).

Gradients (Horovod's conventions, which treat the incoming gradient like the forward data):

* grouped_allreduce: the same grouped allreduce of the incoming gradients;
* grouped_allgather: per tensor, as ``allgather`` (this rank's rows of the averaged gradient);
* alltoall: the alltoall of the incoming gradient back with the received splits;
* reducescatter: the allgather of the incoming parts, times the size for ``Sum`` (the gathered
  gradient is the same on every rank, so summing it over the ranks is that product).
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from hvd_commopt import collectives, scatter
from hvd_commopt.errors import ConfigError
from hvd_commopt.reduce import Average, Sum

from .bridge import host_call
from .errors import tf_errors
from .functions import _GRAD_DTYPES, _allgather_grad, _allreduce_sparse, _comm, _ops, allgather

__all__ = ["grouped_allreduce", "grouped_allgather", "alltoall", "reducescatter", "grouped_reducescatter"]


def _shape(t) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _all_differentiable(tensors) -> bool:
    return all(t.dtype in _GRAD_DTYPES for t in tensors)


def _grouped_allreduce_raw(tensors, op, compression, pre, post, label, comm):
    def run(*ts):
        with tf_errors():
            out = collectives.grouped_allreduce_async(comm, _ops, [_ops.flatten(t) for t in ts],
                                                      [_shape(t) for t in ts], op=op, compression=compression,
                                                      prescale_factor=pre, postscale_factor=post, name=label).wait()
        return [tf.reshape(o, tf.shape(t)) for o, t in zip(out, ts)]

    return host_call(run, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], label)


def grouped_allreduce(tensors, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
                      compression=None, op: str | None = None, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=None,
                      communicator=None, ignore_name_scope: bool = False) -> list:
    """Allreduce of a list of tensors as one operation (one cross-rank check, one fused
    reduction per dtype). ``tf.IndexedSlices`` members are allgathered (Sum/Average only)."""
    del device_dense, device_sparse, ignore_name_scope
    op, label = collectives.resolve_op(average, op), name or "grouped_allreduce"
    comm = _comm(communicator, process_set)
    tensors = list(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse and op not in (Average, Sum):
        raise NotImplementedError("only Sum and Average are supported with tf.IndexedSlices")
    dense_idx = [i for i in range(len(tensors)) if i not in sparse]
    dense = [tf.convert_to_tensor(tensors[i]) for i in dense_idx]
    out: list = [None] * len(tensors)
    for i in sparse:
        out[i] = _allreduce_sparse(tensors[i], op, prescale_factor, postscale_factor, f"{label}.{i}", comm)
    if dense:
        def forward(*xs):
            return _grouped_allreduce_raw(list(xs), op, compression, prescale_factor, postscale_factor, label, comm)

        if _all_differentiable(dense):
            @tf.custom_gradient
            def fn(*xs):
                def grad(*dys):
                    return _grouped_allreduce_raw([tf.convert_to_tensor(d) for d in dys], op, compression,
                                                  prescale_factor, postscale_factor, f"{label}.grad", comm)
                return forward(*xs), grad
            reduced = fn(*dense)
        else:
            reduced = forward(*dense)
        for i, r in zip(dense_idx, reduced):
            out[i] = r
    return out


def grouped_allgather(tensors, name: str | None = None, process_set=None, communicator=None,
                      ignore_name_scope: bool = False) -> list:
    """Allgather of a list of tensors with one cross-rank check (differentiable per tensor)."""
    del ignore_name_scope
    label = name or "grouped_allgather"
    comm = _comm(communicator, process_set)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if any(t.shape.rank is None or t.shape.rank == 0 for t in tensors):
        raise ConfigError("grouped_allgather needs tensors of known rank >= 1")

    def run(*ts):
        rests = [_shape(t)[1:] for t in ts]
        with tf_errors():
            out = collectives.grouped_allgather_async(comm, _ops, [_ops.flatten(t) for t in ts], rests, label).wait()
        return [tf.reshape(o, (-1,) + r) for (o, _rows), r in zip(out, rests)]

    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in tensors]
    if not _all_differentiable(tensors):
        return host_call(run, tensors, [t.dtype for t in tensors], shapes, label)

    @tf.custom_gradient
    def fn(*xs):
        def grad(*dys):
            # per tensor, as allgather's gradient: a grouped op has a single backward call
            return [_allgather_grad(tf.convert_to_tensor(d), x, f"{label}.grad.{i}", comm)
                    for i, (d, x) in enumerate(zip(dys, xs))]
        return host_call(run, list(xs), [t.dtype for t in xs], shapes, label), grad
    return fn(*tensors)


def _alltoall_raw(tensor, splits, label, comm):
    rest = tensor.shape[1:]
    inputs = [tensor] + ([tf.cast(tf.convert_to_tensor(splits), tf.int32)] if splits is not None else [])

    def run(t, *s):
        sp = [int(v) for v in s[0].numpy().reshape(-1)] if s else None
        with tf_errors():
            out, rows = scatter.alltoall_async(comm, _ops, _ops.flatten(t), _shape(t), splits=sp, name=label).wait()
        return [tf.reshape(out, (-1,) + tuple(int(d) for d in t.shape[1:])), tf.constant(rows, dtype=tf.int32)]

    out_shape = tf.TensorShape([None]).concatenate(rest)
    return host_call(run, inputs, [tensor.dtype, tf.int32], [out_shape, tf.TensorShape([comm.size])], label)


def alltoall(tensor, splits=None, name: str | None = None, ignore_name_scope: bool = False, process_set=None,
             communicator=None):
    """Rank r sends ``splits[j]`` rows of ``tensor`` (dim 0) to rank j and receives every rank's
    rows for it, in rank order. Without ``splits`` dim 0 is split equally. Returns the received
    tensor, or ``(received, received_splits)`` when ``splits`` is given (Horovod's return)."""
    del ignore_name_scope
    label = name or "alltoall"
    comm = _comm(communicator, process_set)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank is None or tensor.shape.rank == 0:
        raise ConfigError(f"alltoall '{label}': the tensor needs at least one dimension (a scalar cannot be split)")
    if tensor.dtype in _GRAD_DTYPES:
        @tf.custom_gradient
        def fn(x):
            out, rows = _alltoall_raw(x, splits, label, comm)

            def grad(dy, _drows=None):
                return _alltoall_raw(tf.convert_to_tensor(dy), rows, f"{label}.grad", comm)[0]
            return (out, rows), grad
        out, rows = fn(tensor)
    else:
        out, rows = _alltoall_raw(tensor, splits, label, comm)
    return out if splits is None else (out, rows)


def _reducescatter_raw(tensors, op, pre, post, label, comm, grouped):
    def run(*ts):
        flats, shapes = [_ops.flatten(t) for t in ts], [_shape(t) for t in ts]
        with tf_errors():
            if grouped:
                parts = scatter.grouped_reducescatter_async(comm, _ops, flats, shapes, op=op, prescale_factor=pre,
                                                            postscale_factor=post, name=label).wait()
            else:
                parts = [scatter.reducescatter_async(comm, _ops, flats[0], shapes[0], op=op, prescale_factor=pre,
                                                     postscale_factor=post, name=label).wait()]
        return [tf.reshape(p, (-1,) + s[1:]) for p, s in zip(parts, shapes)]

    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in tensors]
    return host_call(run, tensors, [t.dtype for t in tensors], shapes, label)


def _reducescatter(tensors, op, pre, post, label, comm, grouped):
    for t in tensors:
        if t.shape.rank is None or t.shape.rank == 0:
            raise ConfigError(f"reducescatter '{label}': every tensor needs at least one dimension")
    if not _all_differentiable(tensors):
        return _reducescatter_raw(tensors, op, pre, post, label, comm, grouped)
    factor = float(comm.size) if op == Sum else 1.0

    @tf.custom_gradient
    def fn(*xs):
        def grad(*dys):
            out = []
            for i, d in enumerate(dys):
                g = allgather(tf.convert_to_tensor(d), name=f"{label}.grad.{i}", communicator=comm)
                out.append(g * tf.cast(factor, g.dtype) if factor != 1.0 else g)
            return out
        return _reducescatter_raw(list(xs), op, pre, post, label, comm, grouped), grad
    return fn(*tensors)


def reducescatter(tensor, device_dense: str = "", compression=None, op: str = Average, name: str | None = None,
                  process_set=None, ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, communicator=None):
    """The reduction of every rank's ``tensor`` (same shape everywhere), split along dim 0; this
    rank's part (the first ``d0 % size`` ranks get one row more)."""
    del device_dense, compression, ignore_name_scope
    comm = _comm(communicator, process_set)
    return _reducescatter([tf.convert_to_tensor(tensor)], op, prescale_factor, postscale_factor,
                          name or "reducescatter", comm, grouped=False)[0]


def grouped_reducescatter(tensors: Sequence, device_dense: str = "", compression=None, op: str = Average,
                          name: str | None = None, process_set=None, ignore_name_scope: bool = False,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0, communicator=None) -> list:
    """``reducescatter`` of a list of tensors with one cross-rank check."""
    del device_dense, compression, ignore_name_scope
    comm = _comm(communicator, process_set)
    return list(_reducescatter([tf.convert_to_tensor(t) for t in tensors], op, prescale_factor, postscale_factor,
                               name or "grouped_reducescatter", comm, grouped=True))

