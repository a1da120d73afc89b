"""``AutoReducer``: one reducer per bucket, chosen by the policy, over one shared memory.

The engine binds one reducer per optimizer (``CommEngine.reducer``) and calls it per bucket
(``start(bucket, ...)``, ``finish``, ``settle``), so mixing methods per bucket needs no engine
change: this reducer routes each bucket to the sub-reducer of its assigned method
(docs/auto-compression.md#per-bucket). Sub-reducers are made on first use, one per method.

Shared memory (docs/auto-compression.md#shared-memory): every sub-reducer holds the *same*
:class:`~hvd_commopt.autocompress.dense.AutoMemory` (error feedback; DGC's momentum
correction when the wrapped optimizer has momentum, as ``Compression.topk``'s default), keyed by
bucket name. A bucket that changes from one sparse method or density to another keeps its
residual (velocity) and momentum as they are: nothing to move. A bucket that changes from a
sparse method or a quantiser to a dense one first sends its residual: its next round is the
allreduce of its whole velocity (``_flush``, :class:`~hvd_commopt.autocompress.dense.DenseFlush`,
which leaves the velocity and the momentum zero, as a sparse round sending every element would),
and only the round after that is dense; a flush round skipped for a NaN/Inf is owed again. No
gradient mass is lost (tests/unit/test_autocompress_reducer.py proves it exactly).

Dense fp32 is S-SGD's allreduce with the momentum of momentum correction applied to the average
in one pass (:class:`~hvd_commopt.autocompress.dense.DenseMomentum`, docs/auto-compression.md#dense-path):
S-SGD with momentum bit for bit, at no more passes than the optimizer's momentum. bf16/fp16 are
that round with the payload cast (:class:`~hvd_commopt.autocompress.methods.CastWithMemory`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..buckets import Bucket
from ..host import ScheduleHost
from ..reduce.base import Pending, ReduceContext, Reducer, RoundInfo
from ..reduce.adaptive import is_adaptive
from ..reduce.momentum import bind_momentum_memory
from ..tensor_ops import TensorOps
from .choose import DENSE
from .dense import AutoMemory, DenseFlush, MomentumAverage
from .kinds import Kinds, ModelReading, model_kind, optimizer_kind
from .methods import build_method
from .options import AutoOptions, Method
from .policy import AutoPolicy

__all__ = ["AutoReducer", "BucketTiming"]

class BucketTiming:
    """When each bucket's ``start`` began and ended this step (rank-local, for the profile)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._rows: list[tuple[int, float, float]] = []

    def add(self, index: int, t0: float, t1: float) -> None:
        self._rows.append((index, t0, t1))

    def take(self) -> list[tuple[int, float, float]]:
        rows, self._rows = self._rows, []
        return sorted(rows)


@dataclass
class _Routed:
    sub: Reducer
    inner: Pending


class AutoReducer(Reducer):
    """``compression="auto"``: each bucket reduced by the method the policy assigned it
    (module docstring); :attr:`policy` decides (:mod:`hvd_commopt.autocompress.policy`)."""

    name = "auto"
    sparse = False  # the fusion planners price the buckets dense (docs/auto-compression.md#per-bucket)
    holds_rank_state = True

    def __init__(self, options: AutoOptions | None = None, clock: Callable[[], float] = time.perf_counter):
        self.requested = options if options is not None else AutoOptions()  # what the user gave
        self.options = self.requested  # resolved by the kinds' rule once read (read_model)
        self.kinds: Kinds | None = None
        self._optimizer_kind = optimizer_kind(None)
        self._split_built: bool | None = None  # whether the layout in use splits off the 1-D tensors
        self.memory = AutoMemory()
        self._subs: dict[Method, Reducer] = {}
        self._flush = DenseFlush(self.memory)
        self.assignment: dict[str, Method] = {}
        self._flush_next: set[str] = set()
        self._flushing: dict[str, int] = {}  # bucket -> the step of its last flush round (a rollback owes it again)
        self.timing = BucketTiming(clock)
        self.like: Any = None  # a float32 tensor on this engine's device (for timing selections on rank 0)
        self.adaptive = False  # an Adam-type optimizer is wrapped: dense candidates only (bind_host)
        self.policy = AutoPolicy(self, clock)

    def sub(self, method: Method) -> Reducer:
        r = self._subs.get(method)
        if r is None:
            r = self._subs[method] = build_method(method, self.memory)
            self._tell_verdict()
        return r

    def _tell_verdict(self) -> None:
        """The dense rounds need a NaN/Inf verdict without momentum only while another bucket holds a
        memory (a sparse method, a flush pending), so that the step is skipped in every bucket
        (docs/wrapper.md#nonfinite-step); with every bucket dense, S-SGD's round checks nothing."""
        need = bool(self._flush_next) or any(m.holds_residual for m in self.assignment.values())
        for r in self._subs.values():
            if isinstance(r, MomentumAverage):
                r.verdict = need

    def method_of(self, bucket_name: str) -> Method:
        return self.assignment.get(bucket_name, DENSE)

    def assign(self, methods: dict[str, Method]) -> None:
        """Switch to ``methods`` (between steps, no round in flight): a bucket going from sparse
        to dense sends its residual in its next round (module docstring)."""
        for name, new in methods.items():
            old = self.method_of(name)
            if old.holds_residual and not new.holds_residual:
                self._flush_next.add(name)
            elif new.holds_residual:
                self._flush_next.discard(name)
        self.assignment = dict(methods)
        self._tell_masked()
        self._tell_verdict()

    def _tell_masked(self) -> None:
        """The memory masks the momentum where sent in the buckets assigned ``dgc_masked``."""
        self.memory.masked = frozenset(k for k, m in self.assignment.items() if m.kind == "dgc_masked")

    # -- the Reducer interface, routed per bucket ----------------------------------------------
    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        t0 = self.timing.clock()
        if self.like is None and bucket.dtype == "float32":
            self.like = ctx.ops.zeros(1, "float32", like=flat)  # the device, not the buffer
        sub: Reducer
        if bucket.name in self._flush_next:
            self._flush_next.discard(bucket.name)
            self._flushing[bucket.name] = rnd.step
            sub = self._flush
        else:
            sub = self.sub(self.method_of(bucket.name))
        inner = sub.start(bucket, rnd, flat, ctx)
        self.timing.add(bucket.index, t0, self.timing.clock())
        return Pending(inner.name, _Routed(sub, inner), inner.handles)

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        st: _Routed = pending.state
        out = st.sub.finish(st.inner, ctx)
        pending.finite, pending.support = st.inner.finite, st.inner.support
        return out

    def device_flags(self, bucket: Bucket, rnd: RoundInfo, pending: Pending) -> tuple[Any, ...] | None:
        st: _Routed = pending.state
        return st.sub.device_flags(bucket, rnd, st.inner)

    def settle(self, bucket: Bucket, rnd: RoundInfo, out: Any, ctx: ReduceContext,
               pending: Pending | None = None, flags: tuple[bool, ...] | None = None) -> bool:
        if pending is None:
            finite = self.sub(self.method_of(bucket.name)).settle(bucket, rnd, out, ctx, None, flags)
        else:
            st: _Routed = pending.state
            finite = st.sub.settle(bucket, rnd, out, ctx, st.inner, flags)
        self._flush_settled(bucket, rnd, finite)
        return finite

    def rollback(self, bucket: Bucket, rnd: RoundInfo, ctx: ReduceContext) -> None:
        self.sub(self.method_of(bucket.name)).rollback(bucket, rnd, ctx)
        self._flush_settled(bucket, rnd, False)

    def _flush_settled(self, bucket: Bucket, rnd: RoundInfo, kept: bool) -> None:
        """A flush round that was skipped (a NaN/Inf step, in this bucket or another one settled
        after it: the memory is rolled back, the velocity still held) is owed again by the
        bucket's next round, so no dense round runs over a memory that was not sent."""
        if not kept and self._flushing.get(bucket.name) == rnd.step:
            del self._flushing[bucket.name]
            if not self.method_of(bucket.name).holds_residual:
                self._flush_next.add(bucket.name)

    @property
    def splits_1d(self) -> bool:
        """1-D tensors go to buckets of their own, sent whole, when a sparse method may be chosen
        (docs/topk.md#dense-1d): not under an Adam-type optimizer, where only the dense methods are
        candidates and the buckets are S-SGD's (docs/auto-compression.md#adaptive-buckets)."""
        return self.options.any_sparse and not self.adaptive

    def keeps_dense(self, spec: Any) -> bool:
        """A 1-D tensor when :attr:`splits_1d`; the layout built remembers which (:attr:`layout_stale`)."""
        self._split_built = self.splits_1d
        return self._split_built and len(spec.shape) <= 1

    @property
    def layout_stale(self) -> bool:
        """The buckets were built for other candidates than the optimizer and model kinds now allow
        (:attr:`splits_1d` changed): the engine rebuilds them before step 0."""
        return self._split_built is not None and self._split_built != self.splits_1d

    def read_model(self, shapes: Sequence[Sequence[int]], ranks: int) -> None:
        """The model kind from the registered gradients' ``shapes``, and with the optimizer kind
        of :meth:`bind_host` and the job's rank count ``ranks`` (the communicator's size) the
        default candidates (docs/auto-compression.md#kinds, #kinds-ranks); what the user set in
        ``allow=``/``min_density=`` stays. Every rank reads the same shapes and size."""
        self._resolve(model_kind(shapes), ranks)

    def _resolve(self, model: ModelReading, ranks: int) -> None:
        self.kinds = Kinds(self._optimizer_kind, model, ranks)
        self.options = self.requested.under(self.kinds.rule)
        self.policy.options = self.options

    @property
    def kinds_text(self) -> str:
        """The report's line on the kinds read and the candidates they give (docs/auto-compression.md#kinds)."""
        if self.kinds is None:
            return f"kinds not read (no model registered): candidates {', '.join(self.options.allow)}"
        return self.kinds.describe(self.options)

    def bind_host(self, host: ScheduleHost, names: list[str]) -> Any:
        """The shared memory takes the optimizer's momentum (docs/dgc.md#optimizer-momentum). An
        Adam-type optimizer (the host's typed answer, :func:`~hvd_commopt.reduce.adaptive.is_adaptive`:
        torch's and Keras's Adam and kin) keeps the candidates dense: no sparse
        method with error feedback has reached S-SGD's loss under AdamW here
        (docs/auto-compression.md#adaptive). The optimizer kind also picks, with the model kind,
        the default candidates (:meth:`read_model`, docs/auto-compression.md#kinds)."""
        self.adaptive = bool(names) and is_adaptive(host)
        self._optimizer_kind = optimizer_kind(host)
        if self.kinds is not None:  # a host bound again: the optimizer kind may differ
            self._resolve(self.kinds.model, self.kinds.ranks)
        return bind_momentum_memory(self.memory, host, names)

    def relayout(self, ops: TensorOps, old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
        """A re-plan: the memory follows its tensors (docs/lags-omgs.md#replan-residuals); every new
        bucket starts dense until the policy decides again. A residual moved into a new bucket is
        sent by that bucket's first round (the flush)."""
        self.memory.relayout(ops, old, new)
        moved = {t for b in old if self.method_of(b.name).holds_residual for t in b.names}
        self.assignment = {}
        self._flush_next = {b.name for b in new if moved.intersection(b.names)}
        self._flushing.clear()
        self._tell_masked()
        self._tell_verdict()
        self.policy.restart()

    def config(self) -> dict:
        return {"reducer": self.name, **self.options.config()}

    def state_dict(self) -> dict:
        return {"memory": self.memory.state_dict(), "assignment": {k: m.key for k, m in self.assignment.items()},
                "flush": sorted(self._flush_next)}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(dict(state.get("memory", {})))
        self.assignment = {k: Method.parse(v) for k, v in dict(state.get("assignment", {})).items()}
        self._flush_next = set(state.get("flush", ()))
        self._flushing.clear()
        self._tell_masked()
        self._tell_verdict()

    def __repr__(self) -> str:
        return f"Compression.auto({self.options.config()})"
