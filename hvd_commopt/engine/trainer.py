"""Trainer: the object an adapter trains through, holding the engine and the scheduler.

:func:`hvd_commopt.build_engine` returns one. It is a facade over two parts that do not reach into
each other: the :class:`~hvd_commopt.engine.CommEngine` (registration, buckets, packing and
launching gradients, the rounds port the scheduler drives) and the scheduler (the one step
counter and every per-step decision, seen through :class:`~hvd_commopt.engine.ports.StepScheduler`
and :class:`~hvd_commopt.engine.ports.Checkpointable`). This module forwards ``optimizer.step()``,
``synchronize()``, draining, finalizing, the global weights and checkpoints to the scheduler,
switches to the fusion tuner's new plan after a step, and hands the adapter the engine's calls
(``register``, ``grad_ready``, ...) unchanged, so an adapter talks to one object.

A step holds the engine's :attr:`~hvd_commopt.engine.CommEngine.lock`, which also serialises the
gradient hooks.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from .. import timeline as _timeline
from ..autocompress.reducer import AutoReducer
from ..buckets import Bucket, TensorSpec
from ..comm.communicator import Communicator
from ..errors import HvdCommoptError
from ..host import GradientCapture, ScheduleHost
from ..reduce.base import Reducer
from ..tensor_ops import TensorOps
from .engine import CommEngine
from .ports import Checkpointable, StepScheduler
from .settings import plan_setting
from .specs import verify_same_settings
from .state import engine_state, load_engine_state
from .stats import StepStats
from .tuner import FusionTuner

__all__ = ["Trainer"]


class Trainer:
    """The engine and its scheduler behind the calls adapters make (module docstring).

    Args:
        engine: the rounds and buckets.
        scheduler: the step's owner; ``checkpoint``: its saved state (the same object for the
            schedulers of :mod:`hvd_commopt.schedule`).

    Attributes:
        engine, scheduler: the two parts; checkpoint: the scheduler's saved state.
        held_parts: other ranks' parts of the checkpoint loaded last, kept until the next step:
            rank 0 loads, then ``broadcast_optimizer_state`` sends them on (docs/wrapper.md#checkpoints).
    """

    def __init__(self, engine: CommEngine, scheduler: StepScheduler, checkpoint: Checkpointable):
        self.engine = engine
        self.scheduler = scheduler
        self.checkpoint = checkpoint
        self._capture = GradientCapture()
        self._sync_on_step = True
        self.held_parts: dict[int, dict] = {}
        engine.attach_scheduler(scheduler)

    # -- the engine's calls and state, as adapters and tests use them ---------------------------
    @property
    def comm(self) -> Communicator:
        return self.engine.comm

    @property
    def ops(self) -> TensorOps:
        return self.engine.ops

    @property
    def reducer(self) -> Reducer:
        return self.engine.reducer

    @property
    def tuner(self) -> FusionTuner:
        return self.engine.tuner

    @property
    def plan(self) -> list[list[int]]:
        return self.engine.plan

    @property
    def buckets(self) -> list[Bucket]:
        return self.engine.buckets

    @property
    def names(self) -> list[str]:
        return self.engine.names

    @property
    def backward_names(self) -> list[str]:
        return self.engine.backward_names

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return self.engine.specs

    @property
    def last_stats(self) -> StepStats:
        return self.engine.last_stats

    @property
    def in_flight(self) -> bool:
        return self.engine.in_flight

    def register(self, specs: Sequence[TensorSpec], backward_order: Sequence[str] | None = None,
                 plan: Sequence[Sequence[int]] | None = None) -> None:
        """:meth:`CommEngine.register <hvd_commopt.engine.CommEngine.register>`."""
        self.engine.register(specs, backward_order, plan)

    def grad_ready(self, name: str, tensor: Any) -> None:
        """:meth:`CommEngine.grad_ready <hvd_commopt.engine.CommEngine.grad_ready>` (the hooks)."""
        self.engine.grad_ready(name, tensor)

    def set_plan(self, plan: Sequence[Sequence[int]]) -> None:
        """:meth:`CommEngine.set_plan <hvd_commopt.engine.CommEngine.set_plan>`."""
        self.engine.set_plan(plan)

    def missing(self) -> list[str]:
        """Tensors whose gradient has not been handed in this step."""
        return self.engine.missing()

    def abandon(self) -> None:
        """Drop this step's packed gradients (e.g. load_state_dict mid-step), after waiting for
        any launched collectives (every rank's stream of collectives stays aligned)."""
        self.engine.abandon()

    # -- wiring -------------------------------------------------------------------------------
    def attach_host(self, host: ScheduleHost) -> None:
        """Give the scheduler the adapter's :class:`~hvd_commopt.host.ScheduleHost`."""
        self.scheduler.attach(host)
        reducer = self.engine.reducer
        if isinstance(reducer, AutoReducer):  # compression="auto" prices before step 0
            reducer.read_model([s.shape for s in self.engine.specs.values()],  # docs/auto-compression.md#kinds
                               self.engine.comm.size)  # the rank count picks the table (#kinds-ranks)
            if reducer.layout_stale and self.engine.plan and not self.engine.in_flight:  # e.g. Adam: S-SGD's
                self.engine.set_plan(self.engine.plan)  # buckets (docs/auto-compression.md#adaptive-buckets)
            reducer.policy.prepare(self.engine, host)  # docs/auto-compression.md#before-step-0

    @property
    def host(self) -> ScheduleHost | None:
        """The host attached to the scheduler (None before one is)."""
        return self.scheduler.host_or_none

    @property
    def step(self) -> int:
        """Completed optimizer steps (the counter lives in the scheduler: one counter, one place)."""
        return self.scheduler.step

    # -- the step (the adapter's optimizer.step()) ----------------------------------------------
    def run_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Everything ``optimizer.step()`` does, under any schedule; returns the closure's loss.

        The scheduler runs the step (reduce, apply, advance the counter); then a planned fusion
        strategy may switch to its new plan (same step on every rank).
        """
        sched, tuner = self.scheduler, self.engine.tuner
        self.held_parts = {}  # the state moves on: a loaded checkpoint's parts are stale
        with self.engine.lock, _timeline.span(f"{sched.name} step", "update"):
            loss = sched.on_step(closure, self._sync_on_step)
            new_plan = tuner.step_end()  # same step on every rank; the plan comes from rank 0
            if new_plan is not None:
                # broadcast, so equal by construction; checked (one digest) because unequal
                # plans corrupt memory: docs/cross-rank-check.md#later-plans
                verify_same_settings(self.engine.comm, {"bucket plan": plan_setting(
                    new_plan, f"fusion={tuner.strategy!r} planned differently on some rank")},
                    what="fusion plan")
                self.set_plan(new_plan)
            if isinstance(self.engine.reducer, AutoReducer):  # compression="auto" decides after fusion
                self.engine.reducer.policy.step_end(self.engine)  # docs/auto-compression.md#policy
            return loss

    def synchronize(self) -> dict[str, Any]:
        """Horovod's ``optimizer.synchronize()``: finish reducing this step's gradients now and
        return them (the scheduler also hands them to the host). Synchronous schedule only."""
        with self.engine.lock:
            return self.scheduler.synchronize()

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
        if self.engine.in_flight:
            raise HvdCommoptError(f"{what} called between backward() and step(): this step's gradients are "
                                  f"half-sent; call it after optimizer.step()")

    def drain(self) -> None:
        """Wait for and apply every round still in flight (value-neutral; see the scheduler)."""
        with self.engine.lock:
            self._between_steps("drain()")
            self.scheduler.drain()

    def finalize(self) -> None:
        """End of training: drain in-flight rounds and leave the model at the global model."""
        with self.engine.lock:
            self._between_steps("finalize()")
            self.scheduler.finalize()

    @contextmanager
    def use_global_weights(self) -> Iterator[None]:
        """Within the block, the model holds the global replica (drained first), e.g. to evaluate
        it; under schedules whose model is the global model the block changes nothing."""
        self.drain()
        sched = self.scheduler
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
        if self.checkpoint.drains_for_checkpoint:
            self.drain()
        return engine_state(self.engine, self.checkpoint, self.scheduler.step, self.host, self.held_parts,
                            rank_local)

    def load_state_dict(self, state: dict) -> dict:
        """Restore a checkpoint from :meth:`state_dict` (rank 0's, or this rank's own); this rank
        takes its own part. Returns what the adapter gave as ``rank_local`` when saving ({} when
        the per-rank state was reset: another world size, docs/wrapper.md#checkpoints)."""
        self.engine.abandon()
        self.scheduler.abandon()
        rank_local, self.held_parts = load_engine_state(self.engine, self.checkpoint, self.host, state)
        return rank_local

    @property
    def fusion_report(self) -> dict | None:
        """The bucketing in use and, for planned strategies, predicted vs measured iteration time."""
        return self.engine.tuner.report

    @property
    def compression_report(self) -> dict | None:
        """compression="auto"'s decision per bucket, predicted and measured step, why
        (docs/auto-compression.md#report); None for a fixed compression or before deciding."""
        reducer = self.engine.reducer
        if not isinstance(reducer, AutoReducer):
            return None
        rep = reducer.policy.report
        return None if rep is None else dict(rep, phase=reducer.policy.phase)
