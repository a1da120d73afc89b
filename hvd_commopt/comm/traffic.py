"""What crosses the wire and how much of it: the host-vs-native buffer choice and the byte counts.

:func:`to_wire` / :func:`from_wire` are the one place where a framework tensor becomes a backend's
buffer and back. :class:`TrafficCounter` and :class:`CountingLink` count bytes from the algorithm
each collective uses (documented per collective), not from the wire.
"""
from __future__ import annotations

import threading
from typing import Any

from .base import Backend

__all__ = ["CountingLink", "TrafficCounter", "from_wire", "nbytes", "to_wire"]


def to_wire(buffer_kind: str, ops: Any, t: Any) -> Any:
    """The buffer a backend takes for framework tensor ``t``: a host array for host backends
    (a zero-copy view of a contiguous CPU tensor where the framework allows), else t itself.
    The one place where the host-vs-native choice is made."""
    return ops.to_numpy(t) if buffer_kind == "numpy" else t


def from_wire(buffer_kind: str, ops: Any, buf: Any, like: Any) -> Any:
    """The framework tensor for a backend's buffer (placed like ``like``); inverse of :func:`to_wire`."""
    return ops.from_numpy(buf, like=like) if buffer_kind == "numpy" else buf


class TrafficCounter:
    """Bytes this rank sent and received, and seconds spent in collectives, since the last reset.

    Bytes are counted from the algorithm each backend uses (documented per collective below),
    not sniffed from the wire: ring allreduce sends 2(P-1)/P of the buffer, allgather sends the
    local part to each of P-1 peers, broadcast sends n·(P-1) from the root (flat tree bound).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.bytes_sent = 0
            self.bytes_received = 0
            self.collectives = 0
            self.comm_seconds = 0.0

    def add(self, sent: float, received: float, seconds: float) -> None:
        with self._lock:
            self.bytes_sent += int(sent)
            self.bytes_received += int(received)
            self.collectives += 1
            self.comm_seconds += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                    "collectives": self.collectives, "comm_seconds": self.comm_seconds}


def nbytes(buf: Any) -> int:
    """A host array's or a torch tensor's size in bytes."""
    nb = getattr(buf, "nbytes", None)
    if nb is not None:
        return int(nb)
    return int(buf.numel() * buf.element_size())  # torch tensors


class CountingLink:
    """The backend as seen by a function run with :meth:`Communicator.run_async`.

    Same blocking methods as :class:`Backend` (``sendrecv``, ``allgather``, ``allreduce_``,
    ``broadcast_``; ``name`` and ``deadline`` optional) and its ``rank``/``size``/``buffer_kind``.
    Every call adds its bytes to ``sent``/``received`` with the formulas the communicator's own
    collectives use (see :class:`TrafficCounter`), so a multi-round algorithm's handle reports
    its traffic without the algorithm counting by hand.
    """

    def __init__(self, backend: Backend, name: str, deadline: float):
        self.backend = backend
        self.name = name
        self.deadline = deadline
        self.sent = 0
        self.received = 0

    @property
    def rank(self) -> int: return self.backend.rank
    @property
    def size(self) -> int: return self.backend.size
    @property
    def buffer_kind(self) -> str: return self.backend.buffer_kind

    @property
    def host(self) -> bool:
        """True when the backend takes host (NumPy) buffers: an algorithm may then pack several
        parts into one message instead of sending them one by one."""
        return self.backend.buffer_kind == "numpy"

    def allgather_tensor(self, ops: Any, t: Any, name: str | None = None) -> tuple[Any, list[int]]:
        """:meth:`allgather` of a framework tensor; returns (a tensor like t, per-rank counts)."""
        out, counts = self.allgather(to_wire(self.buffer_kind, ops, t), name)
        return from_wire(self.buffer_kind, ops, out, t), counts

    def _count(self, sent: float, received: float) -> None:
        self.sent += int(sent)
        self.received += int(received)

    def sendrecv(self, send: Any, dest: int, source: int, name: str | None = None,
                 deadline: float | None = None) -> Any:
        r = self.backend.sendrecv(send, dest, source, name or self.name, deadline or self.deadline)
        self._count(nbytes(send) if dest >= 0 else 0, 0 if r is None else nbytes(r))
        return r

    def sendrecv_sized(self, send: Any, dest: int, source: int, count: int) -> Any:
        r = self.backend.sendrecv_sized(send, dest, source, count, self.name, self.deadline)
        self._count(nbytes(send) if dest >= 0 else 0, 0 if r is None else nbytes(r))
        return r

    def allgather(self, buf: Any, name: str | None = None, deadline: float | None = None) -> tuple[Any, list[int]]:
        out = self.backend.allgather(buf, name or self.name, deadline or self.deadline)
        n = nbytes(buf)
        self._count((self.size - 1) * n, nbytes(out[0]) - n)
        return out

    def allgather_equal(self, buf: Any, name: str | None = None, deadline: float | None = None) -> tuple[Any, list[int]]:
        out = self.backend.allgather_equal(buf, name or self.name, deadline or self.deadline)
        self._count((self.size - 1) * nbytes(buf), (self.size - 1) * nbytes(buf))
        return out

    def allreduce_(self, buf: Any, op: str = "sum", name: str | None = None, deadline: float | None = None) -> Any:
        out = self.backend.allreduce_(buf, op, name or self.name, deadline or self.deadline)
        p, n = self.size, nbytes(buf)
        self._count(2 * (p - 1) / p * n, 2 * (p - 1) / p * n)
        return out

    def broadcast_(self, buf: Any, root: int = 0, name: str | None = None, deadline: float | None = None) -> Any:
        out = self.backend.broadcast_(buf, root, name or self.name, deadline or self.deadline)
        p, n = self.size, nbytes(buf)
        self._count((p - 1) * n if self.rank == root else 0, 0 if self.rank == root else n)
        return out
