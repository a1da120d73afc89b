"""Dense allreduce of a bucket through an element-wise-summable compressor, optionally with a memory.

* ``DenseAllreduce()``: S-SGD's allreduce; ``DenseAllreduce(Compression.fp16)``: cast for the wire.
* ``DenseAllreduce(TernaryCompressor(theta, P), ErrorFeedback())``: CD-SGD's ternary signs with
  error feedback, summed as integers (:mod:`hvd_commopt.compress.ternary`).
* ``DenseAllreduce(NoneCompressor(), memory)``: send the bucket plus what ``memory`` remembers
  and clear it (CD-SGD's correction step with ``flush_residual_on_correction``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..buckets import Bucket
from ..compress.base import Compressor
from ..compress.cast import NoneCompressor
from ..compress import nonfinite
from ..errors import ConfigError
from ..fusion.pricing import Pricing, dense_pricing
from ..host import ScheduleHost
from ..memory.base import Memory
from ..tensor_ops import TensorOps
from .base import Pending, ReduceContext, Reducer, RoundInfo
from .momentum import bind_momentum_memory

__all__ = ["DenseAllreduce", "DenseRound", "received"]


@dataclass
class DenseRound:
    """A dense round in flight (the state of its Pending); :func:`received` finishes it."""

    payload: Any  # what was sent (reduced in place, or the tensor the handle gives back)
    cctx: Any     # the compressor's context for decompress
    post: float   # scaling still to apply to the reduced result


def received(compressor: Compressor, pending: Pending, ctx: ReduceContext) -> Any:
    """A finished dense round's result (its state a :class:`DenseRound`): the reduced payload, or the
    sent one alone, decompressed and scaled by what is still to apply."""
    st: DenseRound = pending.state
    payload = ctx.comm.wait(pending.handles[0]) if pending.handles else st.payload
    out = compressor.decompress(ctx.ops, payload, st.cctx)
    return ctx.ops.scale(out, st.post) if st.post != 1.0 else out


class DenseAllreduce(Reducer):
    """compress -> allreduce(sum) -> decompress -> scale.

    Args:
        compressor: none (default), fp16, bf16, ternary, or any ``collective == "allreduce"``
            compressor.
        memory: remember what a lossy compressor did not send (error feedback), keyed by the
            bucket's name; with a lossless compressor the memory is sent along and cleared.

    With one rank the collective is skipped (the result is the local bucket, scaled), so
    ``python train.py`` pays no communication cost.
    """

    name = "allreduce"

    def __init__(self, compressor: Compressor | None = None, memory: Memory | None = None):
        self.compressor = compressor or NoneCompressor()
        if self.compressor.collective != "allreduce":
            raise ConfigError(f"{self.compressor!r} needs a '{self.compressor.collective}' exchange, "
                              f"not an allreduce; build the optimizer with its own reducer")
        self.memory = memory

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm, comp = ctx.ops, ctx.comm, self.compressor
        name = rnd.wire(bucket)
        pre, post = ctx.prescale, ctx.postscale
        if comp.predivide:  # take the whole average before the narrow sum
            pre, post = ctx.prescale * ctx.postscale, 1.0
        if pre != 1.0:
            flat = ops.scale(flat, pre)
        if self.memory is not None:
            self.memory.snapshot(ops, bucket.name, flat, rnd.step)
        if self.memory is None:
            payload, cctx = comp.compress(ops, flat)
        elif not ops.all_finite(flat):  # docs/wrapper.md#nonfinite: the memory never sees it
            nonfinite.report(self.memory.nonfinite, comm.rank, bucket.name)
            self.memory.skip(bucket.name)
            payload, cctx = comp.compress(ops, flat)
            if not nonfinite.carries_nonfinite(ops, payload):  # integer signs: drop the contribution
                payload, cctx = comp.compress(ops, ops.zeros(ops.numel(flat), ops.dtype_name(flat), like=flat))
        elif comp.lossless:  # everything is sent: the remembered part goes along and is cleared
            payload, cctx = comp.compress(ops, self.memory.compensate_dense(ops, bucket.name, flat))
        else:
            acc = self.memory.compensate(ops, bucket.name, flat)
            payload, cctx = comp.compress(ops, acc)
            self.memory.update_quantized(ops, bucket.name, acc, comp.decompress(ops, payload, cctx))
        if comm.size == 1:
            return Pending(name, DenseRound(payload, cctx, post))
        handle = comm.allreduce_tensor_async(ops, payload, "sum", name)
        return Pending(name, DenseRound(payload, cctx, post), (handle,))

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        return received(self.compressor, pending, ctx)

    def settle(self, bucket: Bucket, rnd: RoundInfo, out: Any, ctx: ReduceContext,
               pending: Pending | None = None, flags: tuple[bool, ...] | None = None) -> bool:
        if pending is not None and not nonfinite.carries_nonfinite(ctx.ops, pending.state.payload):
            return True  # theta times a sum of integer signs is finite: no host decision needed
        if self.memory is not None and not ctx.ops.all_finite(out):
            self.rollback(bucket, rnd, ctx)
            return False
        return True

    def rollback(self, bucket: Bucket, rnd: RoundInfo, ctx: ReduceContext) -> None:
        if self.memory is not None:
            self.memory.rollback(ctx.ops, bucket.name, rnd.step)

    def config(self) -> dict:
        return {"reducer": self.name, "compressor": self.compressor.config(),
                "memory": None if self.memory is None else self.memory.config()}

    def price(self, cost: Any, select_s: float | None = None, select_c0: float = 0.0) -> Pricing:
        ratio = self.compressor.wire_bytes_ratio
        what = "dense allreduce" if ratio == 1.0 else f"allreduce of {self.compressor.name} ({ratio:g} of the bytes)"
        return dense_pricing(cost, ratio, what)

    def bind_host(self, host: ScheduleHost, names: list[str]) -> Any:
        """A memory that applies momentum takes the wrapped optimizer's (docs/dgc.md#optimizer-momentum)."""
        return None if self.memory is None else bind_momentum_memory(self.memory, host, names)

    def relayout(self, ops: TensorOps, old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
        """The memory's per-bucket state follows its tensors (docs/lags-omgs.md#replan-residuals)."""
        if self.memory is not None:
            self.memory.relayout(ops, old, new)

    @property
    def holds_rank_state(self) -> bool:  # type: ignore[override]  # the base's class-level default, computed here
        return self.memory is not None

    def state_dict(self) -> dict:
        return {} if self.memory is None else {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.memory is None:
            super().load_state_dict(state)
        else:
            self.memory.load_state_dict(dict(state.get("memory", {})))

    def __repr__(self) -> str:
        return f"DenseAllreduce({self.compressor!r}" + (f", {self.memory!r})" if self.memory else ")")
