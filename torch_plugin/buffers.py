"""Model buffers (BatchNorm's running statistics, ...) kept equal across ranks, as DDP keeps them
(docs/usage.md#buffers).

DDP broadcasts rank 0's buffers before every forward (``broadcast_buffers=True``, its default).
The optimizer wrapper sees no forward, so :class:`BufferSync` broadcasts rank 0's buffers at wrap
time and after every step of the synchronous schedule, once the step's own collectives are done:
what any code between two steps sees (evaluation, a checkpoint) is rank 0's buffers, as under DDP.
(Training forwards in train mode normalise with the batch's statistics, so the running statistics
only matter there.) One collective per step carries every buffer: the buffers are packed as bytes
into one flat buffer, so mixed dtypes (float statistics, the int64 ``num_batches_tracked``) need no
second message; its cost is measured by benchmarks/buffers_bench.py. Delayed and model-averaging
schedules broadcast at wrap time only: a per-step message would queue behind their rounds in flight.

At wrap time the buffers' names, shapes and dtypes are compared across ranks (the model check of
docs/cross-rank-check.md#settings); with ``broadcast_buffers=False`` their values are compared too
(one digest) and a warning names the buffers that differ.
"""
from __future__ import annotations

import warnings

import torch

from hvd_commopt import cross_rank_state as crs
from hvd_commopt.comm.communicator import Communicator
from hvd_commopt.engine import TensorSpec
from hvd_commopt.engine.specs import verify_same_tensors

from .ops import TorchOps

__all__ = ["BufferSync"]

_OPS = TorchOps()


class BufferSync:
    """Rank 0's buffers onto every rank, in one message (module docstring).

    Args:
        comm: the optimizer's communicator.
        named_buffers: ``model.named_buffers()``.
        broadcast: broadcast at wrap time (and after each step, ``every_step``); False: only check.
        every_step: broadcast after each step too (the synchronous schedule).
    """

    def __init__(self, comm: Communicator, named_buffers, broadcast: bool, every_step: bool):
        self.comm = comm
        self.named = [(n, b) for n, b in named_buffers if b is not None]
        self.every_step = broadcast and every_step and comm.size > 1 and bool(self.named)
        verify_same_tensors(comm, [TensorSpec(n, tuple(b.shape), _OPS.dtype_name(b)) for n, b in self.named],
                            what="model's buffers")
        if broadcast:
            self.broadcast()
        else:
            self._warn_if_different()

    def broadcast(self) -> None:
        """Every buffer := rank 0's (one broadcast of their bytes)."""
        if self.comm.size == 1 or not self.named:
            return
        with torch.no_grad():
            parts = [b.detach().reshape(-1).contiguous().view(torch.uint8) for _, b in self.named]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            # no per-call negotiation: the wrap-time check made the layout equal on every rank
            out = self.comm.wait(self.comm.broadcast_tensor_async(_OPS, flat, 0, "broadcast_buffers"))
            if self.comm.rank != 0:
                off = 0
                for (_, b), p in zip(self.named, parts):
                    b.copy_(out[off:off + p.numel()].view(b.dtype).view(b.shape))
                    off += p.numel()

    def after_step(self) -> None:
        if self.every_step:
            self.broadcast()

    def _warn_if_different(self) -> None:
        entries = crs.fingerprint(_OPS, dict(self.named), "buffer")
        if self.comm.size == 1:
            return
        everyone = self.comm.allgather_object(entries, name="verify.buffers")
        differ = [p[len("buffer."):] for p in entries if len({d.get(p) for d in everyone}) > 1]
        if differ:
            warnings.warn(f"rank {self.comm.rank}: the model's buffers differ across ranks: {differ[:10]}"
                          f"{' ...' if len(differ) > 10 else ''}. With broadcast_buffers=False they are "
                          f"not synchronised; pass broadcast_buffers=True, or call "
                          f"broadcast_parameters(model.state_dict(), root_rank=0) (docs/usage.md#buffers)",
                          RuntimeWarning, stacklevel=4)
