"""The torch backend's Gloo collectives on CUDA tensors that are staged through pinned host
memory besides the allreduce and the equal-size allgather: the variable-size allgather and the
point-to-point exchanges (``sendrecv``, ``sendrecv_sized``) (docs/backends.md#cuda-on-gloo).
A mixin of :class:`~torch_plugin.comm.TorchDistBackend`, kept apart so that module stays under
400 lines; the copies and the host buffers are :class:`~torch_plugin.cuda_staging.HostStaging`'s.

torch.distributed's backend table lists Gloo's ``send``, ``recv`` and ``all_gather`` as CPU only. Here the sizes travel as host integers (the
variable-size allgather's counts, ``sendrecv``'s size message), so nothing is read back from the
device, and the data crosses PCIe once each way per call, on the copy stream out and on the
caller's stream back.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .int16_wire import movable, restore

__all__ = ["StagedCollectives", "takes"]


def takes(backend: str, t: torch.Tensor) -> bool:
    """Whether a collective of ``t`` on ``backend`` is staged here: a CUDA tensor on Gloo (the
    tests route CPU tensors here too, to check the staging without a GPU)."""
    return backend == "gloo" and t.is_cuda


class StagedCollectives:
    """The staged variable-size allgather and point-to-point exchange (module docstring)."""

    name: str
    size: int
    _pg: Any
    _staging: Any
    _run: Any
    _enter: Any
    _wait: Any
    _finish_marked: Any
    _global: Any

    def _staged_allgather(self, buf: torch.Tensor, name: str, deadline: float, op: str, desc: Any):
        """``allgather``'s (gathered, counts) of a tensor :func:`takes` routes here: the counts over
        host tensors, then :meth:`HostStaging.allgather_`."""
        wire, dtype = movable(buf.reshape(-1))
        wire = wire.contiguous()
        n = torch.tensor([wire.numel()], dtype=torch.int64)  # a host integer: no device read
        parts = [torch.zeros_like(n) for _ in range(self.size)]
        self._run(op, name, deadline, lambda: dist.all_gather(parts, n, group=self._pg, async_op=True), desc)
        counts = [int(c) for c in torch.cat(parts).tolist()]
        self._enter(op, name)
        out = self._staging.allgather_(wire, counts, self._pg, lambda w: self._wait(w, op, name, deadline))
        self._finish_marked()
        return restore(out, dtype), counts

    def _staged_sendrecv(self, send: torch.Tensor, dest: int, source: int, count: int | None, name: str,
                         deadline: float) -> torch.Tensor | None:
        """``sendrecv``/``sendrecv_sized`` of a tensor :func:`takes` routes here (``send`` already
        movable, ``dest``/``source`` ranks of the group or -1; ``count`` None: the size is sent
        first); the caller marks it on the control plane."""
        to, frm = self._global(dest), self._global(source)

        def p2p(out, into):
            ops = []
            if out is not None:
                ops.append(dist.P2POp(dist.isend, out, to, group=self._pg))
            if into is not None:
                ops.append(dist.P2POp(dist.irecv, into, frm, group=self._pg))
            for w in dist.batch_isend_irecv(ops):
                self._wait(w, "sendrecv", name, deadline)
        return self._staging.sendrecv(send.reshape(-1).contiguous(), dest >= 0, source >= 0, count, p2p)
