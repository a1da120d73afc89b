"""Host arrays over any link: a multi-round algorithm written on NumPy buffers (Ok-Topk's
split-and-reduce, docs/oktopk.md#backends) runs unchanged on a framework-native backend
(torch.distributed: Gloo, or Gloo's CPU side of a CUDA group).

Why an adapter rather than a second code path: the algorithm's per-step work is O(k) host work
(sorting, unique sums, histograms), so its buffers are host arrays whatever the backend; only the
transport differs. On a host backend the link is returned as it is; on a native one each buffer
crosses as a CPU framework tensor that shares the array's memory (no copy for torch), and the
result comes back as an array. Byte accounting stays the wrapped link's.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["host_link", "NativeHostLink"]


class NativeHostLink:
    """A native-buffer link that takes and returns NumPy arrays (see the module docstring)."""

    host = True
    buffer_kind = "numpy"

    def __init__(self, link: Any, ops: Any):
        self.link = link
        self.ops = ops

    @property
    def rank(self) -> int: return self.link.rank
    @property
    def size(self) -> int: return self.link.size

    def _wire(self, a: np.ndarray) -> Any:
        return self.ops.from_numpy(np.ascontiguousarray(a))  # a CPU tensor: Gloo's side of every group

    def _host(self, t: Any) -> np.ndarray:
        return np.asarray(self.ops.to_numpy(t))

    def sendrecv(self, send: np.ndarray, dest: int, source: int, name: str | None = None,
                 deadline: float | None = None) -> np.ndarray | None:
        r = self.link.sendrecv(self._wire(send), dest, source, name, deadline)
        return None if r is None else self._host(r)

    def allgather(self, buf: np.ndarray, name: str | None = None,
                  deadline: float | None = None) -> tuple[np.ndarray, list[int]]:
        out, counts = self.link.allgather(self._wire(buf), name, deadline)
        return self._host(out), counts

    def allreduce_(self, buf: np.ndarray, op: str = "sum", name: str | None = None,
                   deadline: float | None = None) -> np.ndarray:
        out = self._host(self.link.allreduce_(self._wire(buf), op, name, deadline))
        if out is not buf and not np.shares_memory(out, buf):
            np.copyto(buf, out)
        return buf


def host_link(link: Any, ops: Any) -> Any:
    """``link`` itself when it takes host arrays, else a :class:`NativeHostLink` over it."""
    return link if link.buffer_kind == "numpy" else NativeHostLink(link, ops)
