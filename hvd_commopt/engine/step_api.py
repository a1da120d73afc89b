"""StepApi: the calls adapters make around a step, each carried out by the attached scheduler.

:class:`~hvd_commopt.engine.CommEngine` is a StepApi: this half wires the scheduler and the host
and forwards ``optimizer.step()``, ``synchronize()``, draining, finalizing, the global weights
and checkpoints to the scheduler (and the planned fusion plan switch to the tuner); the rounds
themselves (registration, packing, launching, the rounds port the scheduler drives) stay in
:mod:`.engine`. A base class rather than a member object, so every call keeps its place on the
engine (``engine.run_step``, ``engine.drain``, ...) and nothing that calls it changes.

What it reads of the engine it is part of: ``scheduler``, ``comm``, ``tuner``, ``held_parts``,
``_lock``, ``_capture``, ``_sync_on_step``, ``in_flight`` and ``set_plan`` (all set up by
``CommEngine.__init__``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from .. import timeline as _timeline
from ..errors import HvdCommoptError
from ..host import ScheduleHost
from .ports import StepScheduler
from .settings import plan_setting
from .specs import verify_same_settings
from .state import engine_state, load_engine_state

if TYPE_CHECKING:
    import threading

    from ..comm.communicator import Communicator
    from ..host import GradientCapture
    from .tuner import FusionTuner

__all__ = ["StepApi"]


class StepApi:
    """The scheduler's wiring and the per-step calls of :class:`~hvd_commopt.engine.CommEngine`
    (module docstring)."""

    if TYPE_CHECKING:  # what it reads of the engine it is part of (set up by CommEngine.__init__)
        scheduler: StepScheduler | None
        comm: Communicator
        tuner: FusionTuner
        held_parts: dict[int, dict]
        _lock: threading.RLock
        _capture: GradientCapture
        _sync_on_step: bool

        @property
        def in_flight(self) -> bool: ...

        def set_plan(self, plan: Sequence[Sequence[int]]) -> None: ...

    # -- wiring -------------------------------------------------------------------------------
    def attach_scheduler(self, scheduler: StepScheduler) -> None:
        """Set the scheduler (done by :func:`hvd_commopt.build_engine`)."""
        self.scheduler = scheduler

    def _sched(self) -> StepScheduler:
        if self.scheduler is None:
            raise HvdCommoptError("this CommEngine has no scheduler: build it with hvd_commopt.build_engine(...)")
        return self.scheduler

    def attach_host(self, host: ScheduleHost) -> None:
        """Give the scheduler the adapter's :class:`~hvd_commopt.host.ScheduleHost`."""
        self._sched().attach(host)

    @property
    def host(self) -> ScheduleHost | None:
        """The host attached to the scheduler (None before one is)."""
        return self._sched().host_or_none

    @property
    def step(self) -> int:
        """Completed optimizer steps (the counter lives in the scheduler: one counter, one place)."""
        return self._sched().step

    # -- the step (the adapter's optimizer.step()) ----------------------------------------------
    def run_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Everything ``optimizer.step()`` does, under any schedule; returns the closure's loss.

        The scheduler runs the step (reduce, apply, advance the counter); then a planned fusion
        strategy may switch to its new plan (same step on every rank).
        """
        sched = self._sched()
        self.held_parts = {}  # the state moves on: a loaded checkpoint's parts are stale
        with self._lock, _timeline.span(f"{sched.name} step", "update"):
            loss = sched.on_step(closure, self._sync_on_step)
            new_plan = self.tuner.step_end()  # same step on every rank; the plan comes from rank 0
            if new_plan is not None:
                # broadcast, so equal by construction; checked (one digest) because unequal
                # plans corrupt memory: docs/cross-rank-check.md#later-plans
                verify_same_settings(self.comm, {"bucket plan": plan_setting(
                    new_plan, f"fusion={self.tuner.strategy!r} planned differently on some rank")},
                    what="fusion plan")
                self.set_plan(new_plan)
            return loss

    def synchronize(self) -> dict[str, Any]:
        """Horovod's ``optimizer.synchronize()``: finish reducing this step's gradients now and
        return them (the scheduler also hands them to the host). Synchronous schedule only."""
        with self._lock:
            return self._sched().synchronize()

    def reduce_step(self, grads: dict[str, Any] | None = None) -> dict[str, Any]:
        """One step for callers that apply the reduced gradients themselves (TensorFlow's tape,
        tests): the step runs with a :class:`~hvd_commopt.host.GradientCapture` host and the
        reduced gradients come back. ``grads``: the local gradients of tensors whose hook did not
        fire (default: none; they take part as zeros)."""
        if self.host is not self._capture:
            self.attach_host(self._capture)
        self._capture.set_grads(grads or {})
        self.run_step()
        return self._capture.take()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within the block, ``run_step`` applies the gradients the framework holds without
        reducing them (after an explicit :meth:`synchronize`, e.g. to clip; Horovod's contract)."""
        self._sync_on_step = False
        try:
            yield
        finally:
            self._sync_on_step = True

    # -- lifecycle ------------------------------------------------------------------------------
    def _between_steps(self, what: str) -> None:
        if self.in_flight:
            raise HvdCommoptError(f"{what} called between backward() and step(): this step's gradients are "
                                  f"half-sent; call it after optimizer.step()")

    def drain(self) -> None:
        """Wait for and apply every round still in flight (value-neutral; see the scheduler)."""
        with self._lock:
            self._between_steps("drain()")
            self._sched().drain()

    def finalize(self) -> None:
        """End of training: drain in-flight rounds and leave the model at the global model."""
        with self._lock:
            self._between_steps("finalize()")
            self._sched().finalize()

    @contextmanager
    def use_global_weights(self) -> Iterator[None]:
        """Within the block, the model holds the global replica (drained first), e.g. to evaluate
        it; under schedules whose model is the global model the block changes nothing."""
        self.drain()
        sched = self._sched()
        replica = sched.global_weights()
        if replica is None:
            yield
            return
        saved = sched.swap_in_weights(replica)
        try:
            yield
        finally:
            sched.swap_in_weights(saved)

    # -- checkpoint ---------------------------------------------------------------------------
    def state_dict(self, rank_local: dict | None = None) -> dict:
        """Step counter, schedule state, and every rank's per-rank state (residuals, DGC memory,
        local weights, the schedule's local state, ``rank_local`` from the adapter) gathered into
        rank 0's result (docs/wrapper.md#checkpoints). **A collective: call it on every rank**
        (then save rank 0's), between steps. A schedule that keeps rounds in flight across steps
        drains them first (value-neutral), so no pending collective is saved."""
        return engine_state(self, self._sched(), rank_local)

    def load_state_dict(self, state: dict) -> dict:
        """Restore a checkpoint from :meth:`state_dict` (rank 0's, or this rank's own); this rank
        takes its own part. Returns what the adapter gave as ``rank_local`` when saving ({} when
        the per-rank state was reset: another world size, docs/wrapper.md#checkpoints)."""
        return load_engine_state(self, self._sched(), state)

    @property
    def fusion_report(self) -> dict | None:
        """The bucketing in use and, for planned strategies, predicted vs measured iteration time."""
        return self.tuner.report
