"""Handle: a pending collective that can be polled and waited on (Horovod's ``*_async`` model)."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..errors import CollectiveTimeoutError

__all__ = ["Handle", "JoinedReply"]


class Handle:
    """Result of a non-blocking collective.

    ``poll()`` never blocks. ``wait(timeout)`` blocks at most ``timeout`` seconds and then raises
    :class:`CollectiveTimeoutError`; an error raised by the backend is re-raised in the waiting
    thread.
    """

    __slots__ = ("op", "name", "_done", "_result", "_error", "_submitted", "_started", "_finished", "bytes_sent",
                 "bytes_received", "_convert")

    def __init__(self, op: str, name: str):
        self.op = op
        self.name = name
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._submitted = time.perf_counter()
        self._started: float | None = None
        self._finished: float | None = None
        self.bytes_sent = 0      # set by the progress thread when done (accounting formulas)
        self.bytes_received = 0
        self._convert: Callable[[Any], Any] | None = None  # applied once, by the first waiter

    # -- producer side (progress thread) ------------------------------------------------------
    def _start(self) -> None:
        self._started = time.perf_counter()

    def _set(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._finished = time.perf_counter()
        self._done.set()

    # -- consumer side ------------------------------------------------------------------------
    def poll(self) -> bool:
        """True once the collective has completed (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the backend's error."""
        if not self._done.wait(timeout):
            raise CollectiveTimeoutError(
                f"{self.op} '{self.name}' did not complete within {timeout:.1f} s. Another rank is "
                f"probably not calling it (it skipped a step, raised an error, or the model or data "
                f"differ across ranks). Raise HVD_COMMOPT_TIMEOUT if a step is legitimately slower.",
                op=self.op, name=self.name)
        if self._error is not None:
            raise self._error
        if self._convert is not None:  # e.g. a host buffer back into a framework tensor
            self._result, self._convert = self._convert(self._result), None
        return self._result

    @property
    def comm_seconds(self) -> float:
        """Seconds the backend spent on this collective (0 until done)."""
        if self._started is None or self._finished is None:
            return 0.0
        return self._finished - self._started

    @property
    def interval(self) -> tuple[float | None, float | None]:
        """(start, finish) in ``time.perf_counter()`` seconds, for timelines."""
        return self._started, self._finished


class JoinedReply:
    """What a rank that called ``join()`` contributes to the others' object exchanges in place of
    its object (docs/horovod_api.md#join); a negotiation round reads it as a "join" request."""

    NEGOTIATION = "negotiate"  # the name of the negotiation rounds (hvd_commopt.negotiate)

    def __init__(self, request: Any):
        self.request = request
