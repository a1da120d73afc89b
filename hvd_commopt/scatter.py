"""``alltoall`` and ``reducescatter`` of tensors (Horovod's semantics), for both adapters.

* alltoall: rank r sends rows ``splits[j]`` of its tensor (split along dim 0) to rank j and
  receives every rank's rows for it, concatenated in rank order. Without ``splits`` the first
  dimension is divided equally (it must be divisible by the size). Ranks must agree on the
  dtype and the trailing dimensions (checked, :mod:`hvd_commopt.negotiate`).
* reducescatter: the element-wise reduction of every rank's tensor (same shape everywhere),
  split along dim 0, rank r keeping part r; when dim 0 does not divide evenly the first
  ``d0 % P`` ranks get one row more (Horovod's rule). float32/64 and int32/64 without
  compression use the backend's reduce-scatter (``MPI_Reduce_scatter``); the other cases are the
  tensor allreduce (all its ops, dtypes and scale factors) followed by the slice, exact at twice
  the traffic (docs/horovod_api.md#reducescatter).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .collectives import _BACKEND_OP, Work, _allreduce_payload, _compressor, _int_scale, _picklable, deferred
from .comm.communicator import Communicator
from .errors import ConfigError
from .negotiate import Request
from .reduce.base import Adasum, Average, check_tensor_op
from .tensor_ops import TensorOps

__all__ = ["alltoall_async", "reducescatter_async", "grouped_reducescatter_async", "scatter_rows"]

Tensor = Any

# dtypes every host backend reduces natively (halves and small integers take the allreduce path)
_NATIVE = ("float32", "float64", "int32", "int64")
_WIRE_OP = _BACKEND_OP


def alltoall_async(comm: Communicator, ops: TensorOps, flat: Tensor, shape: Sequence[int],
                   splits: Sequence[int] | None = None, name: str = "alltoall") -> Work:
    """Start an alltoall of the tensor ``flat`` of ``shape``; ``wait()`` gives (the received flat
    tensor, the rows received from each rank)."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        raise ConfigError(f"alltoall '{name}': the tensor needs at least one dimension (a scalar cannot be split)")
    p, d0, row = comm.size, shape[0], math.prod(shape[1:])
    if splits is None:
        if d0 % p:
            raise ConfigError(f"alltoall '{name}': dim 0 ({d0}) is not divisible by the number of ranks ({p}); "
                              f"pass splits=")
        splits = [d0 // p] * p
    splits = [int(s) for s in splits]
    if len(splits) != p or any(s < 0 for s in splits) or sum(splits) != d0:
        raise ConfigError(f"alltoall '{name}': splits {splits} must be {p} non-negative row counts summing to "
                          f"dim 0 ({d0})")
    if p == 1:
        return Work(lambda: (flat, splits))

    def start() -> Work:
        h = comm.alltoall_tensor_async(ops, flat, [s * row for s in splits], name)

        def finish() -> tuple[Tensor, list[int]]:
            out, counts = comm.wait(h)
            return out, [c // row if row else 0 for c in counts]
        return Work(finish, (h,))
    return deferred(comm, Request("alltoall", name, ops.dtype_name(flat), shape), start)


def scatter_rows(d0: int, size: int) -> list[int]:
    """Rows of each rank's part of a dim 0 of ``d0`` (the first ``d0 % size`` get one more)."""
    return [d0 // size + (1 if r < d0 % size else 0) for r in range(size)]


def _my_part(ops: TensorOps, red: Tensor, shape: Sequence[int], rank: int, size: int) -> Tensor:
    rows = scatter_rows(shape[0], size)
    row = math.prod(shape[1:])
    start = sum(rows[:rank]) * row
    return ops.slice(red, start, start + rows[rank] * row)


def reducescatter_async(comm: Communicator, ops: TensorOps, flat: Tensor, shape: Sequence[int], *,
                        op: str = Average, compression: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, name: str = "reducescatter") -> Work:
    """Start a reducescatter; ``wait()`` gives this rank's flat part (rows: :func:`scatter_rows`)."""
    op = _scatter_op(op, name)
    comp = _compressor(compression)
    shape = tuple(int(d) for d in shape)
    if not shape:
        raise ConfigError(f"reducescatter '{name}': the tensor needs at least one dimension")
    dtype = ops.dtype_name(flat)
    pre, post = float(prescale_factor), float(postscale_factor)
    req = Request("reducescatter", name, dtype, shape, op=op, args=(pre, post, _picklable(comp)))

    def start() -> Work:
        if comp is None and dtype in _NATIVE and comm.buffer_kind == "numpy" and comm.size > 1:
            return _native(comm, ops, flat, shape, dtype, op, pre, post, name)
        w = _allreduce_payload(comm, ops, flat, dtype, op, comp, pre, post, name)
        return Work(lambda: _my_part(ops, w.wait(), shape, comm.rank, comm.size), w._handles)
    return deferred(comm, req, start)


def _scatter_op(op: str, name: str) -> str:
    """The op of a reducescatter: Adasum is refused, as Horovod refuses it (each rank would hold
    a part of a combination that is defined on whole vectors: docs/horovod_api.md#reducescatter)."""
    op = check_tensor_op(op)
    if op == Adasum:
        raise ConfigError(f"reducescatter '{name}' does not support op=Adasum (Adasum combines whole gradients); "
                          f"use op=Sum or op=Average, or allreduce(op=Adasum)")
    return op


def _native(comm: Communicator, ops: TensorOps, flat: Tensor, shape: tuple, dtype: str, op: str, pre: float,
            post: float, name: str) -> Work:
    """The backend's reduce-scatter (MPI_Reduce_scatter: (P-1)/P of the bytes each way instead of
    the allreduce's twice that), with the allreduce's scaling and integer rules."""
    floating = dtype in ("float32", "float64")
    row = math.prod(shape[1:])
    counts = [r * row for r in scatter_rows(shape[0], comm.size)]
    flat = (ops.scale(flat, pre) if pre != 1.0 else flat) if floating else _int_scale(ops, flat, pre, dtype)
    h = comm.reducescatter_tensor_async(ops, flat, counts, _WIRE_OP.get(op, "sum"), name)

    def finish() -> Tensor:
        part = comm.wait(h)
        if floating:
            f = post / comm.size if op == Average else post
            return ops.scale(part, f) if f != 1.0 else part
        if op == Average:
            part = ops.trunc_divide(part, comm.size)
        return _int_scale(ops, part, post, dtype)
    return Work(finish, (h,))


def grouped_reducescatter_async(comm: Communicator, ops: TensorOps, flats: Sequence[Tensor],
                                shapes: Sequence[Sequence[int]], *, op: str = Average, compression: Any = None,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                                name: str = "grouped_reducescatter") -> Work:
    """Reducescatter of several tensors with one check; ``wait()`` gives this rank's parts."""
    op = _scatter_op(op, name)
    comp = _compressor(compression)
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if any(not s for s in shapes):
        raise ConfigError(f"grouped_reducescatter '{name}': every tensor needs at least one dimension")
    dtypes = tuple(ops.dtype_name(f) for f in flats)
    req = Request("grouped_reducescatter", name, dtypes, tuple(shapes), op=op,
                  args=(float(prescale_factor), float(postscale_factor), _picklable(comp)))

    def start() -> Work:
        works = [_allreduce_payload(comm, ops, f, d, op, comp, float(prescale_factor), float(postscale_factor),
                                    f"{name}.{i}") for i, (f, d) in enumerate(zip(flats, dtypes))]
        return Work(lambda: [_my_part(ops, w.wait(), s, comm.rank, comm.size) for w, s in zip(works, shapes)],
                    [h for w in works for h in w._handles])
    return deferred(comm, req, start)
