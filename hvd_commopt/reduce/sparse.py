"""What every sparse reducer shares: select-with-memory, the density-1 path, the index dtype.

:class:`SparseReducer` is the base of the sparse allreduces (Top-k allgather, gTop-k): a selector
(:class:`~hvd_commopt.compress.selector.Selector`) composed with a memory
(:class:`~hvd_commopt.memory.base.Memory`). Per bucket and round, :meth:`SparseReducer.select`
is the common prologue::

    acc          = prescale·flat + residual          memory.compensate
    (vals, idx)  = compressor.select(acc)            exact top-k / random-k / DGC threshold
    residual     = acc, zeroed at idx                memory.update (bit-exact partition)

and the subclass exchanges (vals, idx) its own way (``start`` and :meth:`SparseReducer.exchanged`);
:meth:`SparseReducer.finish` is shared: ``scatter_add(zeros(n), idx, vals)·postscale`` of what
came back, with :meth:`SparseReducer.restore_dropped` for the reducers whose exchange drops some
of this rank's selected entries (gTop-k, Ok-Topk).

Choices:

* The memory update happens in ``start``, not in ``finish``: the bucket buffer is free again
  as soon as ``start`` returns and nothing depends on when ``finish`` runs (delayed schedules
  may finish a step after the next one started).
* Indices travel as int32 while the bucket has fewer than 2^31 elements, else int64 (never as
  floats: docs/gtopk.md#horovod-mapping, docs/wrapper.md#index-dtype).
* A bucket whose k equals its size (density 1) is reduced by a dense allreduce of ``acc``
  (``dense_when_full``): the same result as a sparse exchange of everything, with the traffic
  and the summation order of dense S-SGD, so "density 1 equals dense" holds bit for bit
  (docs/wrapper.md#bit-exactness-scope). The residual becomes zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..buckets import Bucket
from ..compress import nonfinite
from ..select import device
from ..select.grad_parts import GradParts
from ..select.kernels import device_route, kernels_for
from ..select.strategies import folds_finite, fused_with, select_with_memory
from ..compress.selector import Selector
from ..errors import ConfigError
from ..host import ScheduleHost
from ..memory.base import Memory, MomentumMemory
from ..tensor_ops import TensorOps
from .base import Pending, ReduceContext, Reducer, RoundInfo
from .known_gaps import warn_known_gap
from .momentum import bind_momentum_memory

__all__ = ["SparseReducer", "PendingSelection", "WholeBucket", "index_dtype_for", "prescaled", "dense_start",
           "dense_finish", "scatter_result"]

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


def prescaled(flat: Any, ctx: ReduceContext) -> Any:
    """The bucket times the context's prescale factor (the prologue every sparse reducer shares)."""
    return ctx.ops.scale(flat, ctx.prescale) if ctx.prescale != 1.0 else flat


def scatter_result(ops: Any, buf: Any, n: int, idx: Any, vals: Any, postscale: float) -> tuple[Any, Any, Any]:
    """``(out, finite, sums)``: ``out = scatter_add(zeros(n), idx, vals) · postscale``, built in ``buf``
    (the round's bucket buffer, free once the selection is made) when its dtype fits: a fresh
    n-element tensor per step costs page faults worth several passes (docs/selection.md#step-cost);
    ``finite``: whether ``out`` holds no NaN/Inf.

    Only the exchanged positions can differ from +0, so the postscale and the finiteness check
    touch those (k·P elements, gathered once) instead of all n (docs/selection.md#step-cost): the
    same products, bit for bit, as scaling ``out`` whole. A negative or non-finite postscale
    (``0 · s`` is then -0 or NaN) scales and checks the whole buffer. ``sums``: ``out`` at ``idx``
    (one value per entry of idx), the result's support for a sparse optimizer update
    (docs/wrapper.md#sparse-update); None on the whole-buffer path. On the device route
    (docs/selection.md#device-route) ``finite`` is a device flag (``TensorOps.finite_flag``),
    read once by the reducer's ``settle``."""
    dt = ops.dtype_name(vals)
    in_buf = buf is not None and ops.dtype_name(buf) == dt
    positive = math.isfinite(postscale) and math.copysign(1.0, postscale) > 0
    kern = kernels_for(ops, buf, idx, vals) if in_buf else kernels_for(ops, vals)
    all_finite = ops.finite_flag if kern.sync_free else ops.all_finite
    if in_buf and positive and not kern.sync_free:
        built = kern.scatter_sum(buf, idx, vals, postscale)  # one pass, the same bits (docs/selection.md#scatter-sum)
        if built is not None:
            out, sums, finite = built
            return out, finite, sums
    out = ops.zero_(buf) if in_buf else ops.zeros(n, dt, like=vals)
    out = ops.scatter_add(out, idx, vals)
    if not positive:
        out = ops.scale(out, postscale)
        return out, all_finite(out), None
    sums = ops.gather(out, idx)
    if postscale != 1.0:
        sums = ops.scale(sums, postscale)
        out = ops.index_copy(out, idx, sums)  # a repeated index writes the same product again
    return out, all_finite(sums), sums


@dataclass
class WholeBucket:
    """A sparse reducer's bucket sent whole (density 1)."""

    x: Any
    key: str
    device: bool = False  # the device route: finiteness decided by a flag read in settle


@dataclass
class PendingSelection:
    """A bucket's sparse exchange in flight: this rank's selection (what the memory gets back of
    it when the exchange drops entries), the bucket's size and name, where to build the result."""

    idx: Any
    vals: Any
    n: int
    key: str
    out: Any = None  # the round's bucket buffer, free after start (None: a fresh tensor)
    local: bool = False  # one rank: nothing was sent, the result is the selection
    step: int = -1  # the round (for the momentum of dropped entries, docs/gtopk.md#masking-delivered)


def dense_start(memory: Memory, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext,
                finite: bool = True) -> Pending:
    """Density-1 path shared by the sparse reducers: allreduce(sum) of ``flat + residual``
    (of ``flat`` alone, the memory untouched, when ``flat`` is not finite)."""
    name = rnd.wire(bucket)
    x = memory.compensate_dense(ctx.ops, bucket.name, flat) if finite else flat
    st = WholeBucket(x, bucket.name, device_route(ctx.ops, x))
    if ctx.comm.size == 1:
        return Pending(name, st)
    return Pending(name, st, (ctx.comm.allreduce_tensor_async(ctx.ops, x, "sum", f"{name}.dense"),))


def dense_finish(memory: Memory, pending: Pending, ctx: ReduceContext) -> Any:
    st: WholeBucket = pending.state
    x = ctx.comm.wait(pending.handles[0]) if pending.handles else st.x
    if ctx.postscale != 1.0:
        x = ctx.ops.scale(x, ctx.postscale)
    if st.device:  # the verdict stays a device flag, read in settle (docs/selection.md#device-route)
        pending.finite = ctx.ops.finite_flag(x)
        return ctx.ops.where(pending.finite, memory.finish_dense(ctx.ops, st.key, x), x)
    if not ctx.ops.all_finite(x):
        return x  # skipped step: DGC's momentum must not see it (docs/wrapper.md#nonfinite)
    return memory.finish_dense(ctx.ops, st.key, x)


class SparseReducer(Reducer):
    """A selector plus a memory; subclasses exchange the selection (see the module docstring).

    Args:
        compressor: the selection.
        memory: what is remembered of the unsent part (error feedback, DGC's momentum).
        index_dtype: "int32", "int64" or None (int32 when it can hold every index).
        dense_when_full: reduce buckets with k == n by a dense allreduce.
    """

    sparse = True

    def __init__(self, compressor: Selector, memory: Memory, index_dtype: str | None = None,
                 dense_when_full: bool = True):
        index_dtype_for(0, index_dtype)  # validate early
        self.compressor = compressor
        self.memory = memory
        self.index_dtype = index_dtype
        self.dense_when_full = bool(dense_when_full)
        # (bucket, step) -> the device route's flag "this rank's contribution was finite", read
        # with the result's flag in settle (docs/selection.md#device-route)
        self._local_finite: dict[tuple[str, int], Any] = {}

    def keeps_dense(self, spec: Any) -> bool:
        """1-D tensors (biases, normalisation scales), unless the compressor's ``dense_1d`` is off:
        the engine gives them buckets of their own, which :meth:`select` sends whole
        (docs/topk.md#dense-1d)."""
        return self.compressor.dense_1d and len(spec.shape) <= 1

    def selection_reads_parts(self, bucket: Bucket, ops: Any) -> bool:
        """Whether :meth:`select` reads ``bucket``'s gradients in place, so that a subclass whose
        ``start`` takes them unpacked (a :class:`GradParts`) may say so with ``reads_parts``
        (docs/selection.md#grad-parts): the exact top-k of the bucket with a memory that passes them
        to its pass, on an adapter whose native top-k reads them. Any other path packs them first."""
        return (kernels_for(ops).reads_grad_parts and bucket.dtype in ("float32", "float64")
                and not bucket.dense and fused_with(self.compressor, self.memory)
                and self.memory.reads_parts and self.compressor.reads_parts)

    def select(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending | tuple[Any, Any, int]:
        """The prologue: the bucket sent whole (a started dense :class:`Pending`) when its k is
        its size, else ``(values, indices, n)`` of this rank's selection, the memory updated.
        ``flat`` may be the bucket's unpacked gradients (:class:`GradParts`, when
        :meth:`reads_parts` said so): the fused selection reads them, any other path packs them."""
        ops = ctx.ops
        parts = flat if isinstance(flat, GradParts) else None
        if parts is not None:
            flat = parts.buf  # size, dtype and device only, until packed
        n = ops.numel(flat)
        k = self.compressor.k_for(n, bucket, rnd.step)
        whole = self.dense_when_full and k >= n
        fold = not whole and folds_finite(self.compressor, self.memory)
        if parts is not None and not (fold and ctx.prescale == 1.0 and self.memory.reads_parts):
            flat, parts = parts.pack(), None
        flat = prescaled(flat, ctx)
        self.memory.snapshot(ops, bucket.name, flat, rnd.step)
        self.compressor.snapshot(bucket.name, rnd.step)  # threshold reuse's state, beside the memory's
        if device_route(ops, flat):
            if whole:
                return self._dense_on_device(bucket, rnd, flat, ctx)
            vals, idx = self._select_on_device(bucket, rnd, flat, ctx)
            return vals, idx, n
        if fold:
            # the selection's pass tells whether flat is finite (docs/selection.md#finite-sweep);
            # a non-finite step is selected, then the memory rolled back: it never keeps it
            verdict: list = []
            vals, idx = select_with_memory(self.compressor, self.memory, ops, bucket, rnd.step,
                                           flat if parts is None else parts, verdict)
            if verdict and verdict[0]:
                return vals, idx, n
            if parts is not None:
                flat = parts.pack()  # the gradients are intact: the pass wrote u' and v' elsewhere
            if ops.all_finite(flat):  # unknown, or finite values overflowed
                return vals, idx, n
            self.rollback(bucket, rnd, ctx)
            finite = False
        else:
            finite = ops.all_finite(flat)
        if not finite:  # docs/wrapper.md#nonfinite: the memory never sees it
            nonfinite.report(self.memory.nonfinite, ctx.comm.rank, bucket.name)
            self.memory.skip(bucket.name)
        if whole:
            return dense_start(self.memory, bucket, rnd, flat, ctx, finite)
        if not finite:
            if self.compressor.collective == "allreduce":  # shared indices (random-k): keep them
                _, idx = self.compressor.select(ops, flat, bucket, rnd.step)
                vals = nonfinite.marker(ops, ops.numel(idx), flat)[0]
            else:
                vals, idx = nonfinite.marker(ops, k, flat)
            return vals, idx, n
        vals, idx = select_with_memory(self.compressor, self.memory, ops, bucket, rnd.step, flat)
        return vals, idx, n

    def _select_on_device(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> tuple[Any, Any]:
        """:meth:`select` with no host decision (docs/selection.md#device-route): the selection is
        made whatever the data, this rank's finiteness stays a device flag, and the marker replaces
        the selection by a ``where`` where it is not finite; the memory wrote into its second
        buffers, so :meth:`settle`'s one read of the flags rolls it back with the host route's
        result (the reduced bucket is then non-finite on every rank)."""
        ops = ctx.ops
        # the k-sized verdict needs a top-k by magnitude (every NaN/Inf selected) and an intact flat
        sel = self.compressor.selection
        by_magnitude = fused_with(self.compressor, self.memory) and sel is not None and sel.mode != "sampled"
        ok = None if by_magnitude else ops.finite_flag(flat)
        vals, idx = select_with_memory(self.compressor, self.memory, ops, bucket, rnd.step, flat)
        if ok is None:
            ok = device.local_verdict(ops, flat, vals, idx, False)
        if len(self._local_finite) > 4096:  # rounds abandoned before settle
            self._local_finite.clear()
        self._local_finite[(bucket.name, rnd.step)] = ok
        if self.compressor.collective == "allreduce":  # shared indices (random-k): keep them
            return ops.where(ok, vals, math.inf), idx
        return device.marked(ops, ok, vals, idx, self.compressor.k_for(ops.numel(flat), bucket, rnd.step))

    def _dense_on_device(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        """The bucket sent whole (density 1, ``dense_1d``) with no host decision
        (docs/selection.md#device-route): ``flat + residual`` where this rank's ``flat`` is finite,
        else ``flat`` as it is (a ``where`` on the device flag); the memory's residual is taken
        whatever the data, and :meth:`settle`'s read of the flags rolls it back with the host
        route's result. ``flat`` is compensated in a copy (the adapter adds in place)."""
        ops = ctx.ops
        ok = ops.finite_flag(flat)
        self._local_finite[(bucket.name, rnd.step)] = ok
        x = ops.where(ok, self.memory.compensate_dense(ops, bucket.name, ops.clone(flat)), flat)
        return dense_start(self.memory, bucket, rnd, x, ctx, finite=False)

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        """The reduced bucket: the dense path's, else ``scatter_add(zeros(n), idx, vals)·postscale``
        of the exchanged selection (this rank's own with one rank)."""
        st = pending.state
        if isinstance(st, WholeBucket):
            return dense_finish(self.memory, pending, ctx)
        idx, vals = (st.idx, st.vals) if st.local else self.exchanged(pending, ctx)
        out, pending.finite, sums = scatter_result(ctx.ops, st.out, st.n, idx, vals, ctx.postscale)
        if sums is not None:
            pending.support = (idx, sums)
        return out

    def exchanged(self, pending: Pending, ctx: ReduceContext) -> tuple[Any, Any]:
        """(indices, values) of the reduced selection once ``pending``'s exchange is over (the
        subclass's half of :meth:`finish`)."""
        raise NotImplementedError

    def restore_dropped(self, ops: Any, st: PendingSelection, dropped: Any) -> None:
        """Give the memory back this rank's selected entries at positions ``dropped`` (of its
        selection) that the exchange did not deliver (docs/gtopk.md#t-gt-5)."""
        self.memory.restore(ops, st.key, ops.gather(st.idx, dropped), ops.gather(st.vals, dropped))
        if isinstance(self.memory, MomentumMemory):  # and their momentum (docs/gtopk.md#masking-delivered)
            self.memory.restore_momentum(ops, st.key, st.step, dropped)

    def restore_not_alive(self, ops: Any, st: PendingSelection, alive: Any) -> None:
        """:meth:`restore_dropped` on the device route, where the exchange hands back a bool mask
        ``alive`` over this rank's k entries: all k are restored, +0.0 where the entry was delivered
        (the memory zeroed it: +0 + +0 is +0, and 0 + v the dropped value, as the host route;
        docs/gtopk.md#merge-fixed), and the momentum of the rest (docs/gtopk.md#masking-delivered)."""
        kept = ops.where(alive, ops.zeros(ops.numel(st.vals), ops.dtype_name(st.vals), like=st.vals), st.vals)
        self.memory.restore(ops, st.key, st.idx, kept)
        if isinstance(self.memory, MomentumMemory):
            self.memory.restore_momentum(ops, st.key, st.step, ops.compare(ops.cast(alive, "uint8"), "lt", 1))

    def config(self) -> dict:
        return {"reducer": self.name, "compressor": self.compressor.config(), "memory": self.memory.config(),
                "index_dtype": self.index_dtype, "dense_when_full": self.dense_when_full}

    def device_flags(self, bucket: Bucket, rnd: RoundInfo, pending: Pending) -> tuple[Any, ...] | None:
        """The device route's flags of a finished round: the result's finiteness and this rank's
        (the result's again when there is none), read by the engine with the step's others."""
        flag = pending.finite
        if flag is None or isinstance(flag, bool):
            return None
        local = self._local_finite.get((bucket.name, rnd.step))
        return flag, flag if local is None else local

    def settle(self, bucket: Bucket, rnd: RoundInfo, out: Any, ctx: ReduceContext,
               pending: Pending | None = None, flags: tuple[bool, ...] | None = None) -> bool:
        """A non-finite reduced bucket (identical on every rank) rolls the memory back, so the
        skipped step leaves no trace in it (docs/wrapper.md#nonfinite). The sparse result's
        finiteness was decided in :meth:`finish` from the exchanged positions (:func:`scatter_result`);
        on the device route it is a device flag, read here (one host read) unless the engine read
        it with the step's others and passes ``flags`` (docs/selection.md#one-read-per-step)."""
        dev = self.device_flags(bucket, rnd, pending) if pending is not None else None
        self._local_finite.pop((bucket.name, rnd.step), None)
        if dev is not None:
            finite, local_ok = flags if flags is not None else ctx.ops.read_flags(list(dev))
            if not local_ok:
                nonfinite.report(self.memory.nonfinite, ctx.comm.rank, bucket.name)
                self.memory.skip(bucket.name)
        else:
            flag = pending.finite if pending is not None else None
            finite = flag if flag is not None else ctx.ops.all_finite(out)
        if not finite:
            self.rollback(bucket, rnd, ctx)
        return bool(finite)

    def rollback(self, bucket: Bucket, rnd: RoundInfo, ctx: ReduceContext) -> None:
        """Round ``rnd`` of ``bucket`` is skipped: the memory and the selection's state go back to
        their snapshots (docs/wrapper.md#nonfinite, docs/wrapper.md#nonfinite-step)."""
        self.memory.rollback(ctx.ops, bucket.name, rnd.step)
        self.compressor.rollback(bucket.name, rnd.step)

    @property
    def density(self) -> float | None:
        return self.compressor.density.constant

    def stats(self) -> dict:
        """The selection's statistics (threshold reuse: per-bucket k drift; docs/selection.md#reuse)."""
        return self.compressor.selection_stats()

    @property
    def method(self) -> str:
        """The sparse method as users name it (``Compression.<method>``)."""
        return self.name

    def bind_host(self, host: ScheduleHost, names: list[str]) -> Any:
        """Momentum correction takes the wrapped optimizer's momentum (docs/dgc.md#optimizer-momentum):
        :func:`~hvd_commopt.reduce.momentum.bind_momentum_memory` on this reducer's memory; a
        measured gap of this method under this optimizer is warned about (docs/convergence-matrix.md#warnings)."""
        warn_known_gap(self.method, self.compressor.density.constant, host, names)
        return bind_momentum_memory(self.memory, host, names, self.compressor)

    def relayout(self, ops: TensorOps, old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
        """The memory's per-bucket state follows its tensors (docs/lags-omgs.md#replan-residuals)."""
        self.memory.relayout(ops, old, new)

    def residual(self, ops: Any, key: str, like: Any) -> Any | None:
        """The memory's residual (velocity for DGC) of the bucket named ``key``; None = zero."""
        return self.memory.residual(ops, key, like)

    holds_rank_state = True  # the memory (and a threshold-reusing selection) differ per rank

    def state_dict(self) -> dict:
        return {"memory": self.memory.state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(dict(state.get("memory", {})))
        self.compressor.load_state_dict(dict(state.get("compressor", {})))
