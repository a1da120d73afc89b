"""Communicator: a backend plus one progress thread that runs its collectives in order.

Why a thread (Horovod's background thread) rather than the backend's own non-blocking calls:
Open MPI progresses non-blocking collectives only inside MPI calls, so a request that nobody
tests does not move while Python runs backward. One thread that owns the backend and drives each
collective to completion gives real overlap with computation on every backend, serialises all
calls into the backend (no MPI_THREAD_MULTIPLE needed), and keeps the collective order identical
on all ranks because everything is issued from one FIFO queue.

Every public method has an ``_async`` form returning a :class:`Handle`; the blocking form waits
with the communicator's timeout, so no call can block forever.

A lone allreduce on a backend that can start one without waiting (torch.distributed on CPU
tensors) is started on the calling thread instead when nothing is queued or running
(:mod:`hvd_commopt.comm.direct`, docs/backends.md#direct-start): the order stays the same on every
rank, and the progress thread does not wake during backward for it.
"""
from __future__ import annotations

import numbers
import pickle
import queue
import threading
import time
from typing import Any, Callable


from .. import timeline as _timeline
from ..errors import CollectiveTimeoutError, ConfigError, HvdCommoptError
from .base import REDUCE_OPS, Backend
from . import direct as _direct
from .direct import DirectHandle
from .handle import Handle, JoinedReply
from .objects import ObjectCollectives
from .traffic import CountingLink, TrafficCounter, from_wire, nbytes as _nbytes, to_wire
from ..errors import RankFailedError

__all__ = ["Communicator", "JoinedReply", "TrafficCounter", "CountingLink", "to_wire", "from_wire"]


_STOP = object()
# How often a waiting thread asks the backend whether a peer has failed or left. Waking five
# times a second costs nothing measurable; it bounds how late a dead peer is reported.
_PEER_CHECK_S = 0.2


class Communicator(ObjectCollectives):
    """Rank, size and collectives over a :class:`Backend`, each available blocking or async.

    Args:
        backend: the transport.
        timeout_s: how long a blocking call (or ``Handle.wait`` through :meth:`wait`) may take.
    """

    def __init__(self, backend: Backend, timeout_s: float):
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.traffic = TrafficCounter()
        # the process sets made on this communicator (hvd_commopt.process_sets.registry): a new
        # init() makes a new communicator, hence an empty registry
        self.process_sets: Any = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._closed = False
        self._order = threading.Lock()  # submissions against direct starts (docs/backends.md#direct-start)
        self._queued = 0  # items submitted to the progress thread and not yet done
        self._thread = threading.Thread(target=self._run, name=f"hvd_commopt-progress-{backend.rank}", daemon=True)
        self._thread.start()
        _timeline.start_from_env(backend.rank)  # HVD_COMMOPT_TIMELINE: one trace per rank

    # -- identity -----------------------------------------------------------------------------
    @property
    def rank(self) -> int: return self.backend.rank
    @property
    def size(self) -> int: return self.backend.size
    @property
    def local_rank(self) -> int: return self.backend.local_rank
    @property
    def local_size(self) -> int: return self.backend.local_size
    @property
    def buffer_kind(self) -> str: return self.backend.buffer_kind

    # -- progress thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            # hold nothing of the last collective while idle: its result may share memory with a
            # fusion buffer, which is reused only once nothing refers to it (docs/wrapper.md#grad-views)
            item = handle = args = None
            item = self._queue.get()
            if item is _STOP:
                return
            handle, fn, args, traffic = item
            try:
                if self._broken is not None:
                    handle._set(error=HvdCommoptError(
                        f"{handle.op} '{handle.name}' not started: an earlier collective failed "
                        f"({self._broken}). The job cannot continue; restart it."))
                    continue
                handle._start()
                self._complete(handle, lambda: fn(*args, deadline=time.monotonic() + self.timeout_s), traffic)  # noqa: B023 - called in this iteration
            finally:
                with self._order:
                    self._queued -= 1

    def _complete(self, handle: Handle, run: Callable[[], Any], traffic: Callable[[Any], tuple[float, float]]) -> None:
        """Run (or finish) ``handle``'s collective and set its result or error, with the accounting."""
        try:
            result = run()
        except BaseException as e:  # noqa: BLE001 - forwarded to the waiting thread
            if isinstance(e, CollectiveTimeoutError):
                self._broken = e  # an MPI collective cannot be cancelled: the stream is dead
            handle._set(error=e)
            return
        sent, received = traffic(result)
        handle.bytes_sent, handle.bytes_received = int(sent), int(received)
        handle._set(result=result)
        self.traffic.add(sent, received, handle.comm_seconds)
        _timeline.record_handle(handle)  # no-op unless a timeline is recording

    def _start_direct(self, op: str, name: str, start: Callable[..., Any], args: tuple,
                      traffic: Callable[[Any], tuple[float, float]]) -> Handle | None:
        """A handle for a collective started now, on this thread, by the backend's ``start(*args,
        deadline)``, or None: the backend cannot start this one so (its default), or the
        progress thread holds earlier collectives, which must go first
        (docs/backends.md#direct-start). The method returns (is_completed, finish) or None."""
        if not (self.backend.starts_on_caller and _direct.START_ON_CALLER):
            return None
        with self._order:
            if self._queued or self._closed or self._broken is not None:
                return None
            begun = start(*args, time.monotonic() + self.timeout_s)
        if begun is None:
            return None
        is_completed, finish = begun
        h = DirectHandle(op, name, is_completed, lambda hh: self._complete(hh, finish, traffic))
        h._start()
        return h

    def _submit(self, op: str, name: str, fn: Callable, args: tuple, traffic: Callable[[Any], tuple[float, float]]) -> Handle:
        if self._closed:
            raise HvdCommoptError(f"{op} '{name}' called after shutdown(); call init() again")
        h = Handle(op, name)
        if threading.get_ident() == self._thread.ident:
            # submitted by a deferred operation running on the progress thread (:meth:`defer`):
            # run it now, in the deferred operation's place in the order (docs/horovod_api.md#async)
            h._start()
            self._complete(h, lambda: fn(*args, deadline=time.monotonic() + self.timeout_s), traffic)
            return h
        with self._order:
            self._queued += 1
        self._queue.put((h, fn, args, traffic))
        return h

    def defer(self, op: str, name: str, start: Callable[[], Any]) -> Handle:
        """Run ``start()`` on the progress thread, in submission order with every other
        collective, and return at once: the handle's result is what ``start`` returns. The
        collectives ``start`` submits run there and then, so a whole negotiated operation (its
        cross-rank check, then its payload) keeps one place in the order without blocking the
        caller (Horovod's ``*_async``, docs/horovod_api.md#async)."""
        return self._submit(op, name, lambda deadline: start(), (), lambda _r: (0, 0))

    def follow_joined(self, reply: Any) -> int:
        """``join()`` where the backend follows its peers (:meth:`Backend.follow_joined`), in order;
        no timeout (the others may train for long), but a peer that fails or leaves ends it."""
        data = pickle.dumps(JoinedReply(reply))
        h = self._submit("join", "join", self.backend.follow_joined, (data,), lambda _r: (0, 0))
        self._wait_watching_peers(h, float("inf"))
        return h.wait(0)

    def wait(self, handle: Handle) -> Any:
        """Wait for ``handle`` at most the communicator's timeout; then fail naming the missing ranks."""
        if handle.poll():  # done already (most buckets, by the time the step waits): its result or
            return handle.wait(0)  # error as below, without the sliced wait (once per bucket and step)
        # A backend that enforces the deadline itself names the missing ranks exactly; give it a
        # moment to do so before this thread diagnoses on its own.
        limit = self.timeout_s + (2.0 if self.backend.enforces_deadline else 0.0)
        limit = self._wait_watching_peers(handle, limit)
        try:
            return handle.wait(limit)
        except CollectiveTimeoutError:
            if handle.poll():  # the backend itself timed out and already named the ranks
                raise
            missing, detail = self.backend.diagnose()
            err = CollectiveTimeoutError(
                f"rank {self.rank}: {handle.op} '{handle.name}' did not complete within "
                f"{self.timeout_s:g} s; {detail}. Ranks must run the same collectives in the same "
                f"order: a rank skipped a step, raised an error, or its model or data differ. Raise "
                f"HVD_COMMOPT_TIMEOUT (or timeout_s) if the job is only slow.",
                op=handle.op, name=handle.name, missing_ranks=missing)
            self._broken = err
            raise err from None

    def _wait_watching_peers(self, handle: Handle, limit: float) -> float:
        """Wait up to ``limit`` s for ``handle``, in slices, asking the backend between them
        whether a peer failed or ended its script: then the collective can never complete, and
        waiting out the timeout would keep the whole job alive for it (300 s by default).
        Returns the time left of ``limit``; raises RankFailedError naming the peer."""
        begun = time.monotonic()
        end = begun + limit
        while not self._wait_slice(handle, min(_PEER_CHECK_S, max(end - time.monotonic(), 0.0))):
            if time.monotonic() >= end:
                return 0.0
            stalled = self.backend.stalled(time.monotonic() - begun)
            if stalled is not None:  # docs/horovod_api.md#one-rank-step
                self._broken = CollectiveTimeoutError(
                    f"rank {self.rank}: {handle.op} '{handle.name}' cannot complete: {stalled[1]}. Seen after "
                    f"{time.monotonic() - begun:.1f} s instead of the {self.timeout_s:g} s timeout",
                    op=handle.op, name=handle.name, missing_ranks=stalled[0])
                raise self._broken
            failed = self.backend.peer_failure()
            if failed is not None:
                err = RankFailedError(f"rank {self.rank}: {handle.op} '{handle.name}' cannot complete: "
                                      f"{failed[1]}", failed_rank=failed[0], op=handle.op, name=handle.name)
                self._broken = err
                raise err
        return max(end - time.monotonic(), 0.0)

    @staticmethod
    def _wait_slice(handle: Handle, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``handle``; True when it is done. A direct one
        (docs/backends.md#direct-start) is polled (docs/backends.md#direct-wait)."""
        if not isinstance(handle, DirectHandle):
            return handle._done.wait(seconds)
        return handle.wait_ready(seconds)

    # -- collectives --------------------------------------------------------------------------
    def allreduce_async_(self, buf: Any, op: str = "sum", name: str = "allreduce") -> Handle:
        """In-place reduction of ``buf``; ``op`` in ('sum', 'min', 'max', 'prod')."""
        if op not in REDUCE_OPS:
            raise ConfigError(f"reduce op {op!r} unknown; use one of {REDUCE_OPS} (average = sum then divide)")
        p = self.size
        n = _nbytes(buf)
        traffic = lambda _r: (2 * (p - 1) / p * n, 2 * (p - 1) / p * n)  # noqa: E731
        h = self._start_direct("allreduce", name, self.backend.start_allreduce, (buf, op, name), traffic)
        if h is not None:
            return h
        return self._submit("allreduce", name, self.backend.allreduce_, (buf, op, name), traffic)

    def allreduce_(self, buf: Any, op: str = "sum", name: str = "allreduce") -> Any:
        return self.wait(self.allreduce_async_(buf, op, name))

    # -- framework tensors (the host-vs-native choice is made here, nowhere else) ----------------
    def _converted(self, handle: Handle, convert: Callable[[Any], Any]) -> Handle:
        handle._convert = convert
        return handle

    def allreduce_tensor_async(self, ops: Any, t: Any, op: str = "sum", name: str = "allreduce") -> Handle:
        """Reduce the flat framework tensor ``t``; waiting gives the reduced tensor (t itself on
        native backends and for CPU tensors whose host view is shared; reduce a copy if t must
        stay unchanged)."""
        kind = self.buffer_kind
        return self._converted(self.allreduce_async_(to_wire(kind, ops, t), op, name),
                               lambda buf: from_wire(kind, ops, buf, t))

    def allgather_tensor_async(self, ops: Any, t: Any, name: str = "allgather", equal: bool = False) -> Handle:
        """Allgather of the flat tensor ``t``; waiting gives (a tensor like t, per-rank counts).
        ``equal``: see :meth:`allgather_async`."""
        kind = self.buffer_kind
        return self._converted(self.allgather_async(to_wire(kind, ops, t), name, equal),
                               lambda r: (from_wire(kind, ops, r[0], t), r[1]))

    def broadcast_tensor_async(self, ops: Any, t: Any, root: int = 0, name: str = "broadcast") -> Handle:
        """Broadcast of the flat tensor ``t`` from ``root``; waiting gives root's values like t."""
        kind = self.buffer_kind
        return self._converted(self.broadcast_async_(to_wire(kind, ops, t), root, name),
                               lambda buf: from_wire(kind, ops, buf, t))

    def alltoall_async(self, buf: Any, counts: list[int], name: str = "alltoall") -> Handle:
        """Part j of the 1-D ``buf`` (``counts[j]`` elements) to rank j; result is (the parts
        received, in rank order, concatenated; their lengths)."""
        if len(counts) != self.size:
            raise ConfigError(f"alltoall '{name}': {len(counts)} split sizes for {self.size} ranks")
        isz = _nbytes(buf) // max(int(sum(counts)), 1)
        mine = counts[self.rank] * isz
        return self._submit("alltoall", name, self.backend.alltoall, (buf, list(counts), name),
                            lambda r: (_nbytes(buf) - mine, _nbytes(r[0]) - mine))

    def reducescatter_tensor_async(self, ops: Any, t: Any, counts: list[int], op: str = "sum",
                                   name: str = "reducescatter") -> Handle:
        """Reduce the flat tensor ``t`` with ``op``; waiting gives this rank's part (``counts[rank]``
        elements) as a tensor like t. Host backends only (native ones reduce and slice in the core)."""
        if op not in REDUCE_OPS:
            raise ConfigError(f"reduce op {op!r} unknown; use one of {REDUCE_OPS}")
        buf = to_wire(self.buffer_kind, ops, t)
        p, n = self.size, _nbytes(buf)
        h = self._submit("reducescatter", name, self.backend.reducescatter, (buf, list(counts), op, name),
                         lambda _r: ((p - 1) / p * n, (p - 1) / p * n))
        return self._converted(h, lambda part: from_wire(self.buffer_kind, ops, part, t))

    def alltoall_tensor_async(self, ops: Any, t: Any, counts: list[int], name: str = "alltoall") -> Handle:
        """:meth:`alltoall_async` of the flat framework tensor ``t``; waiting gives (a tensor like t, lengths)."""
        kind = self.buffer_kind
        return self._converted(self.alltoall_async(to_wire(kind, ops, t), counts, name),
                               lambda r: (from_wire(kind, ops, r[0], t), r[1]))

    def allgather_async(self, buf: Any, name: str = "allgather", equal: bool = False) -> Handle:
        """Concatenation of every rank's 1-D ``buf`` (sizes may differ); result is (array, counts).

        ``equal=True`` promises that every rank sends as many elements as this one (an exact
        top-k's k): the backend then skips the size exchange (docs/topk.md#equal-sizes)."""
        p = self.size
        n = _nbytes(buf)
        traffic = lambda r: ((p - 1) * n, _nbytes(r[0]) - n)  # noqa: E731
        if equal:  # one collective, so it can start here (docs/backends.md#direct-start)
            h = self._start_direct("allgather", name, self.backend.start_allgather_equal, (buf, name), traffic)
            if h is not None:
                return h
        fn = self.backend.allgather_equal if equal else self.backend.allgather
        return self._submit("allgather", name, fn, (buf, name), traffic)

    def allgather(self, buf: Any, name: str = "allgather") -> tuple[Any, list[int]]:
        return self.wait(self.allgather_async(buf, name))

    def broadcast_async_(self, buf: Any, root: int = 0, name: str = "broadcast") -> Handle:
        self.check_rank(root, "root")
        p, n, me = self.size, _nbytes(buf), self.rank
        return self._submit("broadcast", name, self.backend.broadcast_, (buf, root, name),
                            lambda _r: ((p - 1) * n if me == root else 0, 0 if me == root else n))

    def broadcast_(self, buf: Any, root: int = 0, name: str = "broadcast") -> Any:
        return self.wait(self.broadcast_async_(buf, root, name))

    def barrier_async(self, name: str = "barrier") -> Handle:
        return self._submit("barrier", name, self.backend.barrier, (name,), lambda _r: (0, 0))

    def barrier(self, name: str = "barrier") -> None:
        self.wait(self.barrier_async(name))

    def sendrecv_async(self, send: Any, dest: int, source: int, name: str = "sendrecv") -> Handle:
        """Point-to-point exchange (gTop-k's pairwise rounds). dest/source -1 = none."""
        if dest >= 0:
            self.check_rank(dest, "dest")
        if source >= 0:
            self.check_rank(source, "source")
        n = _nbytes(send) if dest >= 0 else 0
        return self._submit("sendrecv", name, self.backend.sendrecv, (send, dest, source, name),
                            lambda r: (n, 0 if r is None else _nbytes(r)))

    def sendrecv(self, send: Any, dest: int, source: int, name: str = "sendrecv") -> Any:
        return self.wait(self.sendrecv_async(send, dest, source, name))

    # -- multi-round operations on the progress thread ------------------------------------------
    def run_async(self, fn: Callable[[CountingLink, float], Any], name: str = "custom",
                  op: str = "custom") -> Handle:
        """Run ``fn(link, deadline)`` on the progress thread, in FIFO order with the collectives.

        For multi-round algorithms (gTop-k's recursive doubling) whose rounds depend on each
        other's results: run where the collectives run, they overlap the caller's computation
        (backward) instead of blocking it round by round, and they are ordered identically on
        every rank with everything else queued. ``link`` (a :class:`CountingLink`) offers the
        backend's blocking calls and counts their bytes; the handle's ``bytes_sent`` /
        ``bytes_received`` are the totals, and the result is fn's return value.

        Every rank must make matching calls inside fn (as with any collective); buffers follow
        ``buffer_kind`` (host NumPy arrays for "numpy" backends).
        """
        state: dict[str, CountingLink] = {}

        def call(deadline: float) -> Any:
            link = CountingLink(self.backend, name, deadline)
            state["link"] = link
            return fn(link, deadline)

        def traffic(_r: Any) -> tuple[float, float]:
            link = state.get("link")
            return (link.sent, link.received) if link is not None else (0, 0)

        return self._submit(op, name, call, (), traffic)

    # -- lifecycle ----------------------------------------------------------------------------
    def check_rank(self, r: int, what: str) -> None:
        """Refuse a rank argument (``what``: "root" for ``root_rank=``) outside [0, size)."""
        if isinstance(r, bool) or not isinstance(r, numbers.Integral):
            raise ConfigError(f"{what}_rank={r!r} must be an int rank in [0, {self.size}), e.g. {what}_rank=0")
        if not (0 <= r < self.size):
            raise ConfigError(f"{what}_rank={r} is out of range: the job has {self.size} rank(s), numbered 0 to "
                              f"{self.size - 1}; pass {what}_rank= one of them (usually 0)")

    @property
    def broken(self) -> BaseException | None:
        """The timeout that made this communicator unusable, if any."""
        return self._broken

    def shutdown(self) -> None:
        """Stop the progress thread after queued work; close the backend. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        if self._broken is None:
            self._thread.join(timeout=self.timeout_s)
        self.backend.close()
