"""Process sets: collectives over a subset of the ranks (Horovod's ``ProcessSet``).

``add_process_set(ranks)`` is called by every rank with the same list (checked); members get a
communicator of the set, whose rank is the position in the sorted list. Its collectives run on
the parent communicator's progress thread, in the same FIFO as everything else. A backend with
native groups provides ``split(ranks)`` (torch.distributed's ``new_group``: Gloo, NCCL); on the
others (MPI, in-process) they are built from the backend's point-to-point ``sendrecv``
(:class:`SubsetBackend`): an allgather in P-1
shifted exchange steps, the allreduce as that allgather reduced locally in rank order (so every
member gets bit-identical results), a broadcast as root-to-each sends. That needs no MPI
communicator split (no collective call on the world per set) and works on any host-buffer
backend; the cost is O(P) messages per call, fine for the small sets Horovod users build
(docs/horovod_api.md#process-sets).

Roots are given as global ranks (Horovod's convention) and translated with :meth:`ProcessSet.local`.

The functions at the end (:func:`communicator_of`, :func:`root_in_set`, :func:`add_process_set`,
:func:`remove_process_set`, :func:`add_at_init`) are the process-set half of both adapters'
Horovod API, over the runtime's world communicator; the adapters only re-export them.
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

import numpy as np

from . import runtime
from .comm.base import Backend
from .comm.communicator import Communicator
from .dtypes import float32_to_half, half_to_float32
from .errors import ConfigError, RankMismatchError

__all__ = ["ProcessSet", "SubsetBackend", "ProcessSetRegistry", "global_process_set", "registry", "communicator_of",
           "root_in_set", "add_process_set", "remove_process_set", "add_at_init", "SplitsGroups"]


@runtime_checkable
class SplitsGroups(Protocol):
    """A backend with native sub-groups (torch.distributed): a process set runs on its own group
    instead of a :class:`SubsetBackend` over the world's."""

    def split(self, ranks: list[int]) -> Backend | None:
        """A backend over the sub-group ``ranks`` (world ranks; collective: every rank calls it);
        None on the ranks outside it."""
        ...

_REDUCE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


class SubsetBackend(Backend):
    """The collectives of ``ranks`` (global, sorted) over the parent backend's sendrecv."""

    def __init__(self, parent: Backend, ranks: list[int]):
        if parent.buffer_kind != "numpy":
            raise ConfigError(f"the {parent.name} backend takes native buffers: it must provide split(ranks) for "
                              f"process sets")
        self.parent, self.ranks = parent, list(ranks)
        self.name = f"{parent.name}[{','.join(map(str, ranks))}]"
        self._rank = self.ranks.index(parent.rank)

    @property
    def rank(self) -> int: return self._rank
    @property
    def size(self) -> int: return len(self.ranks)

    def _exchange(self, buf: np.ndarray, name: str, deadline: float) -> list[np.ndarray]:
        """Every member's 1-D buf, in set order (P-1 shifted sendrecv steps)."""
        p, r = self.size, self._rank
        parts: list[Any] = [None] * p
        parts[r] = np.array(buf, copy=True).reshape(-1)
        for k in range(1, p):
            dest, src = (r + k) % p, (r - k) % p
            parts[src] = self.parent.sendrecv(np.ascontiguousarray(buf).reshape(-1), self.ranks[dest],
                                              self.ranks[src], name, deadline)
        return parts

    def allreduce_(self, buf, op, name, deadline):
        parts = self._exchange(buf, name, deadline)
        bf16 = buf.dtype == np.uint16  # bfloat16 bit patterns (as in mpi.py / inproc.py)
        if bf16 or buf.dtype == np.float16:
            parts = [half_to_float32(x) if bf16 else x.astype(np.float32) for x in parts]
        acc = parts[0].copy()
        for x in parts[1:]:
            _REDUCE[op](acc, x, out=acc)
        flat = buf.reshape(-1)
        flat[...] = float32_to_half(acc, np.uint16) if bf16 else acc.astype(buf.dtype)
        return buf

    def allgather(self, buf, name, deadline):
        parts = self._exchange(buf, name, deadline)
        return np.concatenate(parts), [int(x.size) for x in parts]

    def broadcast_(self, buf, root, name, deadline):
        if self._rank == root:
            for j, g in enumerate(self.ranks):
                if j != root:
                    self.parent.sendrecv(np.ascontiguousarray(buf).reshape(-1), g, -1, name, deadline)
        else:
            got = self.parent.sendrecv(np.ascontiguousarray(buf).reshape(-1), -1, self.ranks[root], name, deadline)
            buf.reshape(-1)[...] = got
        return buf

    def barrier(self, name, deadline):
        self._exchange(np.zeros(0, dtype=np.uint8), name, deadline)

    def sendrecv(self, send, dest, source, name, deadline):
        return self.parent.sendrecv(send, self.ranks[dest] if dest >= 0 else -1,
                                    self.ranks[source] if source >= 0 else -1, name, deadline)


class _SetCommunicator(Communicator):
    """A Communicator whose calls run on the parent's progress thread (same FIFO, same timeouts)."""

    def __init__(self, parent: Communicator, backend: Backend):  # noqa: D107 - no own thread
        self.backend, self._parent = backend, parent
        self.timeout_s, self.traffic = parent.timeout_s, parent.traffic
        self._closed = False
        self.process_sets = None

    @property
    def _broken(self):
        return self._parent._broken

    def _submit(self, op, name, fn, args, traffic):
        return self._parent._submit(op, name, fn, args, traffic)

    def _start_direct(self, op, name, start, args, traffic):
        return None  # every call goes through the parent's FIFO (docs/backends.md#direct-start)

    def wait(self, handle):
        return self._parent.wait(handle)

    def shutdown(self) -> None:
        self._closed = True


class ProcessSet:
    """A set of global ranks. ``ProcessSet(None)`` (``global_process_set``) is every rank."""

    def __init__(self, ranks: Iterable[int] | None = None):
        self.ranks = None if ranks is None else sorted({int(r) for r in ranks})
        self.process_set_id: int | None = 0 if ranks is None else None
        self.communicator: Communicator | None = None

    def included(self) -> bool:
        """Whether this process is a member (of a registered set)."""
        return self.ranks is None or self.communicator is not None

    def size(self) -> int | None:
        return None if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (None when not a member)."""
        return self.communicator.rank if self.communicator is not None else None

    def local(self, global_rank: int) -> int:
        """The set rank of ``global_rank`` (a root given the Horovod way)."""
        if self.ranks is None:
            return global_rank
        if global_rank not in self.ranks:
            raise ConfigError(f"rank {global_rank} is not in process set {self.ranks}")
        return self.ranks.index(global_rank)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(None if self.ranks is None else tuple(self.ranks))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet(None)


class ProcessSetRegistry:
    """The process sets of one world communicator (the runtime keeps one per ``init()``)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.sets: dict[int, ProcessSet] = {}
        self._next_id = 1
        self._local: Communicator | None = None

    def add(self, ranks_or_set: Any) -> ProcessSet:
        """Register a set on every rank (collective: all ranks call it with the same ranks)."""
        ps = ranks_or_set if isinstance(ranks_or_set, ProcessSet) else ProcessSet(ranks_or_set)
        if ps.ranks is None:
            raise ConfigError("the global process set is always registered; add_process_set takes a list of ranks")
        bad = [r for r in ps.ranks if not 0 <= r < self.comm.size]
        if bad or not ps.ranks:
            raise ConfigError(f"process set ranks {ps.ranks} must be a non-empty subset of 0..{self.comm.size - 1}")
        seen = self.comm.allgather_object(ps.ranks, name="add_process_set")
        if any(s != ps.ranks for s in seen):
            raise RankMismatchError("add_process_set must be called with the same ranks on every rank; got "
                                    + "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen)))
        if any(s.ranks == ps.ranks for s in self.sets.values()):
            raise ConfigError(f"a process set with ranks {ps.ranks} is already registered")
        ps.process_set_id, self._next_id = self._next_id, self._next_id + 1
        backend = self.comm.backend
        if isinstance(backend, SplitsGroups):  # native groups (torch.distributed): every rank calls it
            sub = backend.split(ps.ranks)
        else:
            sub = SubsetBackend(self.comm.backend, ps.ranks) if self.comm.rank in ps.ranks else None
        if sub is not None:
            ps.communicator = _SetCommunicator(self.comm, sub)
        self.sets[ps.process_set_id] = ps
        return ps

    def remove(self, ps: ProcessSet) -> bool:
        """Unregister ``ps``; False when it was not registered (or is the global set)."""
        if ps.ranks is None or self.sets.get(ps.process_set_id) is not ps:
            return False
        self.comm.allgather_object(ps.ranks, name="remove_process_set")  # collective, like add
        del self.sets[ps.process_set_id]
        ps.process_set_id, ps.communicator = None, None
        return True

    def communicator_for(self, ps: ProcessSet | None) -> Communicator:
        """The communicator of ``ps`` on this rank; ConfigError when this rank is not a member."""
        if ps is None or ps.ranks is None:
            return self.comm
        if ps.process_set_id is None or self.sets.get(ps.process_set_id) is not ps:
            raise ConfigError(f"{ps!r} is not registered: call add_process_set({ps.ranks}) on every rank first")
        if ps.communicator is None:
            raise ConfigError(f"rank {self.comm.rank} is not in process set {ps.ranks}: only its members may "
                              f"call collectives on it")
        return ps.communicator

    def optimizer_communicator(self, ps: ProcessSet | None) -> Communicator:
        """For ``DistributedOptimizer(process_set=ps)``: the set's communicator on members; on
        the other ranks a size-1 communicator, so their optimizer steps locally (Horovod's
        behaviour: a non-member reduces nothing)."""
        if ps is None or ps.ranks is None or ps.communicator is not None:
            return self.communicator_for(ps)
        self.communicator_for(ps) if ps.process_set_id is None else None  # unregistered: the error
        if self._local is None:
            from .comm.inproc import InProcBackend, InProcWorld  # noqa: PLC0415
            self._local = Communicator(InProcBackend(InProcWorld(1), 0), self.comm.timeout_s)
        return self._local


def registry(comm: Communicator) -> ProcessSetRegistry:
    """The registry of ``comm``, kept on it (a new ``init()`` makes a new communicator, hence an
    empty registry; in-process ranks each have their own)."""
    if comm.process_sets is None:
        comm.process_sets = ProcessSetRegistry(comm)
    return comm.process_sets


def communicator_of(communicator: Communicator | None = None, process_set: ProcessSet | None = None) -> Communicator:
    """What an adapter's collective runs on: ``communicator`` if given, else the process set's
    on this rank (the world's by default, and for the global set)."""
    if communicator is not None:
        return communicator
    world = runtime.communicator()
    if process_set is None or process_set.ranks is None:
        return world
    return registry(world).communicator_for(process_set)


def root_in_set(root_rank: int, process_set: ProcessSet | None) -> int:
    """A root given as a global rank (Horovod's convention), as a rank of the process set."""
    return root_rank if process_set is None else process_set.local(root_rank)


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set (a list of global ranks, or a ProcessSet) on every rank; collective."""
    return registry(runtime.communicator()).add(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective); False when it was not registered."""
    return registry(runtime.communicator()).remove(process_set)


def add_at_init(process_sets: Any) -> None:
    """Horovod's ``init(process_sets=...)``: register each set (lists of ranks or ProcessSets) at
    once; ``"dynamic"`` (Horovod's switch) registers none, sets may always be added later here."""
    if process_sets == "dynamic":
        return
    for ps in process_sets or ():
        add_process_set(ps)
