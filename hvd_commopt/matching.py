"""Horovod's negotiation by name: ranks may submit their tensor collectives in different orders.

Horovod's coordinator runs a collective once every rank has submitted one of that name, whatever
else each rank submitted before it (docs/horovod_api.md#negotiation). Here each communicator
keeps the negotiated calls (the Horovod-style tensor API, ``barrier``, ``allgather_object``)
submitted and not yet run, each keyed by its name and how many calls of that name wait before it
(so a call that failed on every rank leaves no gap, and unnamed calls made in the same order
match in that order). When the progress thread reaches one of
them it runs negotiation rounds, one object allgather each, in which every rank sends its whole
list; every rank then applies :func:`plan` to the same lists:

* the keys every active rank has are run, in the first active rank's order, each after the
  usual check of its metadata (:func:`~hvd_commopt.negotiate.verdict`: a shape, dtype, root or op
  that differs raises TensorMismatchError on every rank, from ``synchronize``);
* with nothing in common, the ranks wait (a round every millisecond) for the others' next
  submission; after ``MISMATCH_AFTER_S`` of that (the first active rank's clock decides, so every
  rank decides alike) the heads of the lists cannot be meant to match and fail with the usual
  "different collectives" error.

So ``rank 0: allreduce_async(name='x'); barrier()`` / ``rank 1: barrier(); allreduce_async(name='x')``
completes as in Horovod. The optimizer's own buckets are not negotiated (their order is fixed by
the model), so nothing here runs on the training step's path. A rank that called ``join()``
answers the rounds with a :class:`~hvd_commopt.comm.handle.JoinedReply` (docs/horovod_api.md#join).
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .comm.handle import JoinedReply
from .negotiate import NEGOTIATE_NAME, Request, TensorMismatchError, verdict

__all__ = ["Matcher", "matcher", "plan", "MISMATCH_AFTER_S"]

MISMATCH_AFTER_S = 2.0
_ROUND_PAUSE_S = 0.001

Key = tuple[str, int]


@dataclass(eq=False)
class Entry:
    """One submitted call: its key and request, and what to run once every rank has it."""

    req: Request
    run: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class Offer:
    """What one active rank sends in a round: its unmatched calls, and for how long it has waited."""

    waited_s: float
    calls: list[tuple[Key, Request]] = field(default_factory=list)


def plan(offers: list[Any]) -> tuple[str, list[Any]]:
    """("run", keys in order) / ("wait", []) / ("fail", each rank's head request). Pure: every rank
    gets the same answer from the same offers (JoinedReply entries are joined ranks)."""
    active = [o for o in offers if isinstance(o, Offer)]
    if not active:
        return "wait", []
    common = set.intersection(*({k for k, _ in o.calls} for o in active))
    if common:
        return "run", [k for k, _ in active[0].calls if k in common]
    if active[0].waited_s >= MISMATCH_AFTER_S and all(o.calls for o in active):
        return "fail", [o.calls[0][1] if isinstance(o, Offer) else o.request for o in offers]
    return "wait", []


class Matcher:
    """The unmatched negotiated calls of one communicator (see the module docstring)."""

    def __init__(self, comm: Any):
        self.comm = comm
        self._lock = threading.Lock()
        self._pending: list[Entry] = []
        self._since = time.monotonic()

    def submit(self, req: Request, run: Callable[[], Any]) -> Entry:
        with self._lock:
            entry = Entry(req, run)
            if not self._pending:
                self._since = time.monotonic()  # the wait for a match starts now
            self._pending.append(entry)
        return entry

    def run_until(self, entry: Entry) -> Any:
        """On the progress thread: rounds until ``entry`` ran; its result, or its error."""
        while not entry.done:
            self._round()
        if entry.error is not None:
            raise entry.error
        return entry.result

    def _round(self) -> None:
        with self._lock:
            keyed: dict[Key, Entry] = {}
            seen: dict[str, int] = {}
            for e in self._pending:
                n = seen[e.req.name] = seen.get(e.req.name, -1) + 1
                keyed[(e.req.name, n)] = e
            mine = Offer(time.monotonic() - self._since, [(k, e.req) for k, e in keyed.items()])
        offers = self.comm.allgather_object(mine, name=NEGOTIATE_NAME)
        what, items = plan(offers)
        if what == "wait":
            time.sleep(_ROUND_PAUSE_S)
            return
        if what == "fail":
            head = self._pending[0]
            heads = "; ".join(f"rank {r}: {q.describe()} '{q.name}'" for r, q in enumerate(items))
            why = verdict(items) or (
                f"ranks called different collectives: no call was submitted by every rank within {MISMATCH_AFTER_S:g} s "
                f"({heads}). Every rank must make the same calls (matched by name, as in Horovod)")
            self._finish(head, error=TensorMismatchError(why))
            return
        for key in items:
            reqs = [_request(o, key) for o in offers]
            entry = keyed[key]
            why = verdict(reqs)
            if why is not None:
                self._finish(entry, error=TensorMismatchError(why))
                continue
            try:
                self._finish(entry, result=entry.run())
            except Exception as e:  # noqa: BLE001 - raised where the caller waits
                self._finish(entry, error=e)

    def _finish(self, entry: Entry, result: Any = None, error: BaseException | None = None) -> None:
        entry.result, entry.error, entry.done = result, error, True
        with self._lock:
            self._pending.remove(entry)
            self._since = time.monotonic()


def _request(offer: Any, key: Key) -> Request:
    if isinstance(offer, JoinedReply):
        return offer.request
    return next(r for k, r in offer.calls if k == key)


_matchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_matchers_lock = threading.Lock()


def matcher(comm: Any) -> Matcher:
    """The communicator's Matcher (one per communicator, process sets included)."""
    with _matchers_lock:
        m = _matchers.get(comm)
        if m is None:
            m = _matchers[comm] = Matcher(comm)
        return m
