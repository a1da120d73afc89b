"""Chrome-trace timeline (``chrome://tracing`` / Perfetto JSON), one file per rank.

Why: the point of this project is *when* bytes move relative to computation (wait-free
backpropagation, merged buckets, delayed rounds). Step times alone cannot show whether a bucket's
allreduce overlapped backward or sat after it; a picture of one step can. Horovod has the same
tool (``HOROVOD_TIMELINE``), and its variable is honoured here too.

Enable it with ``HVD_COMMOPT_TIMELINE=/path/trace.json`` (read through :func:`hvd_commopt.env.timeline_path`;
the communicator starts it at creation) or from code with :func:`start`. Rank ``r`` writes
``/path/trace.rank<r>.json`` (or the path with ``{rank}`` replaced, when it contains ``{rank}``).

Events (``pid`` = rank, one ``tid`` lane per kind so the viewer shows them as rows):

* ``comm``: each collective as the progress thread ran it (start/finish of its :class:`Handle`,
  bytes sent/received, seconds it queued), recorded by :class:`hvd_commopt.comm.Communicator`;
* ``backward`` / ``compress`` / ``wait`` / ``update`` / ``step``: recorded by whoever knows them
  (the engine and the adapters, or a benchmark harness) through :func:`span`, :func:`complete`,
  :func:`instant`.

Design constraints: pure Python (no framework import); thread-safe (the progress thread and the
training thread both record); bounded memory (events are buffered in a small list and streamed
to the file every ``flush_every`` events; after ``max_events`` further events are counted and
dropped, and the count is written as a metadata event); flushed at exit (``atexit``) and
valid JSON whenever :meth:`Timeline.close` has run. Timestamps are ``time.perf_counter()``
seconds (the clock :class:`Handle` uses) converted to microseconds since the timeline started;
the wall-clock start is stored in the metadata so ranks can be aligned.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

from . import env

__all__ = ["Timeline", "start", "stop", "active", "start_from_env", "span", "complete", "instant",
           "record_handle", "rank_path", "LANES"]

#: lane (Chrome "thread") ids, in display order
LANES = {"step": 0, "forward": 1, "backward": 2, "compress": 3, "comm": 4, "wait": 5, "update": 6}


#: ``HOROVOD_TIMELINE=DYNAMIC``: no trace at start; ``start_timeline()`` / ``stop_timeline()`` record.
DYNAMIC = "DYNAMIC"


def rank_path(path: str, rank: int) -> str:
    """Where rank ``rank`` writes: ``{rank}`` substituted, else ``.rank<r>`` before the suffix."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class Timeline:
    """A Chrome-trace writer for one rank. Thread-safe; memory bounded by ``flush_every`` events.

    Args:
        path: the file to write (already per rank; see :func:`rank_path`).
        rank: this rank, the trace's ``pid``.
        flush_every: buffered events before they are appended to the file.
        max_events: events written at most; later ones are counted as dropped.
    """

    def __init__(self, path: str, rank: int = 0, *, flush_every: int = 2000, max_events: int = 1_000_000):
        self.path = path
        self.rank = int(rank)
        self.flush_every = max(1, int(flush_every))
        self.max_events = int(max_events)
        self.dropped = 0
        self._count = 0
        self._lock = threading.Lock()
        self._buf: list[str] = []
        self._t0 = time.perf_counter()
        self._wall0 = time.time()
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._file: Any = open(path, "w")
        self._file.write("[\n")
        self._first = True
        self._meta("process_name", {"name": f"rank {self.rank}"})
        self._meta("process_labels", {"labels": f"wall_start={self._wall0:.6f}"})
        for lane, tid in LANES.items():
            self._meta("thread_name", {"name": lane}, tid)
            self._meta("thread_sort_index", {"sort_index": tid}, tid)

    # -- internals ------------------------------------------------------------------------------
    def _meta(self, name: str, args: dict, tid: int = 0) -> None:
        self._push({"name": name, "ph": "M", "pid": self.rank, "tid": tid, "args": args}, force=True)

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _push(self, ev: dict, force: bool = False) -> None:
        line = json.dumps(ev, separators=(",", ":"), default=str)
        with self._lock:
            if self._file is None:
                return
            if not force:
                if self._count >= self.max_events:
                    self.dropped += 1
                    return
                self._count += 1
            self._buf.append(line)
            if len(self._buf) >= self.flush_every:
                self._write_locked()

    def _write_locked(self) -> None:
        if not self._buf or self._file is None:
            return
        text = ",\n".join(self._buf)
        self._file.write(text if self._first else ",\n" + text)
        self._first = False
        self._buf.clear()

    # -- recording ------------------------------------------------------------------------------
    def complete(self, name: str, lane: str, start: float, end: float, args: dict | None = None) -> None:
        """A span ``[start, end]`` in ``time.perf_counter()`` seconds on ``lane``."""
        ev = {"name": name, "cat": lane, "ph": "X", "pid": self.rank, "tid": LANES.get(lane, len(LANES)),
              "ts": self._us(start), "dur": round(max(0.0, end - start) * 1e6, 3)}
        if args:
            ev["args"] = args
        self._push(ev)

    def instant(self, name: str, lane: str, t: float | None = None, args: dict | None = None) -> None:
        """A point event (e.g. a gradient became ready) at ``t`` (default: now)."""
        ev = {"name": name, "cat": lane, "ph": "i", "s": "t", "pid": self.rank,
              "tid": LANES.get(lane, len(LANES)), "ts": self._us(time.perf_counter() if t is None else t)}
        if args:
            ev["args"] = args
        self._push(ev)

    @contextmanager
    def span(self, name: str, lane: str, args: dict | None = None) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, lane, t0, time.perf_counter(), args)

    def record_handle(self, handle: Any) -> None:
        """A finished collective (:class:`hvd_commopt.comm.Handle`) on the ``comm`` lane."""
        start, end = handle.interval
        if start is None or end is None:
            return
        args = {"bytes_sent": int(handle.bytes_sent), "bytes_received": int(handle.bytes_received),
                "queued_ms": round((start - handle._submitted) * 1e3, 3)}
        if handle._error is not None:
            args["error"] = type(handle._error).__name__
        self.complete(f"{handle.op} {handle.name}", "comm", start, end, args)

    def flush(self) -> None:
        with self._lock:
            self._write_locked()
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        """Write what is buffered, the drop count, and the closing bracket (valid JSON). Idempotent."""
        if self._file is None:
            return
        self._meta("hvd_commopt_timeline", {"events": self._count, "dropped": self.dropped,
                                            "wall_start": self._wall0})
        with self._lock:
            self._write_locked()
            self._file.write("\n]\n")
            self._file.close()
            self._file = None

    @property
    def closed(self) -> bool:
        return self._file is None


# -- process-wide timeline -------------------------------------------------------------------------
_active: Timeline | None = None
_active_lock = threading.Lock()


def active() -> Timeline | None:
    """The timeline being recorded, or None (the fast path: recording sites test this first)."""
    return _active


def start(path: str, rank: int = 0, exact: bool = False, **kw: Any) -> Timeline:
    """Start recording to ``rank_path(path, rank)`` (``path`` itself when ``exact``); closes the
    previous timeline, if any."""
    global _active
    tl = Timeline(path if exact else rank_path(path, rank), rank, **kw)
    with _active_lock:
        old, _active = _active, tl
    if old is not None:
        old.close()
    return tl


def stop() -> str | None:
    """Stop recording; return the file written (None if nothing was recording)."""
    global _active
    with _active_lock:
        old, _active = _active, None
    if old is None:
        return None
    old.close()
    return old.path


def start_from_env(rank: int, explicit: str | None = None) -> Timeline | None:
    """Start from ``explicit`` or ``HVD_COMMOPT_TIMELINE``/``HOROVOD_TIMELINE`` unless a timeline
    is already recording (an explicit :func:`start` wins over the environment)."""
    path = env.timeline_path(explicit)
    if not path or path == DYNAMIC or _active is not None:
        return _active  # DYNAMIC: recording starts at start_timeline() (docs/horovod_api.md#timeline)
    return start(path, rank)


def complete(name: str, lane: str, start_s: float, end_s: float, args: dict | None = None) -> None:
    tl = _active
    if tl is not None:
        tl.complete(name, lane, start_s, end_s, args)


def instant(name: str, lane: str, t: float | None = None, args: dict | None = None) -> None:
    tl = _active
    if tl is not None:
        tl.instant(name, lane, t, args)


def span(name: str, lane: str, args: dict | None = None) -> ContextManager[None]:
    """Record the block as a span when a timeline is active. Otherwise a shared no-op context: no
    generator is built, which the engine's per-bucket launch would pay (~2 us) for nothing."""
    tl = _active
    return _NO_SPAN if tl is None else tl.span(name, lane, args)


_NO_SPAN = nullcontext()  # reusable: nullcontext keeps no state between uses


def record_handle(handle: Any) -> None:
    tl = _active
    if tl is not None:
        tl.record_handle(handle)


atexit.register(stop)
