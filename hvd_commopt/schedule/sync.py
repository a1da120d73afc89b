"""Synchronous SGD: Horovod's semantics, the default schedule.

The adapter keeps its own synchronous path (``synchronize()`` writes the averaged gradients into
the framework's gradient buffers, then the wrapped optimizer steps), which is what makes
``synchronize()`` / ``skip_synchronize()`` gradient clipping work; the engine's ``synchronize``
advances this scheduler's step counter. :meth:`SyncScheduler.on_step` is the same step for a host
that routes every step through the scheduler.
"""
from __future__ import annotations

from .base import Scheduler

__all__ = ["SyncScheduler"]


class SyncScheduler(Scheduler):
    name = "sync"

    @property
    def synchronous(self) -> bool:
        return True

    def on_step(self) -> None:
        self._warmup_step()
