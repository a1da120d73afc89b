"""In-process backend: N ranks as threads of one process, for fast unit tests.

Collectives rendezvous in a shared :class:`InProcWorld`. Each rank numbers its collectives; the
n-th collective of every rank meets in slot n, so a rank that skips one is detected exactly:
the timeout names it. Reductions sum contributions in rank order, so every rank gets the
bit-identical result (like MPI's allreduce).

Example::

    world = InProcWorld(4)
    def body(comm): ...
    results = run_ranks(world, body)   # body(comm) on 4 threads, returns their results
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

from ..dtypes import float32_to_half, half_to_float32
from ..errors import CollectiveTimeoutError, RankMismatchError
from .base import Backend

__all__ = ["InProcWorld", "InProcBackend", "run_ranks"]

_REDUCE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


class InProcWorld:
    """Shared rendezvous state of ``size`` in-process ranks."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"world size must be >= 1, got {size}")
        self.size = size
        self._cv = threading.Condition()
        self._slots: dict[int, dict] = {}
        self._mail: dict[tuple[int, int, int], np.ndarray] = {}

    def rendezvous(self, seq: int, rank: int, kind: str, name: str, payload: Any, deadline: float) -> list[Any]:
        """Deposit payload in slot seq; return all ranks' payloads once everyone arrived."""
        with self._cv:
            slot = self._slots.setdefault(seq, {"payloads": {}, "kinds": {}, "read": 0})
            slot["payloads"][rank] = payload
            slot["kinds"][rank] = (kind, name)
            self._cv.notify_all()
            while len(slot["payloads"]) < self.size:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cv.wait(left):
                    if len(slot["payloads"]) == self.size:
                        break
                    missing = sorted(set(range(self.size)) - set(slot["payloads"]))
                    raise CollectiveTimeoutError(
                        f"{kind} '{name}' (collective #{seq}) timed out on rank {rank}: rank(s) "
                        f"{missing} did not arrive. A rank skipped a step or stopped early.",
                        op=kind, name=name, missing_ranks=missing)
            kinds = set(slot["kinds"].values())
            if len(kinds) > 1:
                raise RankMismatchError(f"collective #{seq}: ranks called different collectives: "
                                        f"{dict(sorted(slot['kinds'].items()))}")
            out = [slot["payloads"][r] for r in range(self.size)]
            slot["read"] += 1
            if slot["read"] == self.size:
                del self._slots[seq]
            return out

    def post(self, src: int, dst: int, seq: int, data: np.ndarray) -> None:
        with self._cv:
            self._mail[(src, dst, seq)] = data
            self._cv.notify_all()

    def fetch(self, src: int, dst: int, seq: int, name: str, deadline: float) -> np.ndarray:
        with self._cv:
            while (src, dst, seq) not in self._mail:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cv.wait(left):
                    if (src, dst, seq) in self._mail:
                        break
                    raise CollectiveTimeoutError(
                        f"sendrecv '{name}': rank {dst} waited for rank {src}, which did not send",
                        op="sendrecv", name=name, missing_ranks=[src])
            return self._mail.pop((src, dst, seq))


class InProcBackend(Backend):
    name = "inproc"
    buffer_kind = "numpy"

    def __init__(self, world: InProcWorld, rank: int):
        self.world = world
        self._rank = rank
        self._seq = 0
        self._p2p_seq: dict[tuple[int, int], int] = {}

    @property
    def rank(self) -> int: return self._rank
    @property
    def size(self) -> int: return self.world.size

    def _meet(self, kind: str, name: str, payload: Any, deadline: float) -> list[Any]:
        seq = self._seq
        self._seq += 1
        return self.world.rendezvous(seq, self._rank, kind, name, payload, deadline)

    def allreduce_(self, buf, op, name, deadline):
        parts = self._meet("allreduce", name, np.array(buf, copy=True), deadline)
        if buf.dtype == np.uint16:  # bfloat16 bit patterns: reduce as float32, round back (as mpi.py)
            parts = [half_to_float32(p) for p in parts]
        acc = parts[0].copy()
        for p in parts[1:]:
            _REDUCE[op](acc, p, out=acc)
        buf[...] = acc if buf.dtype != np.uint16 else float32_to_half(acc, np.uint16)
        return buf

    def allgather(self, buf, name, deadline):
        return self._gather(buf, name, deadline)

    def allgather_equal(self, buf, name, deadline):
        out, counts = self._gather(buf, name, deadline)
        if len(set(counts)) > 1:  # the in-process world can check the caller's promise
            raise RankMismatchError(f"allgather '{name}' was promised equal sizes but the ranks sent "
                                    f"{counts} elements: the selection's k differs across ranks (same "
                                    f"model, density and step everywhere?)")
        return out, counts

    def _gather(self, buf, name, deadline):
        parts = self._meet("allgather", name, np.array(buf, copy=True).reshape(-1), deadline)
        return np.concatenate(parts), [int(p.size) for p in parts]

    def broadcast_(self, buf, root, name, deadline):
        parts = self._meet("broadcast", name, np.array(buf, copy=True) if self._rank == root else None, deadline)
        buf[...] = parts[root]
        return buf

    def barrier(self, name, deadline):
        self._meet("barrier", name, None, deadline)

    def sendrecv(self, send, dest, source, name, deadline):
        if dest >= 0:
            k = (self._rank, dest)
            s = self._p2p_seq.get(k, 0)
            self._p2p_seq[k] = s + 1
            self.world.post(self._rank, dest, s, np.array(send, copy=True).reshape(-1))
        if source < 0:
            return None
        k = (source, self._rank)
        s = self._p2p_seq.get(k, 0)
        self._p2p_seq[k] = s + 1
        return self.world.fetch(source, self._rank, s, name, deadline)


def run_ranks(size_or_world: int | InProcWorld, body: Callable[..., Any], *args: Any,
              timeout_s: float = 60.0) -> list[Any]:
    """Run ``body(communicator, *args)`` on ``size`` thread-ranks; return results in rank order.

    The first exception raised by any rank is re-raised here (after all threads finished).
    """
    from .communicator import Communicator

    world = size_or_world if isinstance(size_or_world, InProcWorld) else InProcWorld(size_or_world)
    results: list[Any] = [None] * world.size
    errors: list[BaseException | None] = [None] * world.size

    def target(r: int) -> None:
        comm = Communicator(InProcBackend(world, r), timeout_s=timeout_s)
        try:
            results[r] = body(comm, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e
        finally:
            comm.shutdown()

    threads = [threading.Thread(target=target, args=(r,), name=f"inproc-rank-{r}") for r in range(world.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results
