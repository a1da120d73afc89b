"""Tensor collectives with Horovod's semantics, written once for both adapters.

The adapters' ``allreduce`` / ``allgather`` / ``broadcast`` / ``broadcast_parameters`` only
flatten their framework's tensors, call these, and reshape the result (and, in TensorFlow, wrap
the call for ``tf.function``). So both frameworks give the same answers, the same errors, and
the same compression rules: ``allreduce(t, compression=fp16)`` goes through the same
:class:`~hvd_commopt.reduce.dense.DenseAllreduce` as the gradients, which divides by P before
the half-precision sum so it cannot overflow.

All tensors here are flat (1-D) framework tensors handled through the adapter's
:class:`~hvd_commopt.tensor_ops.TensorOps`.
"""
from __future__ import annotations

from typing import Any, Sequence

from .buckets import Bucket, TensorSpec
from .comm.communicator import Communicator
from .compress.base import Compressor
from .engine.specs import verify_same_tensors
from .errors import ConfigError
from .reduce.adasum import AdasumReducer
from .reduce.base import Adasum, Average, ReduceContext, RoundInfo, check_op
from .reduce.dense import DenseAllreduce
from .tensor_ops import TensorOps

__all__ = ["allreduce", "allgather", "broadcast", "broadcast_tensors"]

Tensor = Any

_FLOATING = ("float64", "float32", "float16", "bfloat16")
_HALF = ("float16", "bfloat16")


def allreduce(comm: Communicator, ops: TensorOps, flat: Tensor, *, op: str = Average,
              compression: Compressor | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str = "allreduce") -> Tensor:
    """The average (default) or sum of ``flat`` over all ranks; ``flat`` may be overwritten.

    Integer tensors are summed exactly and averaged by floor division; their scale factors are
    applied in float64 and truncated back (Horovod's rule), those of half tensors in float32.
    Compression applies to floating tensors.
    """
    check_op(op)
    if compression is not None and not isinstance(compression, Compressor):
        raise ConfigError(f"the tensor allreduce takes a dense compression (Compression.none/fp16/bf16), got "
                          f"{compression!r}; sparse compression is for DistributedOptimizer's gradients")
    dtype = ops.dtype_name(flat)
    bucket = Bucket.single(name, ops.numel(flat), dtype)
    if op == Adasum:  # docs/adasum.md#adasum: no averaging, the operator is scale-equivariant
        if dtype not in _FLOATING:
            raise ConfigError(f"op=Adasum combines floating tensors, got {dtype} (use op=Sum for integers)")
        ctx = ReduceContext(comm, ops, prescale=float(prescale_factor), postscale=float(postscale_factor))
        return AdasumReducer(compression).reduce(bucket, RoundInfo(), flat, ctx)
    if dtype not in _FLOATING:
        flat = _scaled(ops, flat, prescale_factor, "float64")
        out = DenseAllreduce().reduce(bucket, RoundInfo(), flat, ReduceContext(comm, ops))
        out = ops.floor_divide(out, comm.size) if op == Average and comm.size > 1 else out
        return _scaled(ops, out, postscale_factor, "float64")
    if dtype in _HALF:  # the user's factors in float32, as Horovod scales half tensors on CPU
        flat = _scaled(ops, flat, prescale_factor, "float32")
        post = 1.0 / comm.size if op == Average else 1.0
        ctx = ReduceContext(comm, ops, postscale=post)
        return _scaled(ops, DenseAllreduce(compression).reduce(bucket, RoundInfo(), flat, ctx), postscale_factor,
                       "float32")
    post = postscale_factor / comm.size if op == Average else postscale_factor
    ctx = ReduceContext(comm, ops, prescale=float(prescale_factor), postscale=float(post))
    return DenseAllreduce(compression).reduce(bucket, RoundInfo(), flat, ctx)


def _scaled(ops: TensorOps, flat: Tensor, factor: float, via: str) -> Tensor:
    """``flat·factor`` computed in ``via`` and cast back (truncating, for integers): Horovod's
    scaling of integer tensors (in float64) and half tensors (in float32)."""
    if factor == 1.0:
        return flat
    dtype = ops.dtype_name(flat)
    return ops.cast(ops.scale(ops.cast(flat, via), float(factor)), dtype)


def allgather(comm: Communicator, ops: TensorOps, flat: Tensor, rest: tuple[int, ...], name: str = "allgather") -> Tensor:
    """Every rank's ``flat`` concatenated in rank order. ``flat`` holds a tensor of shape
    ``(d0,) + rest``; ``d0`` may differ across ranks, ``rest`` and the dtype may not.

    Raises:
        ConfigError: the trailing shapes or dtypes differ across ranks (on every rank).
    """
    if comm.size == 1:
        return flat
    dtype = ops.dtype_name(flat)
    seen = comm.allgather_object((tuple(rest), dtype), name=f"{name}.shape")
    if any(s != seen[0] for s in seen):
        desc = ", ".join(f"rank {r}: (*{', '.join(map(str, s[0]))}) {s[1]}" for r, s in enumerate(seen))
        raise ConfigError(f"allgather '{name}': tensors must agree beyond dim 0 in shape and dtype; got {desc}")
    return comm.wait(comm.allgather_tensor_async(ops, flat, name))[0]


def broadcast(comm: Communicator, ops: TensorOps, flat: Tensor, root: int = 0, name: str = "broadcast") -> Tensor:
    """Root's ``flat`` on every rank (``flat`` may be overwritten)."""
    if comm.size == 1:
        comm.check_rank(root, "root")
        return flat
    return comm.wait(comm.broadcast_tensor_async(ops, flat, root, name))


def broadcast_tensors(comm: Communicator, ops: TensorOps, specs: Sequence[TensorSpec], flats: Sequence[Tensor],
                      root: int = 0, what: str = "set of tensors to broadcast", label: str = "broadcast") -> list[Tensor]:
    """Root's values of many tensors, one fused broadcast per (dtype, device); flat results in
    the order given. The names, shapes and dtypes are checked across ranks first, so a model
    that differs fails with a clear :class:`~hvd_commopt.errors.RankMismatchError` instead of a
    mismatched broadcast."""
    verify_same_tensors(comm, list(specs), what=what)
    comm.check_rank(root, "root")
    if comm.size == 1:
        return list(flats)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, f in enumerate(flats):
        groups.setdefault((ops.dtype_name(f), ops.device_name(f)), []).append(i)
    out: list[Tensor] = [None] * len(flats)
    for (dtype, _dev), idx in sorted(groups.items()):
        fused = ops.cat([flats[i] for i in idx])
        fused = comm.wait(comm.broadcast_tensor_async(ops, fused, root, f"{label}.{dtype}"))
        off = 0
        for i in idx:
            n = ops.numel(flats[i])
            out[i] = ops.slice(fused, off, off + n)
            off += n
    return out
