"""CD-SGD: OD-SGD's one-step delay + ternary gradients with error feedback + k-step correction.

Paper: Yu, Dong, Xu, Ouyang, Liao, "CD-SGD: Distributed Stochastic Gradient Descent with
Compression and Delay Compensation", arXiv:2106.10796; reference Tugraph/CD-SGD (spec §5).

Per step t after warm-up (OD-SGD's structure, :mod:`hvd_commopt.schedule.delayed`, k = 1):
the local update uses the full-precision local gradient; round t is reduced

* in full precision when ``t % correction_every == 0`` (the "k-step correction"; the reference's
  ``count % compress_steps`` on the global iteration count), else
* as ternary signs: per bucket, ``r <- r + g``; ``s = +1 if r >= theta, -1 if r <= -theta, else 0``;
  ``r <- r - theta*s`` (MXNet's ``quantize_2bit``, §5.1), and the signs are **summed exactly as
  an int8 allreduce** (§5.3 "recommended, exact"): ``sum_i q_i = theta * sum_i s_i``. That is
  the server's dequantize-then-sum with one rounding (theta times an integer) instead of P-1,
  and bit-identical to it when theta is a power of two (T-CD-4). Traffic: 1 byte per element
  instead of 4.

Overflow guard: ``sum_i s_i`` lies in [-P, P], so int8 is exact for P <= 127; larger jobs use int16
(P <= 32767) and then int32, chosen once from the communicator's size.

Warm-up steps are synchronous and uncompressed (the reference's ``count <= 1000``).

Residual on correction steps (``flush_residual_on_correction``): False (default, the reference
code): the raw gradient is sent and the residual is neither flushed nor updated; it keeps feeding
later compressed steps. True: the correction sends ``g + r`` and zeroes ``r``, so nothing is
left behind after a correction step.

Residuals are keyed by bucket (the wire name without its ``@r<step>`` round tag) and reset if a
new fusion plan changes the bucket's size.
"""
from __future__ import annotations

import re
from typing import Any

from ..reduce.base import Pending, ReduceContext, Reducer
from ..reduce.dense import DenseAllreduce
from .config import CDConfig
from .delayed import DelayedScheduler

__all__ = ["CDScheduler", "TernaryAllreduce", "FlushingCorrection", "wire_dtype_for", "bucket_key"]

_TAG = re.compile(r"@r\d+$")


def bucket_key(wire_name: str) -> str:
    """The bucket a round's collective belongs to: the name without the ``@r<step>`` tag."""
    return _TAG.sub("", wire_name)


def wire_dtype_for(size: int) -> str:
    """Smallest integer type in which a sum of ``size`` values in {-1, 0, 1} cannot overflow."""
    if size <= 127:
        return "int8"
    if size <= 32767:
        return "int16"
    return "int32"


class TernaryAllreduce(Reducer):
    """Error-feedback ternary quantization, summed as integers (spec §5.1, §5.3).

    Args:
        theta: the quantizer's threshold on the gradient it is given.
        size: the number of ranks (chooses the wire dtype).
    """

    name = "ternary"

    def __init__(self, theta: float, size: int):
        self.theta = float(theta)
        self.wire_dtype = wire_dtype_for(size)
        self.residuals: dict[str, Any] = {}

    def residual_for(self, ops: Any, key: str, flat: Any) -> Any:
        r = self.residuals.get(key)
        if r is None or ops.numel(r) != ops.numel(flat):
            r = ops.zeros(ops.numel(flat), ops.dtype_name(flat), like=flat)
        return r

    def start(self, name: str, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm = ctx.ops, ctx.comm
        if ctx.prescale != 1.0:
            flat = ops.scale(flat, ctx.prescale)
        key = bucket_key(name)
        r = ops.add(self.residual_for(ops, key, flat), flat)      # r <- r + g
        r, s = ops.ternarize_(r, self.theta, self.wire_dtype)    # r <- r - theta*s
        self.residuals[key] = r
        dtype = ops.dtype_name(flat)
        if comm.size == 1:
            return Pending(name, (s, None, dtype, ctx.postscale))
        if comm.buffer_kind == "numpy":
            host = ops.to_numpy(s)
            return Pending(name, (s, host, dtype, ctx.postscale), (comm.allreduce_async_(host, "sum", name),))
        return Pending(name, (s, None, dtype, ctx.postscale), (comm.allreduce_async_(s, "sum", name),))

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        ops = ctx.ops
        s, host, dtype, post = pending.state
        for h in pending.handles:
            ctx.comm.wait(h)
        if host is not None:
            s = ops.from_numpy(host, like=s)
        out = ops.scale(ops.cast(s, dtype), self.theta)  # theta * sum_i s_i: one rounding
        if post != 1.0:
            out = ops.scale(out, post)
        return out

    def state_dict(self) -> dict:
        return {"residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict, ops: Any = None, like: Any = None) -> None:
        """Restore residuals, copied into new buffers placed like ``like`` (the model's device)."""
        self.residuals = {}
        for k, v in (state.get("residuals") or {}).items():
            if ops is not None:
                v = ops.copy_(ops.empty(ops.numel(v), ops.dtype_name(v), like=like if like is not None else v), v)
            self.residuals[k] = v


class FlushingCorrection(Reducer):
    """A full-precision correction that also sends (and zeroes) the ternary residual."""

    name = "correction+flush"

    def __init__(self, ternary: TernaryAllreduce, dense: DenseAllreduce):
        self.ternary, self.dense = ternary, dense

    def start(self, name: str, flat: Any, ctx: ReduceContext) -> Pending:
        ops = ctx.ops
        if ctx.prescale != 1.0:
            flat = ops.scale(flat, ctx.prescale)
        key = bucket_key(name)
        r = self.ternary.residual_for(ops, key, flat)
        flat = ops.add(flat, r)
        self.ternary.residuals[key] = ops.scale(r, 0.0)
        plain = ReduceContext(ctx.comm, ops, 1.0, ctx.postscale)
        return self.dense.start(name, flat, plain)

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        return self.dense.finish(pending, ctx)


class CDScheduler(DelayedScheduler):
    """OD-SGD's scheduler with CD-SGD's per-round choice of reducer."""

    def __init__(self, config: CDConfig, engine: Any):
        super().__init__(config, engine)
        self.ternary = TernaryAllreduce(config.theta, engine.comm.size)
        dense = engine.reducer  # checked to be an uncompressed DenseAllreduce by build_scheduler
        self.correction = FlushingCorrection(self.ternary, dense) if config.flush_residual_on_correction else dense

    def reducer_for(self, step: int) -> Reducer:
        return self.correction if step % self.config.correction_every == 0 else self.ternary

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["ternary"] = self.ternary.state_dict()
        return sd

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        like = next(iter(self.host.weights().values()), None)
        self.ternary.load_state_dict(state.get("ternary") or {}, ops=self.ops, like=like)
