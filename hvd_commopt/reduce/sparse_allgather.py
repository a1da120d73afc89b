"""Top-k S-SGD: allgather of every rank's (values, indices), then scatter-add and average.

Reference: the HKBU wrappers (OMGS-SGD ``hv_distributed_optimizer.py:
_sparse_allreduce_async``/``synchronize``; gtopkssgd), spec §2.1 (c) and §9.1/§9.3 (LAGS-SGD:
the same exchange per bucket, launched from the backward hooks). Traffic O(kP): each rank sends
its k values and k indices to each of the P-1 others.

Per bucket and step (the engine calls ``start`` as soon as the bucket is complete, so with one
bucket per layer, ``fusion_threshold=0``, this *is* LAGS-SGD, pipelined with backward)::

    acc          = prescale·flat + residual          memory.compensate
    (vals, idx)  = compressor.select(acc)            exact top-k / random-k / DGC threshold
    residual     = acc, zeroed at idx                memory.update (bit-exact partition)
    two allgathers (values, int32 indices) -> out = scatter_add(zeros, idx_all, vals_all)·postscale

Choices:

* The memory update happens in ``start``, not in ``finish``: the bucket buffer is free again
  as soon as ``start`` returns and nothing depends on when ``finish`` runs (delayed schedules
  may finish a step after the next one started).
* Indices travel as int32 while the bucket has fewer than 2^31 elements, else int64 (never as
  floats: spec §8.8, §11.7).
* A compressor whose indices are identical on every rank (``collective == "allreduce"``,
  random-k) has its k values allreduced instead: O(k) traffic and no indices.
* A bucket whose k equals its size (density 1) is reduced by a dense allreduce of ``acc``
  (``dense_when_full``): the same result as a sparse exchange of everything, with the traffic
  and the summation order of dense S-SGD, so "density 1 equals dense" holds bit for bit
  (spec §11.12: same collective). The residual becomes zero.
* With one rank nothing is communicated; the result is the local selection (scattered).
"""
from __future__ import annotations

from typing import Any

from ..compress.error_feedback import ErrorFeedback
from ..compress.topk import SparseCompressor, bucket_key
from ..errors import ConfigError
from .base import Pending, ReduceContext, Reducer

__all__ = ["SparseAllgather", "index_dtype_for", "begin_bucket", "dense_start", "dense_finish"]

INDEX_DTYPES = ("int32", "int64")


def index_dtype_for(n: int, requested: str | None = None) -> str:
    """The wire dtype of indices into a bucket of n elements (int32 unless it cannot hold them)."""
    if requested is None:
        return "int32" if n < 2 ** 31 else "int64"
    if requested not in INDEX_DTYPES:
        raise ConfigError(f"index_dtype must be one of {INDEX_DTYPES} or None (automatic), got {requested!r}; "
                          f"indices are never sent as floats (exact only below 2^24)")
    if requested == "int32" and n >= 2 ** 31:
        raise ConfigError(f"a bucket of {n} elements needs int64 indices; use index_dtype='int64' or None")
    return requested


def _launch(ctx: ReduceContext, kind: str, t: Any, name: str):
    """Start an allreduce(sum) or allgather of t; returns (handle, host buffer or None)."""
    comm, ops = ctx.comm, ctx.ops
    buf = ops.to_numpy(t) if comm.buffer_kind == "numpy" else t
    h = comm.allreduce_async_(buf, "sum", name) if kind == "allreduce" else comm.allgather_async(buf, name)
    return h, (buf if comm.buffer_kind == "numpy" else None)


def _result(ctx: ReduceContext, handle, host, like: Any, kind: str) -> Any:
    out = ctx.comm.wait(handle)
    if kind == "allgather":
        out = out[0]
    if host is not None or ctx.comm.buffer_kind == "numpy":
        out = ctx.ops.from_numpy(out, like=like)
    return out


def begin_bucket(steps: dict[str, int], name: str, flat: Any, ctx: ReduceContext) -> tuple[str, int, Any]:
    """The prologue every sparse reducer shares: the bucket's state key (whatever round tag the
    wire name carries), this bucket's step number (counted in ``steps``), and the prescaled bucket."""
    key = bucket_key(name)
    step = steps.get(key, 0)
    steps[key] = step + 1
    if ctx.prescale != 1.0:
        flat = ctx.ops.scale(flat, ctx.prescale)
    return key, step, flat


def dense_start(memory: Any, key: str, name: str, flat: Any, ctx: ReduceContext) -> Pending:
    """Density-1 path shared by the sparse reducers: allreduce(sum) of ``flat + residual``.

    ``key`` names the bucket's state (memory), ``name`` the collective."""
    x = memory.compensate_dense(ctx.ops, key, flat)
    if ctx.comm.size == 1:
        return Pending(name, ("dense", x, None, key))
    h, host = _launch(ctx, "allreduce", x, f"{name}.dense")
    return Pending(name, ("dense", x, host, key), (h,))


def dense_finish(memory: Any, pending: Pending, ctx: ReduceContext) -> Any:
    ops = ctx.ops
    _, x, host, key = pending.state
    if pending.handles:
        ctx.comm.wait(pending.handles[0])
        if host is not None:
            x = ops.from_numpy(host, like=x)
    if ctx.postscale != 1.0:
        x = ops.scale(x, ctx.postscale)
    return memory.finish_dense(ops, key, x)


class SparseAllgather(Reducer):
    """Sparsified reduction of a bucket: local selection + error feedback + allgather.

    Args:
        compressor: the selection (``TopKCompressor``, ``RandomKCompressor``, ``DGCCompressor``).
        memory: ``ErrorFeedback()`` (default), ``ErrorFeedback(enabled=False)`` or ``DGCMemory``.
        index_dtype: "int32", "int64" or None (int32 when it can hold every index).
        dense_when_full: reduce buckets with k == n by a dense allreduce (see the module doc).

    Example::

        reducer = SparseAllgather(TopKCompressor(0.001))      # = Compression.topk(0.001)
        opt = DistributedOptimizer(opt, model.named_parameters(), compression=reducer,
                                   fusion_threshold=0)        # 0: one bucket per layer (LAGS)
    """

    name = "sparse_allgather"

    def __init__(self, compressor: SparseCompressor, memory: Any = None, index_dtype: str | None = None,
                 dense_when_full: bool = True):
        if not isinstance(compressor, SparseCompressor):
            raise ConfigError(f"SparseAllgather needs a sparse compressor (top-k, random-k, DGC), got "
                              f"{compressor!r}; dense compressors go through DenseAllreduce")
        if compressor.collective not in ("sparse", "allreduce"):
            raise ConfigError(f"{compressor!r} declares collective {compressor.collective!r}; "
                              f"SparseAllgather serves 'sparse' and 'allreduce'")
        index_dtype_for(0, index_dtype)  # validate early
        self.compressor = compressor
        self.memory = memory if memory is not None else ErrorFeedback()
        self.index_dtype = index_dtype
        self.dense_when_full = bool(dense_when_full)
        self._steps: dict[str, int] = {}

    # -- the Reducer interface ----------------------------------------------------------------
    def start(self, name: str, flat: Any, ctx: ReduceContext) -> Pending:
        ops = ctx.ops
        key, step, flat = begin_bucket(self._steps, name, flat, ctx)
        n = ops.numel(flat)
        if self.dense_when_full and self.compressor.k_for(key, n, step) >= n:
            return dense_start(self.memory, key, name, flat, ctx)
        acc = self.memory.compensate(ops, key, flat)
        vals, idx = self.compressor.select(ops, acc, key, step)
        self.memory.update(ops, key, acc, idx)
        if ctx.comm.size == 1:
            return Pending(name, ("local", vals, idx, n))
        if self.compressor.collective == "allreduce":  # same indices everywhere: sum the values
            h, host = _launch(ctx, "allreduce", vals, f"{name}.values")
            return Pending(name, ("allreduce", vals, idx, n, host), (h,))
        wire_idx = ops.cast(idx, index_dtype_for(n, self.index_dtype))
        hv, _ = _launch(ctx, "allgather", vals, f"{name}.values")
        hi, _ = _launch(ctx, "allgather", wire_idx, f"{name}.indices")
        return Pending(name, ("allgather", vals, wire_idx, n), (hv, hi))

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        kind = pending.state[0]
        if kind == "dense":
            return dense_finish(self.memory, pending, ctx)
        ops = ctx.ops
        _, vals, idx, n = pending.state[:4]
        if kind == "allreduce":
            vals = _result(ctx, pending.handles[0], pending.state[4], vals, "allreduce")
        elif kind == "allgather":
            vals = _result(ctx, pending.handles[0], None, vals, "allgather")
            idx = ops.cast(_result(ctx, pending.handles[1], None, idx, "allgather"), "int64")
        out = ops.scatter_add(ops.zeros(n, ops.dtype_name(vals), like=vals), idx, vals)
        return ops.scale(out, ctx.postscale) if ctx.postscale != 1.0 else out

    # -- state --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the compressor (DGC's sparsity warm-up)."""
        if hasattr(self.compressor, "set_epoch"):
            self.compressor.set_epoch(epoch)

    def residual(self, ops: Any, name: str, like: Any) -> Any | None:
        """The memory's residual (velocity for DGC) of bucket ``name``; None = zero."""
        return self.memory.residual(ops, bucket_key(name), like)

    def state_dict(self) -> dict:
        return {"steps": dict(self._steps), "memory": self.memory.state_dict(),
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._steps = {str(k): int(v) for k, v in dict(state.get("steps", {})).items()}
        self.memory.load_state_dict(dict(state.get("memory", {})))
        self.compressor.load_state_dict(dict(state.get("compressor", {})))

    def __repr__(self) -> str:
        return f"SparseAllgather({self.compressor!r}, {self.memory!r})"
