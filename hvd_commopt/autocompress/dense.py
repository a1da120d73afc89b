"""Dense fp32 under ``compression="auto"``: S-SGD's allreduce with the momentum applied once, at
the optimizer's cost (docs/auto-compression.md#dense-path).

Under ``auto`` the wrapped optimizer runs without its momentum and the shared memory
(:class:`AutoMemory`, DGC's momentum correction) applies it, so that a bucket can switch between
dense and sparse methods and keep its momentum exactly (docs/auto-compression.md#shared-memory).
A bucket kept dense has no residual (a switch from a sparse method sends it first), so its round
is S-SGD's: the bucket is allreduced as it is (:class:`DenseMomentum`, ``DenseAllreduce``'s wire:
no finiteness pass before sending, since nothing of it enters a memory there), and the reduced
average ``g`` takes the momentum ``u' = mu*u + g`` in one pass that also tells whether ``g`` is
finite (:meth:`AutoMemory.finish_average`; the native ``momentum_average`` on host memory). The
optimizer then adds ``-lr*u'``: the same operations, in the same order, as ``torch.optim.SGD``'s
``buf.mul_(mu).add_(g)`` and ``p.add_(buf, alpha=-lr)``, so the values are S-SGD with momentum bit
for bit; the passes are fewer (one fused pass, which also writes ``u'`` back into the round's
buffer, against the postscale, the ``mul_`` and the ``add_``).

A NaN/Inf reaches the reduced average on every rank alike; the momentum then keeps its value (the
new one was written into the memory's second buffer), the bucket hands back a non-finite gradient
(on host memory ``mu*u + g``, what S-SGD's optimizer would step with) and the step is skipped as before
(docs/wrapper.md#nonfinite). What is not done on this path: the warning naming the rank whose
gradient was not finite (S-SGD gives none either; the sparse methods still do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import host_memory
from ..buckets import Bucket
from ..compress import nonfinite
from ..memory.momentum import MomentumCorrection
from ..memory.sent import zero_sent
from ..reduce.base import Pending, ReduceContext, Reducer, RoundInfo
from ..reduce.dense import DenseRound
from ..reduce.sparse import prescaled
from ..select.kernels import device_route
from ..tensor_ops import TensorOps

__all__ = ["AutoMemory", "DenseFlush", "DenseMomentum", "MomentumAverage", "average_flags", "settle_average"]


class AutoMemory(MomentumCorrection):
    """The memory every method of ``compression="auto"`` shares: momentum correction
    (:class:`~hvd_commopt.memory.momentum.MomentumCorrection`) without momentum factor masking,
    which cost 3.4-3.7 points on the digits MLP at density 0.1 (docs/auto-compression.md#auto-memory),
    plus :meth:`finish_average`, the momentum of a bucket reduced dense in one pass."""

    def __init__(self) -> None:
        super().__init__(momentum_masking=False, auto=True)
        #: the buckets whose method masks the momentum where sent (``dgc_masked``, set by
        #: ``AutoReducer.assign``; docs/auto-compression.md#dgc-masked)
        self.masked: frozenset[str] = frozenset()

    def update(self, ops: TensorOps, name: str, acc: Any, sent_idx: Any) -> None:
        """The velocity zeroed where sent; the momentum too where the whole bucket was sent (the
        flush before a dense round), so every rank's dense rounds continue from the same momentum,
        and where sent in a bucket of :attr:`masked` (DGC's momentum factor masking)."""
        super().update(ops, name, acc, sent_idx)
        if name in self.masked or ops.numel(sent_idx) >= ops.numel(acc):
            self._u.set(name, zero_sent(ops, self._u.get(ops, name, acc), sent_idx))

    def update_quantized(self, ops: TensorOps, name: str, acc: Any, sent: Any) -> None:
        """The velocity := ``acc - sent``: a quantiser sent every element of ``acc`` (:meth:`compensate`'s
        ``v``, outside the snapshot) as ``sent``; the momentum is kept, as a sparse round keeps it
        (docs/auto-compression.md#quantised). ``sent + v == acc`` bit for bit (docs/quantize.md#invariants)."""
        self._v.set(name, ops.sub(acc, sent))

    def flush(self, ops: TensorOps, name: str, flat: Any) -> Any:
        """The whole velocity to send before a bucket's first dense round: ``acc = v + (mu*u + g)``
        (:meth:`compensate`, into the second buffers the snapshot leaves free), after which ``v``
        and ``u`` are zero, as a sparse round that sends every element leaves them (:meth:`update`).
        ``acc`` is a buffer the memory no longer holds: the allreduce may reduce it in place."""
        acc = self.compensate(ops, name, flat)
        n, dt = ops.numel(acc), ops.dtype_name(acc)
        self._v.set(name, ops.zeros(n, dt, like=acc))
        self._u.set(name, ops.zeros(n, dt, like=acc))
        return acc

    def finish_average(self, ops: TensorOps, name: str, x: Any, post: float, verdict: bool = True) -> tuple[Any, Any]:
        """``(out, finite)`` of a bucket whose reduced sum is ``x`` (``x`` is written): ``out`` is
        ``u' = mu*u + x*post``, the momentum applied as :meth:`finish_dense` applies it, and what
        S-SGD's optimizer steps with; the memory keeps ``u'`` where every ``x*post`` is finite, else
        its ``u`` as it was (``out`` is then not finite either, ``u'`` on host memory and ``x*post``
        elsewhere: the step is skipped on every rank).
        ``finite`` is a bool, a device flag on the device route (the momentum then chosen by
        ``where``, as ``dense_finish`` does), or None where nothing was checked: with no momentum the
        memory is not written, and ``verdict`` False says that no other bucket needs to know."""
        self._check_bound()
        mu = self.momentum
        if mu == 0.0 and self.clip_norm is None:  # error feedback only: nothing to remember
            x = ops.scale(x, post) if post != 1.0 else x
            return x, (ops.all_finite(x) if verdict else None)
        if device_route(ops, x):  # the verdict stays a device flag (docs/selection.md#device-route)
            x = ops.scale(x, post) if post != 1.0 else x
            flag = ops.finite_flag(x)
            return ops.where(flag, self.finish_dense(ops, name, x), x), flag
        if not (self.nesterov or self.clip_norm is not None):
            u_old = self._buffer(self._u, ops, name, x)
            buf = self._snaps[0].free(ops, name, u_old)
            if buf is None:
                buf = ops.empty(ops.numel(u_old), ops.dtype_name(u_old), like=u_old)
            xv, uv, bv = ops.host_view(x), ops.host_view(u_old), ops.host_view(buf)
            ok = None if xv is None or uv is None or bv is None else host_memory.momentum_average(xv, post, uv, mu, bv)
            if ok is not None:
                if ok:
                    self._u.set(name, buf)
                return x, ok
        x = ops.scale(x, post) if post != 1.0 else x  # the framework's ops: a pass each
        if not ops.all_finite(x):
            return x, False
        return self.finish_dense(ops, name, x), True


@dataclass
class _DenseRound(DenseRound):
    key: str  # the bucket whose momentum finish applies


class MomentumAverage(Reducer):
    """A sub-reducer of ``compression="auto"`` whose rounds end in :meth:`AutoMemory.finish_average`
    (dense fp32, the casts): the device flag, the settle and the rollback they share."""

    memory: AutoMemory
    # another bucket holds a memory (a sparse method, a flush pending): a NaN/Inf here must be
    # known even with no momentum, so that the step is skipped in every bucket (set by AutoReducer)
    verdict: bool = True

    def device_flags(self, bucket: Bucket, rnd: RoundInfo, pending: Pending) -> tuple[Any, ...] | None:
        return average_flags(pending)

    def settle(self, bucket: Bucket, rnd: RoundInfo, out: Any, ctx: ReduceContext,
               pending: Pending | None = None, flags: tuple[bool, ...] | None = None) -> bool:
        return settle_average(self.memory, bucket, rnd, out, ctx, pending, flags)

    def rollback(self, bucket: Bucket, rnd: RoundInfo, ctx: ReduceContext) -> None:
        self.memory.rollback(ctx.ops, bucket.name, rnd.step)


class DenseMomentum(MomentumAverage):
    """``compression="auto"``'s dense fp32 (module docstring): allreduce(sum) of the bucket, then
    :meth:`AutoMemory.finish_average`."""

    name = "auto-dense"

    def __init__(self, memory: AutoMemory):
        self.memory = memory
        self.verdict = True

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops = ctx.ops
        flat = prescaled(flat, ctx)
        self.memory.snapshot(ops, bucket.name, flat, rnd.step)  # no copy: for a rollback of the momentum
        return _allreduce_sum(bucket, rnd, flat, ctx)

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        st: _DenseRound = pending.state
        x = ctx.comm.wait(pending.handles[0]) if pending.handles else st.payload
        out, pending.finite = self.memory.finish_average(ctx.ops, st.key, x, st.post, self.verdict)
        return out


class DenseFlush(MomentumAverage):
    """The round that empties a bucket's memory before its first dense round (a switch from a
    sparse method or a quantiser to dense fp32 or a cast; docs/auto-compression.md#flush): the
    allreduce(sum) of every rank's whole velocity ``v + (mu*u + g)`` (:meth:`AutoMemory.flush`),
    after which the velocity and the momentum are zero on every rank, so the dense rounds that
    follow apply the same update everywhere (docs/auto-compression.md#auto-memory).

    It was a Top-k round at density 1 through the sparse allgather: the same values, but a full
    selection and twice the bytes (values and indices), 1.0 s more than a bf16 step on the GPT's
    24.6 MB bucket at 1 Gbit/s (docs/auto-compression.md#flush). A rank whose gradient holds
    NaN/Inf sends it as it is, the memory left alone (every rank's result is then non-finite and
    the step skipped, the flush owed again: ``AutoReducer.settle``); on the device route the
    memory is flushed whatever the data and rolled back by the settle's flag
    (docs/selection.md#device-route)."""

    name = "auto-flush"

    def __init__(self, memory: AutoMemory):
        self.memory = memory
        self.verdict = True

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm, mem = ctx.ops, ctx.comm, self.memory
        flat = prescaled(flat, ctx)
        mem.snapshot(ops, bucket.name, flat, rnd.step)
        if device_route(ops, flat):
            x = ops.where(ops.finite_flag(flat), mem.flush(ops, bucket.name, flat), flat)
        elif ops.all_finite(flat):
            x = mem.flush(ops, bucket.name, flat)
        else:
            nonfinite.report(mem.nonfinite, comm.rank, bucket.name)
            mem.skip(bucket.name)
            x = flat
        return _allreduce_sum(bucket, rnd, x, ctx)

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        st: _DenseRound = pending.state
        ops = ctx.ops
        x = ctx.comm.wait(pending.handles[0]) if pending.handles else st.payload
        if st.post != 1.0:
            x = ops.scale(x, st.post)
        pending.finite = ops.finite_flag(x) if device_route(ops, x) else ops.all_finite(x)
        return x


def _allreduce_sum(bucket: Bucket, rnd: RoundInfo, x: Any, ctx: ReduceContext) -> Pending:
    """The round of ``x`` in flight: its allreduce(sum) (nothing to send on one rank), the
    postscale and the bucket kept for the finish."""
    name = rnd.wire(bucket)
    st = _DenseRound(x, None, ctx.postscale, bucket.name)
    if ctx.comm.size == 1:
        return Pending(name, st)
    return Pending(name, st, (ctx.comm.allreduce_tensor_async(ctx.ops, x, "sum", name),))


def average_flags(pending: Pending) -> tuple[Any, ...] | None:
    """The device route's flag of a round finished by :meth:`AutoMemory.finish_average`."""
    flag = pending.finite
    return None if flag is None or isinstance(flag, bool) else (flag,)


def settle_average(memory: AutoMemory, bucket: Bucket, rnd: RoundInfo, out: Any, ctx: ReduceContext,
                   pending: Pending | None, flags: tuple[bool, ...] | None) -> bool:
    """A non-finite reduced bucket (the same on every rank) keeps the momentum as it was
    (docs/wrapper.md#nonfinite): the finish decided it, or the device flag read with the step's
    others (``flags``, else read here)."""
    if pending is None:
        finite = ctx.ops.all_finite(out)
    elif flags is not None:
        finite = bool(flags[0])
    else:
        dev = average_flags(pending)
        finite = bool(ctx.ops.read_flags(list(dev))[0]) if dev is not None else pending.finite is not False
    if not finite:
        memory.rollback(ctx.ops, bucket.name, rnd.step)
    return finite
