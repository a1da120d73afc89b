"""Small CPU collectives of the Gloo backend carried over MPI (docs/backends.md#small-on-mpi).

Under an MPI launcher with ranks on several hosts the torch adapter's collectives run on Gloo,
which fills a link better than MPI's TCP transport (docs/backends.md#choice). For small
collectives the link is not what costs: on the emulated 10 Gbit/s link a per-layer exact top-k
(49 allgathers of 10-30 KB per step) reached 0.69-0.77x DDP's throughput on Gloo and 0.90-1.08x
on MPI in the same jobs (docs/backends.md#small-on-mpi). So a collective of at most
``limit_bytes`` per rank goes over MPI, which is already there as the control plane.

The rules, each for a reason:

* **Every rank picks the same transport for a collective.** The test depends only on what all
  ranks share: the op, the dtype and the bytes each rank sends, equal on every rank for a
  reduction and for an equal-size allgather. A general allgather first exchanges its sizes over
  MPI, and the largest decides.
* **Each transport keeps program order.** Lane collectives run only on the communicator's
  progress thread, as blocking MPI calls (the GIL is released inside them; Open MPI progresses a
  request only inside an MPI call, so a non-blocking start from a hook would not move during
  backward). The backend declines to start them on the calling thread, so they are queued, and
  Gloo's order rules stay as they are (docs/backends.md#direct-start).
* **Its own communicator**, a duplicate of ``COMM_WORLD``: the control plane's status messages
  and these collectives never match each other's messages. It needs MPI_THREAD_MULTIPLE (the
  control plane's responder thread calls MPI while the progress thread does); without it, or
  without a control plane, there is no lane.
* **Timeouts and failures** are the control plane's, as for Gloo's collectives: each lane call
  is marked there, so a wait that passes the deadline names the ranks that did not arrive, and a
  rank that failed or left is named within seconds; the MPI job is then aborted at exit (a
  blocked MPI call cannot be cancelled).
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["MPILane", "REDUCE_DTYPES"]

# dtypes MPI sums natively (halves have no MPI sum; they stay on Gloo)
REDUCE_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8)


def _host(t: torch.Tensor) -> np.ndarray:
    """The NumPy view of a contiguous CPU tensor's bytes (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


class MPILane:
    """Blocking MPI collectives on CPU tensors of at most ``limit_bytes`` per rank.

    Use :meth:`open`, which gives None where no lane can be had."""

    def __init__(self, control, limit_bytes: int):
        self.MPI = control.MPI
        self._limit = int(limit_bytes)
        self._comm = self.MPI.COMM_WORLD.Dup()  # collective: every rank opens its lane at init
        self._ops = {"sum": self.MPI.SUM, "min": self.MPI.MIN, "max": self.MPI.MAX, "prod": self.MPI.PROD}
        self.calls = 0  # collectives carried, for tests and benchmarks

    @classmethod
    def open(cls, control, limit_bytes: int) -> "MPILane | None":
        """A lane beside ``control`` (the MPI control plane, or None), or None: no control
        plane, ``limit_bytes`` 0, one rank, or an MPI without MPI_THREAD_MULTIPLE."""
        if control is None or limit_bytes <= 0 or control.size == 1:
            return None
        if control.MPI.Query_thread() < control.MPI.THREAD_MULTIPLE:
            return None
        return cls(control, limit_bytes)

    @property
    def limit_bytes(self) -> int:
        """The largest collective (bytes each rank sends) the lane carries; fixed when it opens."""
        return self._limit

    # -- the rule ------------------------------------------------------------------------------
    def takes_reduce(self, buf: torch.Tensor, op: str) -> bool:
        """Whether this reduction goes over the lane (the same answer on every rank)."""
        return (buf.device.type == "cpu" and buf.dtype in REDUCE_DTYPES and op in self._ops
                and buf.is_contiguous() and buf.numel() * buf.element_size() <= self._limit)

    def takes_gather(self, buf: torch.Tensor) -> bool:
        """Whether an allgather whose every rank sends ``buf``'s size goes over the lane."""
        return buf.device.type == "cpu" and buf.numel() * buf.element_size() <= self._limit

    # -- collectives (progress thread only) ----------------------------------------------------
    def allreduce_(self, buf: torch.Tensor, op: str) -> torch.Tensor:
        self.calls += 1
        arr = buf.detach().reshape(-1).numpy()
        self._comm.Allreduce(self.MPI.IN_PLACE, arr, self._ops[op])
        return buf

    def allgather_equal(self, buf: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Every rank's ``buf`` (as many elements on each), concatenated in rank order."""
        self.calls += 1
        wire = buf.reshape(-1).contiguous()
        p = self._comm.Get_size()
        out = torch.empty(p * wire.numel(), dtype=wire.dtype)
        self._comm.Allgather(_host(wire), _host(out))  # as bytes: any dtype, bfloat16 included
        return out, [wire.numel()] * p

    def counts(self, n: int) -> list[int]:
        """Every rank's element count ``n``, in rank order (the size exchange of an allgather)."""
        self.calls += 1
        got = np.empty(self._comm.Get_size(), dtype=np.int64)
        self._comm.Allgather(np.array([n], dtype=np.int64), got)
        return got.tolist()

    def takes_sizes(self, counts: list[int], itemsize: int) -> bool:
        """Whether an allgather of these per-rank ``counts`` goes over the lane (decided by the
        largest, which every rank knows alike)."""
        return max(counts) * itemsize <= self._limit

    def allgatherv(self, buf: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's ``buf`` (``counts[r]`` elements from rank r), concatenated in rank order."""
        self.calls += 1
        wire = buf.reshape(-1).contiguous()
        isz = wire.element_size()
        out = torch.empty(int(sum(counts)), dtype=wire.dtype)
        sizes = [c * isz for c in counts]
        self._comm.Allgatherv(_host(wire), [_host(out), sizes])
        return out
