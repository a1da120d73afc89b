"""CommEngine: the one object the adapters talk to.

Wait-free backpropagation with tensor fusion: gradients are copied into their bucket's fusion
buffer as they become ready; a bucket is handed to its reducer the moment it is complete, so its
collective runs on the progress thread while backward continues. Buckets are launched strictly
in plan order (a bucket that completes early waits for its predecessors), which keeps the
sequence of collectives identical on every rank without Horovod's per-cycle negotiation; the
plan follows backward order, so in practice nothing waits.

Adapters call, per step: :meth:`grad_ready` from their gradient hooks, then :meth:`synchronize`,
which returns every tensor's reduced gradient as a view into the reduced buffers.

Rounds and schedules: a step's gradients form a :class:`~hvd_commopt.engine.rounds.Round` with
its own fusion buffers (from a pool). The engine's :class:`~hvd_commopt.schedule.base.Scheduler`
(``schedule=``; synchronous by default) decides per round which reducer and collective names to
use, and owns the one step counter (``engine.step`` reads it). The synchronous path is
``synchronize() = finish_round(close_round())``; delayed schedules keep closed rounds in flight
across steps and finish them later (:meth:`close_round`, :meth:`finish_round`,
:meth:`release_round`).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from .. import env
from .. import timeline as _timeline
from ..comm.communicator import Communicator
from ..compress.base import Compressor
from ..errors import ConfigError, HvdCommoptError
from ..fusion.threshold import plan_threshold, validate_plan
from ..fusion.tuner import PLANNED, FusionTuner
from ..reduce.base import ReduceContext, Reducer
from ..reduce.dense import DenseAllreduce
from ..tensor_ops import TensorOps
from .bucket import Bucket, build_buckets
from .rounds import Round
from .specs import TensorSpec, verify_same_tensors
from .stats import StepStats

__all__ = ["CommEngine", "make_reducer"]

OPS = ("average", "sum")


def make_reducer(compression: Compressor | Reducer | None) -> Reducer:
    """The reducer for a user's ``compression`` argument (a compressor or a ready reducer)."""
    if compression is None:
        return DenseAllreduce()
    if isinstance(compression, Reducer):
        return compression
    if isinstance(compression, Compressor):
        if compression.collective == "allreduce":
            return DenseAllreduce(compression)
        raise ConfigError(f"{compression!r} needs a sparse exchange; pass the reducer built by "
                          f"Compression.* instead of the bare compressor")
    raise ConfigError(f"compression must be a Compression.* value, got {compression!r}")


class CommEngine:
    """Buckets, fusion buffers, reduction and the step counter of the synchronous path.

    Args:
        comm: the communicator.
        ops: the adapter's tensor ops.
        compression: a compressor (Compression.none/fp16/bf16) or a reducer.
        fusion_threshold: bytes per fusion buffer (Horovod's meaning; 0 = one tensor per
            message; None = HVD_COMMOPT_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD / 25 MiB).
        op: "average" (default) or "sum".
        gradient_predivide_factor: with op="average", divide by this before the sum and by
            size/factor after it (Horovod's meaning).
        backward_passes_per_step: gradients of this many backward passes are accumulated
            locally (summed, as Horovod does) before one reduction.
        schedule: a ``Schedule.*`` config (default ``Schedule.sync()``); see
            :mod:`hvd_commopt.schedule`. Combinations the papers do not support are refused here.
        fusion: bucketing strategy: "threshold" (default, ``fusion_threshold``), "none" (one
            tensor per bucket), or planned from a profile of the first steps: "mgwfbp",
            "optimal", "auto" (see :mod:`hvd_commopt.fusion.tuner`; synchronous schedule only).
        fusion_options: :class:`~hvd_commopt.fusion.tuner.FusionOptions` or a dict of its fields
            (warm-up/profiled steps, a cost model to skip calibration, verbose).
    """

    def __init__(self, comm: Communicator, ops: TensorOps, *, compression: Compressor | Reducer | None = None,
                 fusion_threshold: int | None = None, op: str = "average",
                 gradient_predivide_factor: float = 1.0, backward_passes_per_step: int = 1,
                 schedule: Any = None, fusion: str = "threshold", fusion_options: Any = None):
        if op not in OPS:
            raise ConfigError(f"op must be one of {OPS} (hco.Average / hco.Sum), got {op!r}")
        if backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if gradient_predivide_factor <= 0:
            raise ConfigError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        if gradient_predivide_factor != 1.0 and op != "average":
            raise ConfigError("gradient_predivide_factor only applies to op=Average")
        self.comm, self.ops = comm, ops
        self.reducer = make_reducer(compression)
        self.fusion_threshold = env.fusion_threshold_bytes(fusion_threshold)
        self.op = op
        self.backward_passes_per_step = int(backward_passes_per_step)
        f = float(gradient_predivide_factor)
        if op == "average":
            self.ctx = ReduceContext(comm, ops, prescale=1.0 / f, postscale=f / comm.size)
        else:
            self.ctx = ReduceContext(comm, ops)
        self.last_stats = StepStats()
        self.plan: list[list[int]] = []
        self._specs: dict[str, TensorSpec] = {}
        self._backward: list[TensorSpec] = []
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[str, Bucket] = {}
        self._lock = threading.RLock()
        self._round: Round | None = None       # the round the hooks are filling
        self._pool: list[list[Any]] = []       # fusion buffers of released rounds, for reuse
        self._countdown: dict[str, int] = {}
        from ..schedule import build_scheduler  # late: the schedule package builds on the engine
        self.scheduler = build_scheduler(schedule, self)
        if fusion in PLANNED and not self.scheduler.synchronous:
            raise ConfigError(f"fusion={fusion!r} plans buckets from profiled synchronous steps; with schedule "
                              f"'{self.scheduler.name}' use fusion='threshold' or 'none'")
        self.tuner = FusionTuner(fusion, comm, threshold_bytes=self.fusion_threshold, reducer=self.reducer,
                                 ops=ops, options=fusion_options)

    @property
    def step(self) -> int:
        """Completed optimizer steps; the counter lives in the scheduler (one counter, one place)."""
        return self.scheduler.step

    @step.setter
    def step(self, value: int) -> None:
        self.scheduler.step = int(value)

    def attach_host(self, host: Any) -> None:
        """Give the scheduler the adapter's :class:`~hvd_commopt.schedule.base.ScheduleHost`."""
        self.scheduler.attach(host)

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
            RankMismatchError: the tensors differ across ranks (checked collectively).
        """
        specs = list(specs)
        verify_same_tensors(self.comm, specs)
        by_name = {s.name: s for s in specs}
        order = list(backward_order) if backward_order is not None else [s.name for s in reversed(specs)]
        if sorted(order) != sorted(by_name):
            raise ConfigError("backward_order must list every registered tensor exactly once")
        self._specs = by_name
        self._backward = [by_name[n] for n in order]
        self.set_plan(self.tuner.initial_plan(order, [s.nbytes for s in self._backward], plan))

    def set_plan(self, plan: Sequence[Sequence[int]]) -> None:
        """Replace the bucketing (between steps only). The caller makes it identical on all ranks."""
        with self._lock:
            if self.in_flight:
                raise HvdCommoptError("cannot change the fusion plan while gradients are in flight; "
                                      "call it between optimizer steps")
            validate_plan(plan, len(self._backward))
            if self.scheduler.outstanding:
                self.scheduler.drain()  # earlier rounds use the old layout; draining is value-neutral
            self.plan = [list(g) for g in plan]
            self._buckets = build_buckets(self._backward, self.plan)
            self._bucket_of = {n: b for b in self._buckets for n in b.names}
            self._pool = []
            self._reset_step()

    @property
    def tensor_names(self) -> list[str]:
        """Registered names in backward order."""
        return [s.name for s in self._backward]

    @property
    def registered_names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._specs)

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    # -- per step -----------------------------------------------------------------------------
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
            plan = self.scheduler.round_plan()
            if plan is None:
                return None
            flats = self._pool.pop() if self._pool else [None] * len(self._buckets)
            self._round = Round(self.step, plan.reducer, plan.tag, flats,
                                [set() for _ in self._buckets])
        return self._round

    def grad_ready(self, name: str, tensor: Any) -> None:
        """A gradient is ready (called from backward hooks). Packs it; launches full buckets."""
        _timeline.instant(f"grad {name}", "backward")  # no-op unless a timeline is recording
        if self.tuner.recording:
            self.tuner.grad_ready(name, tensor)
        with self._lock:
            bucket = self._bucket_of.get(name)
            if bucket is None:
                raise ConfigError(f"gradient for unregistered tensor {name!r}")
            rnd = self._current_round()
            if rnd is None:
                return  # e.g. CoCoD-SGD after warm-up: gradients stay local
            if name in rnd.arrived[bucket.index]:
                raise HvdCommoptError(
                    f"gradient of {name!r} was computed more than backward_passes_per_step="
                    f"{self.backward_passes_per_step} times before step(); raise "
                    f"backward_passes_per_step to accumulate gradients locally")
            self._countdown[name] -= 1
            if self._countdown[name] > 0:
                return
            self._pack(rnd, bucket, name, tensor)
            self._launch_ready(rnd)

    def _pack(self, rnd: Round, bucket: Bucket, name: str, tensor: Any) -> None:
        ops = self.ops
        if rnd.flats[bucket.index] is None:
            rnd.flats[bucket.index] = ops.empty(bucket.numel, bucket.dtype, like=tensor)
        i = bucket.names.index(name)
        rnd.flats[bucket.index] = ops.copy_into(rnd.flats[bucket.index], bucket.offsets[i], tensor)
        rnd.arrived[bucket.index].add(name)

    def _launch_ready(self, rnd: Round) -> None:
        while rnd.next_launch < len(self._buckets):
            b = self._buckets[rnd.next_launch]
            if len(rnd.arrived[b.index]) != len(b.names):
                break
            with _timeline.span(f"compress+launch {b.name}", "compress"):
                rnd.pending[b.index] = rnd.reducer.start(rnd.wire_name(b.name), rnd.flats[b.index], self.ctx)
            rnd.next_launch += 1

    def missing(self) -> list[str]:
        """Tensors whose gradient has not been handed in this step."""
        rnd = self._round
        return [n for b in self._buckets for n in b.names if rnd is None or n not in rnd.arrived[b.index]]

    def close_round(self, fetch: Callable[[str], Any] | None = None) -> Round | None:
        """End this step's round: pack the missing gradients, launch every bucket, return it.

        Tensors whose gradient never arrived (unused parameters, or fewer backward passes than
        ``backward_passes_per_step``) still take part, as Horovod's do: with ``fetch(name)`` (the
        adapter's current gradient, or None) or zeros. Returns None when the schedule does not
        communicate gradients this step. The caller finishes it (:meth:`finish_round`) now
        (synchronous path) or in a later step (delayed schedules).
        """
        with self._lock:
            rnd = self._current_round()
            if rnd is None:
                return None
            for name in self.missing():
                t = fetch(name) if fetch is not None else None
                bucket = self._bucket_of[name]
                if t is None:
                    like = rnd.flats[bucket.index]
                    if like is None:
                        like = next((f for f in rnd.flats if f is not None), None)
                    t = self.ops.zeros(self._specs[name].numel, self._specs[name].dtype, like=like)
                self._countdown[name] = 0
                self._pack(rnd, bucket, name, t)
            self._launch_ready(rnd)
            self._reset_step()
            return rnd

    def finish_round(self, rnd: Round) -> dict[str, Any]:
        """Wait for a closed round; return {name: reduced gradient (a view, original shape)}.

        The views stay valid until :meth:`release_round` hands the buffers back for reuse.
        """
        t0 = time.perf_counter()
        out: dict[str, Any] = {}
        stats = StepStats(step=rnd.step)
        for b in self._buckets:
            pending = rnd.pending.pop(b.index)
            reduced = rnd.reducer.finish(pending, self.ctx)
            for name, shape, off in zip(b.names, b.shapes, b.offsets):
                n = self._specs[name].numel
                out[name] = self.ops.reshape(self.ops.slice(reduced, off, off + n), shape)
            comm_s = sum(h.comm_seconds for h in pending.handles)
            stats.per_bucket[b.name] = {"bytes_sent": pending.bytes_sent,
                                        "bytes_received": pending.bytes_received,
                                        "comm_seconds": comm_s}
            stats.bytes_sent += pending.bytes_sent
            stats.bytes_received += pending.bytes_received
            stats.comm_seconds += comm_s
        stats.wait_seconds = time.perf_counter() - t0
        _timeline.complete(f"wait round {rnd.step}", "wait", t0, t0 + stats.wait_seconds)
        self.last_stats = stats
        return out

    def release_round(self, rnd: Round) -> None:
        """Return a finished round's fusion buffers to the pool (its views become invalid)."""
        with self._lock:
            if len(rnd.flats) == len(self._buckets):
                self._pool.append(rnd.flats)
            rnd.flats = []

    def synchronize(self, fetch: Callable[[str], Any] | None = None) -> dict[str, Any]:
        """Finish the step's reduction; return {name: reduced gradient (a view, original shape)}.

        The synchronous path: close this step's round, wait for it, advance the step counter.
        Missing gradients are handled as in :meth:`close_round`.
        """
        with self._lock:
            rnd = self.close_round(fetch)
            if rnd is None:
                raise HvdCommoptError(f"synchronize(): the '{self.scheduler.name}' schedule does not "
                                      f"reduce gradients at step {self.step}")
            out = self.finish_round(rnd)
            self.step += 1
            self.release_round(rnd)  # views stay readable until the next round packs into them
            new_plan = self.tuner.step_end()  # same step on every rank; the plan comes from rank 0
            if new_plan is not None:
                self.set_plan(new_plan)
            return out

    @property
    def fusion_report(self) -> dict | None:
        """The bucketing in use and, for planned strategies, predicted vs measured iteration time."""
        return self.tuner.report

    def abandon(self) -> None:
        """Drop this step's packed gradients (e.g. load_state_dict mid-step). Waits for any
        launched collectives first, so every rank's stream of collectives stays aligned."""
        with self._lock:
            rnd = self._round
            if rnd is not None:
                for p in rnd.pending.values():
                    rnd.reducer.finish(p, self.ctx)
                rnd.pending.clear()
                self.release_round(rnd)
            self._reset_step()

    # -- schedule entry points (the adapter's optimizer.step / finalize) ---------------------------
    def run_step(self) -> None:
        """Everything ``optimizer.step()`` does under a non-synchronous schedule."""
        with self._lock, _timeline.span(f"{self.scheduler.name} step", "update"):
            self.scheduler.on_step()

    def drain(self) -> None:
        """Wait for and apply every round still in flight (value-neutral; see the scheduler)."""
        with self._lock:
            if self.in_flight:
                raise HvdCommoptError("drain()/finalize()/state_dict() called between backward() and step(): "
                                      "this step's gradients are half-sent; call it after optimizer.step()")
            self.scheduler.drain()

    def finalize(self) -> None:
        """End of training: drain in-flight rounds and leave the model at the global model."""
        with self._lock:
            if self.in_flight:
                raise HvdCommoptError("finalize() called between backward() and step(); call it after "
                                      "optimizer.step()")
            self.scheduler.finalize()

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Step counter, reducer state and the schedule's state. A non-synchronous schedule
        drains its in-flight rounds first (value-neutral), so no pending collective is saved."""
        if not self.scheduler.synchronous:
            self.drain()
        return {"step": self.step, "reducer": self.reducer.state_dict(),
                "schedule": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.abandon()
        self.scheduler.abandon()
        self.step = int(state.get("step", 0))
        self.reducer.load_state_dict(state.get("reducer", {}))
        if "schedule" in state:
            self.scheduler.load_state_dict(state["schedule"])
