"""The torch backend's point-to-point exchanges: ``sendrecv`` (the size sent first) and
``sendrecv_sized``, whose received length the caller knows (a fixed capacity, e.g. gTop-k's k
pairs per round on the device route), so no size message goes first and no ``.item()`` reads it
(docs/selection.md#device-route). CUDA tensors on Gloo go through pinned host memory
(:mod:`.staged_collectives`, docs/backends.md#cuda-on-gloo). A mixin of
:class:`~torch_plugin.comm.TorchDistBackend`, kept apart so that module stays under 400 lines."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .int16_wire import movable, restore
from .staged_collectives import takes as staged
from .streams import on_collective_stream

__all__ = ["SizedSendrecv"]


class SizedSendrecv:
    """``Backend.sendrecv`` and ``Backend.sendrecv_sized`` over ``torch.distributed``'s batched
    isend/irecv."""

    _pg: Any
    _control: Any
    _global: Any
    _wait: Any
    name: str
    _staged_sendrecv: Any

    @on_collective_stream  # CUDA: issued and waited for on the collective stream (docs/backends.md#cuda-streams)
    def sendrecv(self, send, dest, source, name, deadline):
        return self._marked(send, dest, source, None, name, deadline)

    @on_collective_stream  # CUDA: issued and waited for on the collective stream (docs/backends.md#cuda-streams)
    def sendrecv_sized(self, send, dest, source, count, name, deadline):
        return self._marked(send, dest, source, int(count), name, deadline)

    def _marked(self, send, dest, source, count, name, deadline):
        """Either exchange, marked on the control plane; ``count`` None: the size is sent first."""
        send, dtype = movable(send)
        c = self._control
        if c is not None:
            c.enter("sendrecv", name)
        if staged(self.name, send):  # pinned host staging (docs/backends.md#cuda-on-gloo)
            out = self._staged_sendrecv(send, dest, source, count, name, deadline)
        else:
            out = self._exchange(send.reshape(-1).contiguous(), self._global(dest), self._global(source), count,
                                 name, deadline)
        if c is not None:
            c.leave()
        return restore(out, dtype)

    def _exchange(self, send, dest, source, count, name, deadline):
        """One batched isend/irecv (global ranks, -1: none); ``count`` None: a size message first,
        read with ``.item()`` (the reason ``sendrecv_sized`` exists)."""
        if count is None:
            ops, n_in = [], torch.zeros(1, dtype=torch.int64, device=send.device)
            if dest >= 0:
                ops.append(dist.P2POp(dist.isend, torch.tensor([send.numel()], dtype=torch.int64, device=send.device),
                                      dest, group=self._pg))
            if source >= 0:
                ops.append(dist.P2POp(dist.irecv, n_in, source, group=self._pg))
            for w in dist.batch_isend_irecv(ops):
                self._wait(w, "sendrecv", name, deadline)
            count = int(n_in.item()) if source >= 0 else 0
        ops, out = [], None
        if dest >= 0:
            ops.append(dist.P2POp(dist.isend, send, dest, group=self._pg))
        if source >= 0:
            out = torch.empty(count, dtype=send.dtype, device=send.device)
            ops.append(dist.P2POp(dist.irecv, out, source, group=self._pg))
        for w in dist.batch_isend_irecv(ops):
            self._wait(w, "sendrecv", name, deadline)
        return out
