"""The MPI backend's failure notices and exit (docs/backends.md): a mixin of
:class:`~hvd_commopt.comm.mpi.MPIBackend`, kept apart so that module stays under 400 lines.

A rank dying of an uncaught exception sends every peer a "failed" notice and a rank that ends
its script a "left" notice, on the backend's status communicator; a waiting peer turns either
into a named error within a second instead of waiting out the collective timeout, and a rank
whose collectives can never complete aborts the MPI job at exit instead of hanging in
``MPI_Finalize``.
"""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

__all__ = ["MPIFailureNotices"]

_NOTICE = 13  # the status communicator's tag for notices (queries and replies: 11, 12)
# A peer that finished the collective this rank is in may leave before this rank's MPI call
# returns (one round trip later); only a call still blocked this long after the notice means
# the peer left without it.
_LEFT_CONFIRM_S = 1.0
# How long a failing rank waits before MPI_Abort, so that peers waiting for it can print which
# rank failed (they raise RankFailedError and abort the job themselves, usually well before).
_REPORT_S = 2.0


class MPIFailureNotices:
    """Failure and exit notices between the ranks of an :class:`~hvd_commopt.comm.mpi.MPIBackend`."""

    if TYPE_CHECKING:  # the backend's state (MPIBackend.__init__)
        MPI: Any
        _can_query: bool
        _size: int
        _rank: int
        _where: Any
        _last: Any
        _seq: int
        _notices: list
        _status: Any
        _failed_at: float | None
        _gone: dict
        _broken: bool
        _stop: Any
        _responder: Any

        def close(self) -> None: ...

    def _notify(self, kind: str, text: str = "") -> None:
        if not self._can_query or self._size == 1:
            return
        note = {"kind": kind, "text": text, "where": self._where, "last": self._last, "count": self._seq}
        for r in range(self._size):
            if r != self._rank:
                self._notices.append(self._status.isend(note, dest=r, tag=_NOTICE))

    def announce_failure(self, text: str) -> None:
        """Send every peer a "failed" notice carrying ``text`` (the exception, one line)."""
        if self._failed_at is None:
            self._failed_at = time.monotonic()
            self._notify("failed", text)

    def peer_failure(self) -> tuple[int, str] | None:
        """A peer that sent "failed", or one that "left" while this rank is (still) blocked in a
        collective, means the stream of collectives can never complete: (that rank, why)."""
        if not self._gone:
            return None
        where, now = self._where, time.monotonic()
        for r, (kind, note, heard) in sorted(self._gone.items()):
            at = note["where"] or note["last"]
            at = f"collective #{at[0]} {at[1]} '{at[2]}'" if at else "no collective"
            if kind == "failed":
                state = "in" if note["where"] else "after"
                detail = (f"rank {r} failed with {note['text']} ({state} {at}; its traceback is in its "
                          f"output). Fix that error; this rank stops waiting for it")
            elif where is not None and now - heard >= _LEFT_CONFIRM_S:
                detail = (f"rank {r} ended its script (after {note['count']} collectives, the last "
                          f"{at}) while this rank waits in collective #{where[0]} {where[1]} "
                          f"'{where[2]}'. Every rank must run the same collectives: give every rank "
                          f"the same number of steps (equal data shards, e.g. DistributedSampler "
                          f"with drop_last=True) and the same calls after training")
            else:
                continue
            self._broken = True
            return r, detail
        return None

    def abort_job(self, code: int) -> None:
        """MPI_Abort: mpirun then ends every rank. After a "failed" notice, first give the peers
        up to _REPORT_S to print which rank failed (the first of them to abort ends the wait)."""
        if self._failed_at is not None:
            time.sleep(max(0.0, _REPORT_S - (time.monotonic() - self._failed_at)))
        sys.stdout.flush()
        sys.stderr.flush()
        self.MPI.COMM_WORLD.Abort(code)

    def _at_exit(self) -> None:
        if self._broken:
            self._stop.set()
            sys.stderr.write(f"hvd_commopt: rank {self._rank}: aborting the MPI job: its collectives "
                             f"cannot complete (see the error above)\n")
            self.abort_job(1)
        self.close()
        # Not waiting here for the peers' "left" notices: MPI_Finalize waits for the peers anyway
        # (legitimately, e.g. while rank 0 saves a checkpoint), and a peer that waits for this
        # rank in a collective has been told and aborts the job, ending that wait too. Waiting in
        # Python instead also delayed this process's own teardown (measured +0.8 s per job end).
        self._stop.set()
        if self._responder is not None:
            self._responder.join(1.0)  # no MPI call of ours may overlap MPI_Finalize
        # Our notices are small (sent eagerly, complete at once); none may be pending at Finalize.
        # A peer's notice arriving after the responder stopped stays unreceived, which Finalize
        # tolerates (it is discarded with the communicator).
        end = time.monotonic() + 2.0
        while self._notices and not self.MPI.Request.Testall(self._notices) and time.monotonic() < end:
            time.sleep(0.01)
