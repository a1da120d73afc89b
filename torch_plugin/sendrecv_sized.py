"""The torch backend's ``sendrecv_sized``: a point-to-point exchange whose received length the
caller knows (a fixed capacity, e.g. gTop-k's k pairs per round on the device route), so no size
message goes first and no ``.item()`` reads it (docs/selection.md#device-route). A mixin of
:class:`~torch_plugin.comm.TorchDistBackend`, kept apart so that module stays under 400 lines."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .int16_wire import movable, restore
from .streams import on_collective_stream

__all__ = ["SizedSendrecv"]


class SizedSendrecv:
    """``Backend.sendrecv_sized`` over ``torch.distributed``'s batched isend/irecv."""

    _pg: Any
    _control: Any
    _global: Any
    _wait: Any

    @on_collective_stream  # CUDA: issued and waited for on the collective stream (docs/backends.md#cuda-streams)
    def sendrecv_sized(self, send, dest, source, count, name, deadline):
        send, dtype = movable(send)
        c = self._control
        if c is not None:
            c.enter("sendrecv", name)
        p2p, out = [], None
        if dest >= 0:
            p2p.append(dist.P2POp(dist.isend, send.reshape(-1).contiguous(), self._global(dest), group=self._pg))
        if source >= 0:
            out = torch.empty(int(count), dtype=send.dtype, device=send.device)
            p2p.append(dist.P2POp(dist.irecv, out, self._global(source), group=self._pg))
        for w in dist.batch_isend_irecv(p2p):
            self._wait(w, "sendrecv", name, deadline)
        if c is not None:
            c.leave()
        return restore(out, dtype)
