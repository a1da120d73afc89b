"""Exchanges of pickled Python objects (set-up only: names, shapes, fingerprints), on host bytes.

A mixin of :class:`~hvd_commopt.comm.communicator.Communicator`: the objects travel as one
allgather of host bytes through the progress thread, in order with every other collective,
whatever the backend's buffer kind. A rank that has called ``join()`` answers with a
:class:`JoinedReply`, which only the join negotiation may receive (docs/horovod_api.md#join).
"""
from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import HvdCommoptError
from .base import Backend
from .handle import Handle, JoinedReply

__all__ = ["ObjectCollectives"]


class ObjectCollectives:
    """``allgather_object`` and ``broadcast_object`` over the communicator's queue."""

    if TYPE_CHECKING:  # provided by Communicator
        backend: Backend

        @property
        def rank(self) -> int: ...

        @property
        def size(self) -> int: ...

        def wait(self, handle: Handle) -> Any: ...

        def _submit(self, op: str, name: str, fn: Callable, args: tuple,
                    traffic: Callable[[Any], tuple[float, float]]) -> Handle: ...

        def check_rank(self, r: int, what: str) -> None: ...

    # -- Python objects (set-up only: pickled, host memory) ------------------------------------
    def allgather_object(self, obj: Any, name: str = "allgather_object") -> list[Any]:
        """Every rank's ``obj``, in rank order. Always on host bytes, whatever the backend."""
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        out, counts = self.wait(self._submit("allgather", name, self._host_allgather, (data, name),
                                             lambda r: ((self.size - 1) * data.nbytes, 0)))
        objs, off = [], 0
        for c in counts:
            objs.append(pickle.loads(out[off:off + c].tobytes()))
            off += c
        joined = [r for r, o in enumerate(objs) if isinstance(o, JoinedReply)]
        if joined and not isinstance(obj, JoinedReply) and name != JoinedReply.NEGOTIATION:
            raise HvdCommoptError(f"'{name}' (an exchange of Python objects) cannot run while rank(s) {joined} "
                                  f"have called join(): only allreduces and barriers can "
                                  f"(docs/horovod_api.md#join). Call it before join(), on every rank")
        return objs

    def broadcast_object(self, obj: Any, root: int = 0, name: str = "broadcast_object") -> Any:
        """root's ``obj`` on every rank."""
        self.check_rank(root, "root")
        return self.allgather_object(obj if self.rank == root else None, name)[root]

    def _host_allgather(self, data: np.ndarray, name: str, deadline: float):
        return self.backend.allgather_host(data, name, deadline)
