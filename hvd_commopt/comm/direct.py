"""Collectives started on the calling thread (docs/backends.md#direct-start).

Why: the progress thread wakes twice for each collective, once to start it and once to take its
result. A bucket sent during backward makes it do both while backward runs, and its Python then
competes with the backward's hooks for the GIL and for the shared cores: measured 0.3-1.0 ms per
1 MB bucket on the emulated 10 Gbit/s link, where the same collective started from the calling
thread, as DDP's reducer starts one, costs the backward no more than its transfer
(docs/backends.md#direct-start).

A backend that can start a collective without waiting for it (``start_allreduce`` and
``start_allgather_equal``: torch.distributed on CPU tensors) has it started here, on the caller's
thread, when nothing is queued or running on the progress thread, so every rank still issues its
collectives in program order. The result is taken by whoever waits for the handle (the step),
through the backend's own bounded wait with the deadline set at the start: a timeout or a failed
peer is reported exactly as on the progress thread. Until then the waiter polls the work with
short pauses, looking at the peers every slice (docs/backends.md#direct-wait).
:attr:`Handle.comm_seconds` then runs from the start to that wait.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .handle import Handle

__all__ = ["DirectHandle", "START_ON_CALLER"]

#: start a lone collective on the calling thread where the backend can; tests and benchmarks set
#: False to send everything through the progress thread and compare the two
START_ON_CALLER = True

#: The waiter's pauses (docs/backends.md#direct-wait): from 50 us, doubling to 200 us; once the
#: collective has run longer than 20 ms, up to 1 % of its age (so it is seen done at most 1 % of
#: its time late), at most 2 ms. A 2 s wait then wakes about 1,300 times instead of 10,000.
PAUSE_MIN_S, PAUSE_SHORT_S, PAUSE_MAX_S, LATE_FRACTION = 5e-5, 2e-4, 2e-3, 0.01


class DirectHandle(Handle):
    """A :class:`Handle` whose collective was started on the calling thread.

    ``is_completed()`` tells, without blocking, whether the backend has finished; ``complete(h)``
    waits for it (bounded by the deadline) and sets ``h``'s result or error. The first
    :meth:`poll` that sees it finished, or the first :meth:`wait`, completes it, once.
    """

    __slots__ = ("_is_completed", "_complete", "_mutex")

    def __init__(self, op: str, name: str, is_completed: Callable[[], bool],
                 complete: Callable[["DirectHandle"], None]):
        super().__init__(op, name)
        self._is_completed = is_completed
        self._complete = complete
        self._mutex = threading.Lock()

    def _finish(self) -> None:
        with self._mutex:
            if not self._done.is_set():
                self._complete(self)

    def poll(self) -> bool:
        if not self._done.is_set() and self._is_completed():
            self._finish()
        return self._done.is_set()

    def wait_ready(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the backend to finish; True when it has (the handle is then
        completed). Polls with pauses growing from 50 to 200 us, and on a collective older than
        20 ms to 1 % of its age, at most 2 ms (docs/backends.md#direct-wait)."""
        end = time.monotonic() + seconds
        pause = PAUSE_MIN_S
        while not self.poll():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            age = time.perf_counter() - self._submitted
            pause = min(max(min(pause * 2, PAUSE_SHORT_S), LATE_FRACTION * age), PAUSE_MAX_S)
        return True

    def wait(self, timeout: float | None = None) -> Any:
        """The result, waiting for the backend first (bounded by the communicator's deadline,
        set when the collective started, whatever ``timeout`` says)."""
        self._finish()
        return super().wait(0)
