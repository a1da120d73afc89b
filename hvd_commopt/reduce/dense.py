"""Dense allreduce of a bucket, through any element-wise-summable compressor (none/fp16/bf16)."""
from __future__ import annotations

from typing import Any

from ..compress.base import Compressor
from ..compress.cast import NoneCompressor
from ..errors import ConfigError
from .base import Pending, ReduceContext, Reducer

__all__ = ["DenseAllreduce"]


class DenseAllreduce(Reducer):
    """compress -> allreduce(sum) -> decompress -> scale.

    With one rank the collective is skipped (the result is the local bucket, scaled), so
    ``python train.py`` pays no communication cost.
    """

    name = "allreduce"

    def __init__(self, compressor: Compressor | None = None):
        self.compressor = compressor or NoneCompressor()
        if self.compressor.collective != "allreduce":
            raise ConfigError(f"{self.compressor!r} needs a '{self.compressor.collective}' exchange, "
                              f"not an allreduce; build the optimizer with its own reducer")

    def start(self, name: str, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm = ctx.ops, ctx.comm
        pre, post = ctx.prescale, ctx.postscale
        if self.compressor.predivide:  # take the whole average before the narrow sum
            pre, post = ctx.prescale * ctx.postscale, 1.0
        if pre != 1.0:
            flat = ops.scale(flat, pre)
        payload, cctx = self.compressor.compress(ops, flat)
        if comm.size == 1:
            return Pending(name, (payload, cctx, None, post))
        if comm.buffer_kind == "numpy":
            host = ops.to_numpy(payload)
            handle = comm.allreduce_async_(host, "sum", name)
            return Pending(name, (payload, cctx, host, post), (handle,))
        handle = comm.allreduce_async_(payload, "sum", name)
        return Pending(name, (payload, cctx, None, post), (handle,))

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        ops = ctx.ops
        payload, cctx, host, post = pending.state
        for h in pending.handles:
            ctx.comm.wait(h)
        if host is not None:
            payload = ops.from_numpy(host, like=payload)  # zero-copy on CPU; a device copy on GPU
        out = self.compressor.decompress(ops, payload, cctx)
        if post != 1.0:
            out = ops.scale(out, post)
        return out
