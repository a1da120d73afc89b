"""The sub-reducer of each method ``compression="auto"`` can choose, over the shared memory
(docs/auto-compression.md#shared-memory)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..buckets import Bucket
from ..compress import nonfinite
from ..compress.base import Compressor
from ..compress.cast import BF16Compressor, FP16Compressor
from ..compress.randomk import RandomKSelector
from ..compress.topk import TopKSelector
from ..memory.momentum import MomentumCorrection
from ..reduce.base import Pending, ReduceContext, Reducer, RoundInfo
from ..reduce.dense import DenseRound, received
from ..reduce.gtopk import GTopK
from ..reduce.oktopk import OkTopK
from ..reduce.sparse import prescaled
from ..reduce.sparse_allgather import SparseAllgather
from .options import Method

__all__ = ["CastWithMemory", "build_method", "MIN_K"]

#: The fewest elements a sparse bucket sends (as Compression.topk's default, docs/topk.md#density-floor).
MIN_K = 16


@dataclass
class _Cast(DenseRound):
    key: str  # the bucket whose memory finish_dense updates


class CastWithMemory(Reducer):
    """The density-1 path of the sparse reducers with the payload cast to 16 bits: ``flat`` plus
    the memory's dense compensation, cast, allreduced, cast back, then ``finish_dense`` (the
    momentum of momentum correction applied to the average). Like DDP's bf16 hook, the cast's
    rounding is not remembered."""

    def __init__(self, compressor: Compressor, memory: MomentumCorrection):
        self.compressor, self.memory = compressor, memory
        self.name = f"auto-{compressor.name}"

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm = ctx.ops, ctx.comm
        flat = prescaled(flat, ctx)
        self.memory.snapshot(ops, bucket.name, flat, rnd.step)
        if ops.all_finite(flat):
            x = self.memory.compensate_dense(ops, bucket.name, flat)
        else:  # docs/wrapper.md#nonfinite: the memory never sees it
            nonfinite.report(self.memory.nonfinite, comm.rank, bucket.name)
            self.memory.skip(bucket.name)
            x = flat
        post = ctx.postscale
        if self.compressor.predivide and post != 1.0:  # the average before the narrow sum
            x, post = ops.scale(x, post), 1.0
        payload, cctx = self.compressor.compress(ops, x)
        name = rnd.wire(bucket)
        if comm.size == 1:
            return Pending(name, _Cast(payload, cctx, post, bucket.name))
        handle = comm.allreduce_tensor_async(ops, payload, "sum", name)
        return Pending(name, _Cast(payload, cctx, post, bucket.name), (handle,))

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        st: _Cast = pending.state
        out = received(self.compressor, pending, ctx)
        if not ctx.ops.all_finite(out):
            return out  # skipped step: the momentum must not see it
        return self.memory.finish_dense(ctx.ops, st.key, out)

    def settle(self, bucket: Bucket, rnd: RoundInfo, out: Any, ctx: ReduceContext,
               pending: Pending | None = None, flags: tuple[bool, ...] | None = None) -> bool:
        if ctx.ops.all_finite(out):
            return True
        self.rollback(bucket, rnd, ctx)
        return False

    def rollback(self, bucket: Bucket, rnd: RoundInfo, ctx: ReduceContext) -> None:
        self.memory.rollback(ctx.ops, bucket.name, rnd.step)


def build_method(method: Method, memory: MomentumCorrection) -> Reducer:
    """The sub-reducer of ``method`` over the shared ``memory``."""
    k, d = method.kind, method.density
    if k == "none":
        return SparseAllgather(TopKSelector(1.0, min_k=1), memory)
    if k in ("bf16", "fp16"):
        return CastWithMemory(BF16Compressor() if k == "bf16" else FP16Compressor(), memory)
    if k in ("topk", "dgc"):  # DGC: the sampled threshold over the same momentum-corrected memory
        return SparseAllgather(TopKSelector(d, "sampled" if k == "dgc" else "exact", min_k=MIN_K), memory)
    if k == "randomk":
        return SparseAllgather(RandomKSelector(d, seed=0, min_k=MIN_K), memory)
    if k == "gtopk":
        return GTopK(d, memory=memory, min_k=MIN_K)
    if k == "oktopk":
        return OkTopK(d, memory=memory, min_k=MIN_K)
    raise ValueError(f"unknown method {method!r}")


