"""Top-k S-SGD: allgather of every rank's (values, indices), then scatter-add and average.

Reference: the HKBU wrappers (OMGS-SGD ``hv_distributed_optimizer.py:
_sparse_allreduce_async``/``synchronize``; gtopkssgd), docs/topk.md#collective and docs/lags-omgs.md#lags-update (LAGS-SGD:
the same exchange per bucket, launched from the backward hooks). Traffic O(kP): each rank sends
its k values and k indices to each of the P-1 others.

Per bucket and step (the engine calls ``start`` as soon as the bucket is complete, so with one
bucket per layer, ``fusion_threshold=0``, this *is* LAGS-SGD, pipelined with backward): the
selection with error feedback of :class:`~hvd_commopt.reduce.sparse.SparseReducer`, then one
allgather of (values, int32 indices) packed as bytes -> out = scatter_add(zeros, idx_all,
vals_all)·postscale.

Choices (beyond the sparse reducers' shared ones, :mod:`hvd_commopt.reduce.sparse`):

* A compressor whose indices are identical on every rank (``collective == "allreduce"``,
  random-k) has its k values allreduced instead: O(k) traffic and no indices.
* With one rank nothing is communicated; the result is the local selection (scattered).
* Values and indices travel as ONE byte message per rank (:mod:`hvd_commopt.reduce.packed`,
  docs/topk.md#one-message): one collective per bucket instead of two, the same bytes.
* When the selection is the exact top-k (k fixed by bucket and step, the same on every rank)
  the allgather skips its size exchange (docs/topk.md#equal-sizes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..buckets import Bucket
from ..select import grad_parts
from ..compress.selector import Selector
from ..errors import ConfigError
from ..fusion.pricing import Pricing, sparse_pricing
from ..memory.base import Memory
from ..memory.error_feedback import ErrorFeedback
from .base import Pending, ReduceContext, RoundInfo
from .packed import pack_parts, unpack_gathered
from .sparse import SparseReducer, index_dtype_for

__all__ = ["SparseAllgather"]


@dataclass
class _Sparse:
    """A selection on its way: ``mode`` is "local" (one rank), "allreduce" (values only, the
    same indices everywhere) or "allgather" (values and indices)."""

    mode: str
    vals: Any
    idx: Any
    n: int
    out: Any = None  # the round's bucket buffer, free after start: the result is built in it

    @property
    def local(self) -> bool:
        return self.mode == "local"


class SparseAllgather(SparseReducer):
    """Sparsified reduction of a bucket: local selection + error feedback + allgather.

    Args:
        compressor: the selector (``TopKSelector``, ``RandomKSelector``, ``DGCSelector``).
        memory: ``ErrorFeedback()`` (default), ``ErrorFeedback(enabled=False)`` or ``DGCMemory``.
        index_dtype: "int32", "int64" or None (int32 when it can hold every index).
        dense_when_full: reduce buckets with k == n by a dense allreduce (see the module doc).

    Example::

        reducer = SparseAllgather(TopKSelector(0.001))        # = Compression.topk(0.001)
        opt = DistributedOptimizer(opt, model.named_parameters(), compression=reducer,
                                   fusion_threshold=0)        # 0: one bucket per layer (LAGS)
    """

    name = "sparse_allgather"

    @property
    def method(self) -> str:
        """``Compression.topk``, ``randomk`` or ``dgc``: the selector's name."""
        return self.compressor.name

    def __init__(self, compressor: Selector, memory: Memory | None = None, index_dtype: str | None = None,
                 dense_when_full: bool = True):
        if not isinstance(compressor, Selector):
            raise ConfigError(f"SparseAllgather needs a sparse compressor (top-k, random-k, DGC), got "
                              f"{compressor!r}; dense compressors go through DenseAllreduce")
        if compressor.collective not in ("sparse", "allreduce"):
            raise ConfigError(f"{compressor!r} declares collective {compressor.collective!r}; "
                              f"SparseAllgather serves 'sparse' and 'allreduce'")
        super().__init__(compressor, memory if memory is not None else ErrorFeedback(), index_dtype,
                         dense_when_full)

    # -- the Reducer interface ----------------------------------------------------------------
    def reads_parts(self, bucket: Bucket, ops: Any) -> bool:
        """The engine may hand :meth:`start` this bucket's gradients unpacked (docs/selection.md#grad-parts)."""
        return self.selection_reads_parts(bucket, ops)

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm = ctx.ops, ctx.comm
        sel = self.select(bucket, rnd, flat, ctx)
        if isinstance(sel, Pending):
            return sel
        vals, idx, n = sel
        flat = grad_parts.like(flat)  # unpacked gradients (reads_parts): their buffer is free all the same
        name = rnd.wire(bucket)
        if comm.size == 1:
            return Pending(name, _Sparse("local", vals, idx, n, flat))
        if self.compressor.collective == "allreduce":  # same indices everywhere: sum the values
            h = comm.allreduce_tensor_async(ops, vals, "sum", f"{name}.values")
            return Pending(name, _Sparse("allreduce", vals, idx, n, flat), (h,))
        wire_idx = ops.cast(idx, index_dtype_for(n, self.index_dtype))
        # an exact top-k sends k entries on every rank: no size round (docs/topk.md#equal-sizes)
        h = comm.allgather_tensor_async(ops, pack_parts(ops, (vals, wire_idx)), f"{name}.sparse",
                                        equal=self.compressor.sends_k)
        return Pending(name, _Sparse("allgather", vals, wire_idx, n, flat), (h,))

    def exchanged(self, pending: Pending, ctx: ReduceContext) -> tuple[Any, Any]:
        st, comm = pending.state, ctx.comm
        if st.mode == "allreduce":
            return st.idx, comm.wait(pending.handles[0])
        ops = ctx.ops
        buf, counts = comm.wait(pending.handles[0])
        vals, idx = unpack_gathered(ops, buf, counts, (ops.dtype_name(st.vals), ops.dtype_name(st.idx)))
        return ops.cast(idx, "int64"), vals

    # -- pricing and state ------------------------------------------------------------------
    def price(self, cost: Any, select_s: float | None = None, select_c0: float = 0.0) -> Pricing:
        kind = "randomk" if self.compressor.collective == "allreduce" else "topk"
        return sparse_pricing(cost, kind, self.density, select_s, select_c0)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the selector (DGC's sparsity warm-up)."""
        self.compressor.set_epoch(epoch)

    def __repr__(self) -> str:
        return f"SparseAllgather({self.compressor!r}, {self.memory!r})"
