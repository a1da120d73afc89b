"""The sub-reducer of each method ``compression="auto"`` can choose, over the shared memory
(docs/auto-compression.md#shared-memory). The quantisers are ``Compression.quantize(bits)``'s
dense exchange (all-to-all of the quantised parts, the owners' sums quantised again and
all-gathered) with that memory in place of their own error feedback: momentum correction's
velocity is quantised and what rounding dropped stays in it (docs/auto-compression.md#quantised)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..buckets import Bucket
from ..compress.base import Compressor
from ..compress.cast import BF16Compressor, FP16Compressor
from ..compress.randomk import RandomKSelector
from ..compress.topk import TopKSelector
from ..reduce.base import Pending, ReduceContext, Reducer, RoundInfo
from ..reduce.dense import DenseRound, received
from ..reduce.gtopk import GTopK
from ..reduce.oktopk import OkTopK
from ..reduce.quantized import QuantizedAllreduce
from ..reduce.sparse import prescaled
from ..reduce.sparse_allgather import SparseAllgather
from .dense import AutoMemory, DenseMomentum, MomentumAverage
from .options import Method

__all__ = ["CastWithMemory", "build_method", "MIN_K"]

#: The fewest elements a sparse bucket sends (as Compression.topk's default, docs/topk.md#density-floor).
MIN_K = 16


@dataclass
class _Cast(DenseRound):
    key: str  # the bucket whose momentum finish applies


class CastWithMemory(MomentumAverage):
    """Dense fp32's round (:class:`~hvd_commopt.autocompress.dense.DenseMomentum`) with the payload
    cast to 16 bits: the bucket cast, allreduced, cast back, then the momentum of momentum correction
    applied to the average (:meth:`AutoMemory.finish_average`). Like DDP's bf16 hook, the cast's
    rounding is not remembered; nothing enters the memory before the reduction, so no finiteness
    pass runs before it (docs/auto-compression.md#dense-path)."""

    def __init__(self, compressor: Compressor, memory: AutoMemory):
        self.compressor, self.memory = compressor, memory
        self.name = f"auto-{compressor.name}"
        self.verdict = True

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm = ctx.ops, ctx.comm
        x = prescaled(flat, ctx)
        self.memory.snapshot(ops, bucket.name, x, rnd.step)
        post = ctx.postscale
        if self.compressor.predivide and post != 1.0:  # the average before the narrow sum
            x, post = ops.scale(x, post), 1.0
        payload, cctx = self.compressor.compress(ops, x)
        name = rnd.wire(bucket)
        st = _Cast(payload, cctx, post, bucket.name, into=x if payload is not x else None)  # cast back into x
        if comm.size == 1:
            return Pending(name, st)
        handle = comm.allreduce_tensor_async(ops, payload, "sum", name)
        return Pending(name, st, (handle,))

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        st: _Cast = pending.state
        out = received(self.compressor, pending, ctx)
        out, pending.finite = self.memory.finish_average(ctx.ops, st.key, out, 1.0, self.verdict)
        return out



def build_method(method: Method, memory: AutoMemory) -> Reducer:
    """The sub-reducer of ``method`` over the shared ``memory``."""
    k, d = method.kind, method.density
    if k == "none":
        return DenseMomentum(memory)
    if k in ("bf16", "fp16"):
        return CastWithMemory(BF16Compressor() if k == "bf16" else FP16Compressor(), memory)
    if method.quantised:  # Compression.quantize(bits)'s exchange over the shared memory
        return QuantizedAllreduce(method.bits, memory=memory, whole_round_alone=True)
    if k in ("topk", "dgc", "dgc_masked"):  # DGC: the sampled threshold over the same momentum-corrected
        # memory; dgc_masked's buckets also have their momentum masked where sent (AutoMemory.masked)
        return SparseAllgather(TopKSelector(d, "exact" if k == "topk" else "sampled", min_k=MIN_K), memory)
    if k == "randomk":
        return SparseAllgather(RandomKSelector(d, seed=0, min_k=MIN_K), memory)
    if k == "gtopk":
        return GTopK(d, memory=memory, min_k=MIN_K)
    if k == "oktopk":
        return OkTopK(d, memory=memory, min_k=MIN_K)
    raise ValueError(f"unknown method {method!r}")


