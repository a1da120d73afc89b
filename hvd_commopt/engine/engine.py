"""CommEngine: the buckets and the rounds of gradients on their way through the collectives.

Wait-free backpropagation with tensor fusion: gradients are copied into their bucket's fusion
buffer as they become ready (or, where the reducer's selection reads them in place, kept as they
are until the bucket launches: docs/selection.md#grad-parts); a bucket is handed to its reducer the
moment it is complete, so its collective runs on the progress thread while backward continues.
Buckets are launched strictly in plan order (a bucket that completes early waits for its
predecessors), which keeps the sequence of collectives identical on every rank without Horovod's
per-cycle negotiation; the plan follows backward order, so in practice nothing waits.

Per step, adapters call :meth:`grad_ready` from their gradient hooks, then ``run_step``
(``optimizer.step()``), whatever the schedule, on the :class:`~hvd_commopt.engine.trainer.Trainer`
that :func:`hvd_commopt.build_engine` returns: it holds this engine and the scheduler
(:mod:`hvd_commopt.schedule`) and hands every step to the scheduler. The scheduler owns the one
step counter, decides which reducer each round uses and when a round is applied, and drives the
rounds through the narrow port this engine offers it (:meth:`close_round`, :meth:`finish_round`,
:meth:`release_round`, :meth:`abandon_round`, :attr:`buckets`, :attr:`names`). This module
imports nothing from the schedule package: the scheduler is seen through
:class:`~hvd_commopt.engine.ports.RoundSource` (the round plan, the step counter, draining).

Streams: on a device with streams (CUDA), a bucket's start and finish run on its side stream
(:mod:`hvd_commopt.engine.streamed`), ordered by events; host tensors make no stream call
(docs/backends.md#cuda-streams).

Rounds: a step's gradients form a :class:`~hvd_commopt.engine.rounds.Round` with its own fusion
buffers (from a pool), so delayed schedules can keep several rounds in flight.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from .. import env
from .. import timeline as _timeline
from ..autocompress.resolve import resolve_auto
from ..buckets import Bucket, TensorSpec, build_buckets
from ..comm.communicator import Communicator
from ..compress.base import Compressor
from ..select.grad_parts import GradParts
from ..streams import BucketStream, DeviceStreams
from ..errors import ConfigError, HvdCommoptError
from ..fusion.threshold import validate_plan
from ..reduce import make_reducer
from ..reduce.base import Average, Pending, ReduceContext, Reducer, RoundInfo, check_op
from ..tensor_ops import TensorOps
from .args import check_backward_passes, check_predivide
from .buffer_pool import BufferPool
from .ports import RoundSource, own_reducer
from .rounds import ReducedGrads, Round
from .settings import DERIVED, engine_settings
from .specs import verify_same_settings, verify_same_tensors
from .stats import StepStats
from .streamed import drop_on_stream, finish_bucket, settle_deferred, start_on_stream
from .tuner import FusionTuner

__all__ = ["CommEngine"]


class CommEngine:
    """Buckets, fusion buffers, rounds and reduction; the step runs in the attached scheduler.

    Build it with :func:`hvd_commopt.build_engine`, which also builds the scheduler for
    ``schedule=``, attaches it and returns the :class:`~hvd_commopt.engine.trainer.Trainer`
    holding both.

    Args:
        comm: the communicator.
        ops: the adapter's tensor ops.
        compression: a compressor (Compression.none/fp16/bf16) or a reducer.
        fusion_threshold: bytes per fusion buffer (Horovod's meaning; 0 = one tensor per
            message; None = HVD_COMMOPT_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD / 25 MiB).
        op: "average" (default), "sum", or "adasum" (the Adasum reducer, docs/adasum.md#adasum).
        gradient_predivide_factor: with op="average", divide by this before the sum and by
            size/factor after it (Horovod's meaning).
        backward_passes_per_step: gradients of this many backward passes are accumulated
            locally (summed, as Horovod does) before one reduction.
        fusion: bucketing strategy: "threshold" (default, ``fusion_threshold``), "none" (one
            tensor per bucket), or planned from a profile of the first steps: "mgwfbp",
            "optimal", "auto" (see :mod:`hvd_commopt.engine.tuner`; synchronous schedule only).
        fusion_options: :class:`~hvd_commopt.engine.fusion_options.FusionOptions` or a dict of its fields.
        streams: the adapter's :class:`~hvd_commopt.streams.DeviceStreams` for tensors on a
            device with streams (CUDA); None (host tensors): no stream calls
            (docs/backends.md#cuda-streams).
    """

    def __init__(self, comm: Communicator, ops: TensorOps, *, compression: Compressor | Reducer | None = None,
                 fusion_threshold: int | None = None, op: str = Average,
                 gradient_predivide_factor: float = 1.0, backward_passes_per_step: int = 1,
                 fusion: str = "threshold", fusion_options: Any = None, streams: DeviceStreams | None = None):
        check_op(op)
        self.backward_passes_per_step = check_backward_passes(backward_passes_per_step)
        f = check_predivide(gradient_predivide_factor, op)
        self.comm, self.ops = comm, ops
        # compression="auto": one method per bucket, chosen at run time (docs/auto-compression.md#policy)
        self.reducer = own_reducer(make_reducer(resolve_auto(compression, op), op), self)
        self.fusion_threshold, self.fusion_threshold_source = env.fusion_threshold_setting(fusion_threshold)
        self.op, self.gradient_predivide_factor = op, f
        self.ctx = (ReduceContext(comm, ops, prescale=1.0 / f, postscale=f / comm.size) if op == Average
                    else ReduceContext(comm, ops))
        self.last_stats = StepStats()
        self.plan: list[list[int]] = []
        self._specs: dict[str, TensorSpec] = {}
        self._backward: list[TensorSpec] = []
        self._buckets: list[Bucket] = []
        self._slot: dict[str, tuple[Bucket, int]] = {}  # name -> (its bucket, its offset in the buffer)
        self.streams = streams
        # per bucket, its side stream and events (made once per plan); None: host tensors
        self._bucket_streams: list[BucketStream | None] | None = None
        # serialises the hooks (grad_ready) and the steps: the Trainer holds it around a step
        self.lock = threading.RLock()
        self._round: Round | None = None       # the round the hooks are filling
        self._pool = BufferPool(ops)            # per bucket: fusion buffers of released rounds, for reuse
        self._countdown: dict[str, int] = {}
        self.scheduler: RoundSource | None = None
        self.tuner = FusionTuner(fusion, comm, threshold_bytes=self.fusion_threshold, reducer=self.reducer,
                                 ops=ops, options=fusion_options)

    def attach_scheduler(self, scheduler: RoundSource) -> None:
        """Set the scheduler the rounds are opened for (done by :func:`hvd_commopt.build_engine`)."""
        self.scheduler = scheduler

    def _sched(self) -> RoundSource:
        if self.scheduler is None:
            raise HvdCommoptError("this CommEngine has no scheduler: build it with hvd_commopt.build_engine(...)")
        return self.scheduler

    # -- registration -------------------------------------------------------------------------
    def register(self, specs: Sequence[TensorSpec], backward_order: Sequence[str] | None = None,
                 plan: Sequence[Sequence[int]] | None = None) -> None:
        """Declare the tensors (in registration order) and build the buckets.

        Args:
            specs: every tensor to reduce.
            backward_order: names in the order their gradients become ready; default: the
                reverse of ``specs`` (the last layer's gradient is ready first).
            plan: groups of positions in backward order; default: the ``fusion`` strategy's
                (threshold fusion while a planned strategy profiles).

        Raises:
            RankMismatchError: the tensors, or the settings that must be equal (bucket plan,
                reducer, schedule, ...), differ across ranks (checked collectively, every rank
                raises; docs/cross-rank-check.md#settings).
        """
        specs = list(specs)
        verify_same_tensors(self.comm, specs)
        by_name = {s.name: s for s in specs}
        order = list(backward_order) if backward_order is not None else [s.name for s in reversed(specs)]
        if sorted(order) != sorted(by_name):
            raise ConfigError("backward_order must list every registered tensor exactly once")
        self._specs = by_name
        self._backward = [by_name[n] for n in order]
        plan = self.tuner.initial_plan(order, [s.nbytes for s in self._backward], plan)
        validate_plan(plan, len(self._backward))
        verify_same_settings(self.comm, engine_settings(self, plan, self._build_buckets(plan)),
                             derived=DERIVED)
        self.set_plan(plan)

    def set_plan(self, plan: Sequence[Sequence[int]]) -> None:
        """Replace the bucketing (between steps only). The caller makes it identical on all ranks."""
        with self.lock:
            if self.in_flight:
                raise HvdCommoptError("cannot change the fusion plan while gradients are in flight; "
                                      "call it between optimizer steps")
            validate_plan(plan, len(self._backward))
            if self.scheduler is not None and self.scheduler.outstanding:
                self.scheduler.drain()  # earlier rounds use the old layout; draining is value-neutral
            old = self._buckets
            self.plan = [list(g) for g in plan]
            self._buckets = self._build_buckets(self.plan)
            if old and [b.name for b in old] != [b.name for b in self._buckets]:
                # residuals/velocities are keyed by bucket: the reducer moves them (docs/lags-omgs.md#replan-residuals)
                self.reducer.relayout(self.ops, old, self._buckets)
            self._slot = {n: (b, off) for b in self._buckets for n, off in zip(b.names, b.offsets)}
            if self.streams is not None:
                self._bucket_streams = [self.streams.for_bucket(b) for b in self._buckets]
            self._pool.reset(len(self._buckets))
            self._reset_step()

    def _build_buckets(self, plan: Sequence[Sequence[int]]) -> list[Bucket]:
        # a sparse reducer sends 1-D tensors whole, in buckets of their own (docs/topk.md#dense-1d)
        return build_buckets(self._backward, plan, self.reducer.keeps_dense)

    @property
    def backward_names(self) -> list[str]:
        """Registered names in backward order (the order gradients are expected in)."""
        return [s.name for s in self._backward]

    @property
    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._specs)

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    # -- gradients from the hooks ---------------------------------------------------------------
    def _reset_step(self) -> None:
        self._countdown = {n: self.backward_passes_per_step for n in self._specs}
        self._round = None

    @property
    def in_flight(self) -> bool:
        """True between the first gradient of a step and the end of its step (its round closed).

        Rounds of earlier steps that a delayed schedule keeps in flight do not count: their
        gradients were copied out of the framework's buffers when packed.
        """
        return self._round is not None and self._round.has_arrivals

    def _current_round(self) -> Round | None:
        """The round being filled, opened on demand with the scheduler's plan (None: the schedule
        does not communicate gradients this step)."""
        if self._round is None:
            sched = self._sched()
            plan = sched.round_plan()
            if plan is None:
                return None
            self._round = Round(RoundInfo(sched.step, plan.tag), plan.reducer, [None] * len(self._buckets),
                                [set() for _ in self._buckets])
        return self._round

    def grad_ready(self, name: str, tensor: Any) -> None:
        """A gradient is ready (called from backward hooks). Packs it; launches full buckets.

        Runs once per tensor per backward pass, so it does only what each call needs: the
        tensor's (bucket, offset) is looked up once, the pass countdown is skipped without local
        accumulation, and the launch loop runs only when a bucket has just completed.
        """
        if _timeline.active() is not None:  # the f-string costs even when nothing records
            _timeline.instant(f"grad {name}", "backward")
        if self.tuner.recording:
            self.tuner.grad_ready(name, tensor)
        with self.lock:
            slot = self._slot.get(name)
            if slot is None:
                raise ConfigError(f"gradient for unregistered tensor {name!r}")
            rnd = self._round
            if rnd is None:
                rnd = self._current_round()
                if rnd is None:
                    return  # e.g. CoCoD-SGD after warm-up: gradients stay local
            bucket, offset = slot
            arrived = rnd.arrived[bucket.index]
            if name in arrived:
                raise HvdCommoptError(
                    f"gradient of {name!r} was computed more than backward_passes_per_step="
                    f"{self.backward_passes_per_step} times before step(); raise "
                    f"backward_passes_per_step to accumulate gradients locally")
            if self.backward_passes_per_step > 1:
                self._countdown[name] -= 1
                if self._countdown[name] > 0:
                    return
            self._pack(rnd, bucket, name, tensor, offset)
            if len(arrived) == len(bucket.names):
                self._launch_ready(rnd)

    def _pack(self, rnd: Round, bucket: Bucket, name: str, tensor: Any, offset: int) -> None:
        i = bucket.index
        flat = rnd.flats[i]
        if flat is None:
            flat = rnd.flats[i] = self._pool.take(bucket, tensor)
            if rnd.reducer.reads_parts(bucket, self.ops):  # docs/selection.md#grad-parts
                rnd.parts[i] = []
        parts = rnd.parts.get(i)
        if parts is None:
            rnd.flats[i] = self.ops.copy_into(flat, offset, tensor)
        else:  # read where it is by the selection when the bucket launches
            parts.append((offset, tensor))
        rnd.arrived[i].add(name)

    def _launch_ready(self, rnd: Round) -> None:
        while rnd.next_launch < len(self._buckets):
            b = self._buckets[rnd.next_launch]
            if len(rnd.arrived[b.index]) != len(b.names):
                break
            flat = rnd.flats[b.index]
            parts = rnd.parts.pop(b.index, None)
            if parts is not None:
                flat = GradParts(self.ops, flat, parts)
            bs = self._bucket_streams[b.index] if self._bucket_streams is not None else None
            with _timeline.span(f"compress+launch {b.name}", "compress"):
                rnd.pending[b.index] = (rnd.reducer.start(b, rnd.info, flat, self.ctx) if bs is None else
                                        start_on_stream(bs, rnd, b, flat, rnd.flats[b.index], parts, self.ctx))
            if parts is not None:
                rnd.flats[b.index] = flat.buf  # packed into (a new tensor, where copy_into makes one)
            rnd.next_launch += 1

    def missing(self) -> list[str]:
        """Tensors whose gradient has not been handed in this step."""
        rnd = self._round
        return [n for b in self._buckets for n in b.names if rnd is None or n not in rnd.arrived[b.index]]

    # -- the rounds port (used by the scheduler) --------------------------------------------------
    def close_round(self, fetch: Callable[[str], Any] | None = None) -> Round | None:
        """End this step's round: pack the missing gradients, launch every bucket, return it.

        Tensors whose gradient never arrived (unused parameters, or fewer backward passes than
        ``backward_passes_per_step``) still take part, as Horovod's do: with ``fetch(name)`` (the
        adapter's current gradient, or None) or zeros. Returns None when the schedule does not
        communicate gradients this step. The scheduler finishes it now (synchronous path) or in
        a later step (delayed schedules).
        """
        with self.lock:
            rnd = self._current_round()
            if rnd is None:
                return None
            for name in self.missing():
                t = fetch(name) if fetch is not None else None
                bucket, offset = self._slot[name]
                if t is None:
                    like = rnd.flats[bucket.index]
                    if like is None:
                        like = next((f for f in rnd.flats if f is not None), None)
                    t = self.ops.zeros(self._specs[name].numel, self._specs[name].dtype, like=like)
                self._countdown[name] = 0
                self._pack(rnd, bucket, name, t, offset)
            self._launch_ready(rnd)
            self._reset_step()
            return rnd

    def finish_round(self, rnd: Round) -> dict[str, Any]:
        """Wait for a closed round; return {name: reduced gradient (a view, original shape)}.

        The views stay valid after :meth:`release_round`: a released buffer is reused only once
        nothing refers to it (docs/wrapper.md#grad-views), so a host may keep them as its gradients.
        """
        t0 = time.perf_counter()
        out = ReducedGrads()
        stats = StepStats(step=rnd.step)
        finite: list[Bucket] = []
        streams = self._bucket_streams
        # buckets whose NaN/Inf verdict is a device flag: settled after the loop, all their flags
        # read in one host read per step (docs/selection.md#one-read-per-step)
        deferred: list[tuple[Bucket, Any, Pending, tuple]] = []
        for b in self._buckets:
            pending = rnd.pending.pop(b.index)
            # on a side stream the compute stream waits for the bucket's event, the host does not
            flat, kept, flags = finish_bucket(streams[b.index] if streams is not None else None,
                                              rnd, b, pending, self.ctx)
            if flags is not None:
                deferred.append((b, flat, pending, flags))
            elif kept:  # NaN/Inf: memory rolled back
                finite.append(b)
            out.update(b.views(self.ops, flat))
            if pending.support is not None:
                out.sparse[b.index] = (b, *pending.support)
            comm_s = sum(h.comm_seconds for h in pending.handles)
            sent, received = pending.bytes_sent, pending.bytes_received  # sums over the handles: once
            stats.per_bucket[b.name] = {"bytes_sent": sent, "bytes_received": received, "comm_seconds": comm_s}
            stats.bytes_sent += sent
            stats.bytes_received += received
            stats.comm_seconds += comm_s
        if deferred:
            finite.extend(settle_deferred(self.ops, rnd, deferred, streams, self.ctx))
        # the step is skipped whole: no bucket's memory keeps it (docs/wrapper.md#nonfinite-step)
        if len(finite) < len(self._buckets):
            for b in finite:
                rnd.reducer.rollback(b, rnd.info, self.ctx)
            out.sparse.clear()
        stats.wait_seconds = time.perf_counter() - t0
        _timeline.complete(f"wait round {rnd.step}", "wait", t0, t0 + stats.wait_seconds)
        self.last_stats = stats
        return out

    def release_round(self, rnd: Round) -> None:
        """Return a finished round's fusion buffers to the pool; each is reused once no view of it
        is alive (a host may keep the views :meth:`finish_round` returned)."""
        with self.lock:
            if len(rnd.flats) == len(self._buckets):
                self._pool.give_back(rnd.flats)
            rnd.flats = []

    def abandon_round(self, rnd: Round) -> None:
        """Wait for a round's launched collectives (every rank's stream of collectives stays
        aligned), drop their results and release its buffers."""
        with self.lock:
            streams = self._bucket_streams
            for i, p in rnd.pending.items():
                bs = streams[i] if streams is not None else None
                if bs is None:
                    rnd.reducer.finish(p, self.ctx)
                else:
                    drop_on_stream(bs, rnd, p, self.ctx)
            rnd.pending.clear()
            self.release_round(rnd)

    # -- dropping a step mid-way (the other lifecycle calls are the Trainer's) ---------------------
    def abandon(self) -> None:
        """Drop this step's packed gradients (e.g. load_state_dict mid-step). Waits for any
        launched collectives first, so every rank's stream of collectives stays aligned."""
        with self.lock:
            if self._round is not None:
                self.abandon_round(self._round)
            self._reset_step()
