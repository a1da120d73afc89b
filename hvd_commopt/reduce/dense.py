"""Dense allreduce of a bucket through an element-wise-summable compressor, optionally with a memory.

* ``DenseAllreduce()``: S-SGD's allreduce; ``DenseAllreduce(Compression.fp16)``: cast for the wire.
* ``DenseAllreduce(TernaryCompressor(theta, P), ErrorFeedback())``: CD-SGD's ternary signs with
  error feedback, summed as integers (:mod:`hvd_commopt.compress.ternary`).
* ``DenseAllreduce(NoneCompressor(), memory)``: send the bucket plus what ``memory`` remembers
  and clear it (CD-SGD's correction step with ``flush_residual_on_correction``).

With a memory, the NaN/Inf rule (docs/wrapper.md#nonfinite) needs this rank's verdict before the
memory is written. On host memory ``start`` reads it (``all_finite``). On the device route
(docs/wrapper.md#nonfinite-dense-device) nothing is read in ``start``: the verdict stays a device flag,
the payload and the memory's new values are the host route's by a ``where`` on the flag, and
``settle`` reports and rolls back with the flags the engine reads once per step
(docs/selection.md#one-read-per-step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..buckets import Bucket
from ..compress.base import Compressor
from ..compress.cast import NoneCompressor
from ..compress import nonfinite
from ..errors import ConfigError
from ..fusion.pricing import Pricing, dense_pricing
from ..host import ScheduleHost
from ..memory.base import Memory
from ..select.kernels import device_route
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
    # the round's fusion buffer where the payload is a cast of it, nothing reading it any more: the
    # cast back is written there (Compressor.decompress_into; docs/auto-compression.md#dense-path)
    into: Any = field(default=None, kw_only=True)


@dataclass
class _DeviceRound(DenseRound):
    """A round of the device route (docs/selection.md#device-route)."""

    local_ok: Any = None  # this rank's contribution was finite (a 0-d device flag)


def received(compressor: Compressor, pending: Pending, ctx: ReduceContext) -> Any:
    """A finished dense round's result (its state a :class:`DenseRound`): the reduced payload, or the
    sent one alone, decompressed and scaled by what is still to apply."""
    st: DenseRound = pending.state
    payload = ctx.comm.wait(pending.handles[0]) if pending.handles else st.payload
    out = (compressor.decompress(ctx.ops, payload, st.cctx) if st.into is None else
           compressor.decompress_into(ctx.ops, payload, st.cctx, st.into))
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
        local_ok, into = None, None
        if self.memory is None:
            payload, cctx = comp.compress(ops, flat)
            into = flat if payload is not flat else None  # a cast: flat is free for the cast back
        elif device_route(ops, flat):
            payload, cctx, local_ok = self._start_on_device(bucket, flat, ctx)
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
        st = (DenseRound(payload, cctx, post, into=into) if local_ok is None else
              _DeviceRound(payload, cctx, post, local_ok=local_ok))
        if comm.size == 1:
            return Pending(name, st)
        return Pending(name, st, (comm.allreduce_tensor_async(ops, payload, "sum", name),))

    def _start_on_device(self, bucket: Bucket, flat: Any, ctx: ReduceContext) -> tuple[Any, Any, Any]:
        """``start``'s memory step with no host decision: (payload, compressor context, this rank's
        finiteness flag ``ok``), every choice a ``where`` on ``ok`` (docs/wrapper.md#nonfinite-dense-device).

        The payload is the host route's: where ``ok`` is false, ``flat`` as it is when the payload
        can carry NaN/Inf, else zeros (ternary's integer signs: the contribution is dropped). The
        memory is written at once, as the host route leaves it where ``ok`` is false (a delayed
        schedule starts the next round before this one settles, so a later rollback would come too
        late): ``update_quantized(where(ok, acc, r), where(ok, sent, +0))`` stores ``acc - sent`` or
        ``r - 0 = r``, bit for bit. Where the host route has no residual (none yet, or a flush
        emptied it) this route may keep one of -0.0, the additive identity: ``x + -0.0`` is ``x``
        for every x, so the next sums are the same bits. The compensation is made in a copy (the
        adapter adds in place) because ``flat`` may still be sent."""
        ops, comp, mem, key = ctx.ops, self.compressor, self.memory, bucket.name
        assert mem is not None
        ok = ops.finite_flag(flat)
        r = mem.residual(ops, key, flat)
        acc = mem.compensate(ops, key, ops.clone(flat))
        if comp.lossless:  # everything is sent: the residual becomes -0.0 (the host route drops it)
            payload, cctx = comp.compress(ops, ops.where(ok, acc, flat))
            if r is not None:
                n, dt = ops.numel(flat), ops.dtype_name(flat)
                neg_zero = ops.scale(ops.zeros(n, dt, like=flat), -1.0)
                mem.update_quantized(ops, key, ops.where(ok, neg_zero, r), ops.zeros(n, dt, like=flat))
            return payload, cctx, ok
        payload, cctx = comp.compress(ops, acc)
        sent = comp.decompress(ops, payload, cctx)
        mem.update_quantized(ops, key, ops.where(ok, acc, -0.0 if r is None else r), ops.where(ok, sent, 0.0))
        if nonfinite.carries_nonfinite(ops, payload):
            return ops.where(ok, payload, comp.compress(ops, flat)[0]), cctx, ok
        return ops.where(ok, payload, 0), cctx, ok

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        out = received(self.compressor, pending, ctx)
        st = pending.state
        if isinstance(st, _DeviceRound) and nonfinite.carries_nonfinite(ctx.ops, st.payload):
            pending.finite = ctx.ops.finite_flag(out)  # read in settle, with the step's others
        return out

    def device_flags(self, bucket: Bucket, rnd: RoundInfo, pending: Pending) -> tuple[Any, ...] | None:
        """The device route's flags: this rank's finiteness, after the result's when the payload can
        carry NaN/Inf (theta times a sum of integer signs is finite: the local flag alone)."""
        st = pending.state
        if not isinstance(st, _DeviceRound):
            return None
        return (st.local_ok,) if pending.finite is None else (pending.finite, st.local_ok)

    def settle(self, bucket: Bucket, rnd: RoundInfo, out: Any, ctx: ReduceContext,
               pending: Pending | None = None, flags: tuple[bool, ...] | None = None) -> bool:
        """Roll the memory back when the reduced bucket is not finite (docs/wrapper.md#nonfinite); on
        the device route with the flags' values (``flags``, read by the engine with the step's
        others, else read here once): a rank whose own contribution was not finite is reported (its
        memory kept its values in ``start``, as the host route leaves it untouched)."""
        dev = self.device_flags(bucket, rnd, pending) if pending is not None else None
        if dev is not None:
            values = flags if flags is not None else ctx.ops.read_flags(list(dev))
            finite, local_ok = (True, values[0]) if len(values) == 1 else (values[0], values[1])
            if not local_ok:  # the memory kept its values already (_start_on_device)
                nonfinite.report(self.memory.nonfinite, ctx.comm.rank, bucket.name)
                self.memory.skip(bucket.name)
            if not finite:
                self.rollback(bucket, rnd, ctx)
            return bool(finite)
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
