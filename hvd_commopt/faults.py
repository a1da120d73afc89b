"""One rank's uncaught exception ends the whole job within seconds, with its traceback shown.

Without this, the raising rank prints its traceback and then sits in its exit handlers (the
runtime's shutdown, then ``MPI_Finalize``, which waits for every rank) while the other ranks
wait for it in a collective until the collective timeout (300 s by default), and the error they
finally print blames a rank that "did not answer" instead of the exception.

:func:`install` (called by ``init()`` when there is more than one rank) chains a
``sys.excepthook`` that, after the usual traceback:

1. tells the peers which exception this rank died of (:meth:`Backend.announce_failure`; the MPI
   backend sends a notice on its status communicator). A peer waiting in a collective raises
   :class:`~hvd_commopt.errors.RankFailedError` naming this rank and the exception, at once
   rather than at its timeout, and ends the job itself through this same hook;
2. ends the job (:meth:`Backend.abort_job`: ``MPI_Abort`` for MPI, which makes ``mpirun`` kill
   every rank; ``os._exit`` otherwise, which ``mpirun`` and ``torchrun`` treat as a failed rank)
   with exit code 1, skipping the exit handlers that would wait for the peers.

Why an excepthook and not ``atexit``: by the time exit handlers run, the exception is gone
(they cannot tell a crash from a normal end) and other handlers registered later (the
backend's, the framework's) run first and may block. The hook runs first, knows the exception,
and only for an exception that nothing caught. A rank that ends its script normally while peers
still wait for it is handled at exit instead (the MPI backend's "left" notice), as is a script
that replaced ``sys.excepthook`` after ``init()``. Exceptions in other threads do not end a
process, so ``threading.excepthook`` is left alone.

A hook installed after ``init()`` that calls ours may hold ``sys.stderr`` pointed at a buffer
while it does, to print the buffer after ours returns: ``torch.distributed.init_process_group``
installs one that prefixes each line with the rank. Ours never returns, so before it ends the job
it prints what such a buffer holds (the traceback) to the process's real stderr; without that the
job ended with nothing but ``MPI_ABORT was invoked`` (docs/usage.md#captured-stderr).
"""
from __future__ import annotations

import io
import sys
import time
from typing import Any, Callable

from .errors import RankFailedError

__all__ = ["install"]

# A rank that stops because another failed waits this long before ending the job, so that every
# such rank gets to print which rank failed (the first to abort kills the rest): with per-rank
# log files, each log then says why that rank died.
_SIBLINGS_S = 0.5

_previous: Callable[..., Any] | None = None
_get_comm: Callable[[], Any] = lambda: None  # noqa: E731


def install(get_comm: Callable[[], Any]) -> None:
    """Replace ``sys.excepthook`` (once) by a hook that calls the current one (the traceback as
    usual, or a custom hook's output), then ends the job."""
    global _previous, _get_comm
    _get_comm = get_comm
    if sys.excepthook is not _excepthook:
        _previous = sys.excepthook
        sys.excepthook = _excepthook


def _excepthook(exc_type, exc, tb) -> None:
    try:
        (_previous or sys.__excepthook__)(exc_type, exc, tb)
    finally:
        comm = _get_comm()
        if comm is not None and comm.size > 1:
            _end_job(comm, exc_type, exc)


def _real_stderr():
    """Where to write: ``sys.stderr``, unless an outer hook pointed it at an in-memory buffer; then
    the process's stderr, after printing there what the buffer holds (module docstring). A
    stderr the script redirected to a file or a logger is kept."""
    err, real = sys.stderr, sys.__stderr__
    if real is None or err is real or not isinstance(err, io.StringIO):
        return err
    real.write(err.getvalue())
    err.seek(0)
    err.truncate()
    return real


def _end_job(comm, exc_type, exc) -> None:
    backend = comm.backend
    out = _real_stderr()
    out.write(f"hvd_commopt: rank {comm.rank}: uncaught {exc_type.__name__}; ending the job "
              f"on all {comm.size} ranks\n")
    out.flush()
    if isinstance(exc, RankFailedError):  # the failed rank has told everyone already
        time.sleep(_SIBLINGS_S)
    else:
        text = " ".join(f"{exc_type.__name__}: {exc}".split())
        try:
            backend.announce_failure(text[:2000])
        except Exception:  # noqa: BLE001 - ending the job matters more than the notice
            pass
    backend.abort_job(1)
