"""Backend: how bytes move. One small blocking interface; asynchrony is added once, above it.

A backend's methods are called from exactly one thread, the communicator's progress thread
(:mod:`hvd_commopt.comm.communicator`), in the same order on every rank. That gives MPI the
ordering it needs without a negotiation round per step (Horovod's coordinator) and lets a
backend be written as plain blocking code.

Every method takes ``deadline`` (``time.monotonic()`` seconds). A backend that can stop waiting
raises :class:`~hvd_commopt.errors.CollectiveTimeoutError` when it passes, naming the ranks that
did not arrive (the in-process backend). A backend whose fastest calls are blocking (MPI) may
ignore it: the waiting thread times out instead and asks :meth:`Backend.diagnose` who is missing.
Either way nothing blocks forever.

Buffers are whatever ``buffer_kind`` says: ``"numpy"`` for host arrays (MPI, in-process), or
``"native"`` for framework tensors (torch.distributed). Reductions are in place.
"""
from __future__ import annotations

import abc
import os
import sys
from typing import Any, Callable

# what a direct start returns: a poll that says whether the collective completed, and the call
# that finishes it (its result, or its error)
DirectStart = tuple[Callable[[], bool], Callable[[], Any]]

__all__ = ["Backend", "REDUCE_OPS"]

REDUCE_OPS = ("sum", "min", "max", "prod")


class Backend(abc.ABC):
    """The blocking transport under a :class:`~hvd_commopt.comm.communicator.Communicator`."""

    name: str = "abstract"
    buffer_kind: str = "numpy"  # or "native"
    enforces_deadline: bool = True  # False: blocking calls; the waiter times out and diagnoses

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @property
    def local_rank(self) -> int:
        return self.rank

    @property
    def local_size(self) -> int:
        return self.size

    @abc.abstractmethod
    def allreduce_(self, buf: Any, op: str, name: str, deadline: float) -> Any:
        """Reduce ``buf`` across ranks in place with ``op`` (one of REDUCE_OPS); return buf."""

    @abc.abstractmethod
    def allgather(self, buf: Any, name: str, deadline: float) -> tuple[Any, list[int]]:
        """Concatenate every rank's 1-D ``buf`` (sizes may differ) in rank order.

        Returns (the concatenation, the per-rank element counts).
        """

    def allgather_equal(self, buf: Any, name: str, deadline: float) -> tuple[Any, list[int]]:
        """:meth:`allgather` where the caller guarantees that every rank sends ``buf``'s number of
        elements (an exact top-k's k, fixed by the bucket and the step): a backend may then skip
        exchanging the sizes, one collective instead of two (docs/topk.md#equal-sizes).

        Default: the general allgather, which needs no promise."""
        return self.allgather(buf, name, deadline)

    @abc.abstractmethod
    def broadcast_(self, buf: Any, root: int, name: str, deadline: float) -> Any:
        """Overwrite ``buf`` with root's ``buf``; return buf."""

    @abc.abstractmethod
    def barrier(self, name: str, deadline: float) -> None: ...

    @abc.abstractmethod
    def sendrecv(self, send: Any, dest: int, source: int, name: str, deadline: float) -> Any:
        """Send 1-D ``send`` to ``dest`` while receiving a 1-D array of the same dtype (any length)
        from ``source``. ``dest`` or ``source`` may be -1 to only receive or only send (then the
        result is None when nothing is received)."""

    def sendrecv_sized(self, send: Any, dest: int, source: int, count: int, name: str, deadline: float) -> Any:
        """:meth:`sendrecv` where the caller knows the received length, ``count`` elements (a fixed
        capacity): a backend may skip sending the size first (torch: no ``.item()`` of it on a
        device, docs/selection.md#device-route). Default: :meth:`sendrecv`."""
        return self.sendrecv(send, dest, source, name, deadline)

    def reducescatter(self, buf: Any, counts: list[int], op: str, name: str, deadline: float) -> Any:
        """Reduce the 1-D ``buf`` across ranks with ``op`` and return this rank's part (``counts[r]``
        elements after the first ``sum(counts[:r])``), a new buffer. Default: the allreduce and
        the slice (twice a dedicated reduce-scatter's traffic); MPI overrides it."""
        off = sum(counts[:self.rank])
        return self.allreduce_(buf, op, name, deadline)[off:off + counts[self.rank]].copy()

    def alltoall(self, buf: Any, counts: list[int], name: str, deadline: float) -> tuple[Any, list[int]]:
        """Send ``buf[sum(counts[:j]):][:counts[j]]`` to rank j and receive rank j's part for
        this rank; returns (the received parts concatenated in rank order, their lengths).

        Default: P-1 shifted pairwise ``sendrecv`` steps (step k sends to rank+k and receives
        from rank-k, so no two ranks wait on each other in a cycle). Backends with a native
        all-to-all override it."""
        import numpy as np  # noqa: PLC0415 - host buffers only in the default

        if self.buffer_kind != "numpy":
            raise NotImplementedError(f"the {self.name} backend has no alltoall; use the MPI backend")
        p, r = self.size, self.rank
        offs = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        parts: list[Any] = [None] * p
        parts[r] = buf[offs[r]:offs[r + 1]]
        for k in range(1, p):
            dest, src = (r + k) % p, (r - k) % p
            parts[src] = self.sendrecv(np.ascontiguousarray(buf[offs[dest]:offs[dest + 1]]), dest, src, name, deadline)
        return np.concatenate(parts), [int(x.size) for x in parts]

    # Direct starts (docs/backends.md#direct-start): a backend that can start a collective on the
    # calling thread says so with ``starts_on_caller`` and returns (is_completed, finish) from the
    # two methods below (or None for a call it cannot start so); by default every collective goes
    # to the communicator's progress thread.
    starts_on_caller = False

    def start_allreduce(self, buf: Any, op: str, name: str, deadline: float) -> DirectStart | None:
        """Start ``allreduce_`` now, on this thread: (is_completed, finish), or None."""
        return None

    def start_allgather_equal(self, buf: Any, name: str, deadline: float) -> DirectStart | None:
        """Start ``allgather_equal`` now, on this thread: (is_completed, finish), or None."""
        return None

    def allgather_host(self, data: Any, name: str, deadline: float) -> tuple[Any, list[int]]:
        """:meth:`allgather` of host bytes (pickled objects). Default: the allgather itself (host
        buffers); native backends override it."""
        return self.allgather(data, name, deadline)

    # join() with a backend-level follower (docs/horovod_api.md#join): a backend that can see the
    # collective its peers are in says so with ``follows_joined`` and implements follow_joined.
    follows_joined = False

    def follow_joined(self, reply: bytes, deadline: float) -> int:
        """After ``join()``: take part, with zeros (``reply`` in object exchanges), in every
        collective the other ranks run until every rank has joined; return the rank that joined
        last (the same on every rank)."""
        raise NotImplementedError(f"the {self.name} backend cannot follow its peers' collectives")

    def stalled(self, waited_s: float) -> tuple[list[int], str] | None:
        """Asked by a thread that has waited ``waited_s`` for a collective: (ranks, explanation)
        once every rank is known to wait in a collective that not all of them are in (a step or
        call that only some ranks make), so that the wait can end in seconds instead of at its
        timeout; None otherwise (the default: no side channel to see the peers)."""
        return None

    def diagnose(self) -> tuple[list[int] | None, str]:
        """After a wait timed out: (ranks known not to have arrived or None, an explanation)."""
        return None, f"the {self.name} backend cannot tell which ranks are missing"

    def peer_failure(self) -> tuple[int, str] | None:
        """(rank, explanation) once a peer is known to have failed or left while this rank still
        needs it, so that a wait can stop before its timeout; None while nothing is known.
        Backends without a side channel to hear it from return None (the timeout still applies)."""
        return None

    def announce_failure(self, text: str) -> None:
        """Tell the peers that this rank is failing with ``text`` (no-op without a side channel)."""

    def abort_job(self, code: int) -> None:
        """End this process now so that the launcher ends the job: skip the exit handlers, which
        would wait for peers (or in MPI_Finalize) that are themselves waiting for this rank."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def close(self) -> None:
        """Release resources. Idempotent."""
