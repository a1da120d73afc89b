"""Model buffers (BatchNorm's running statistics, ...) kept equal across ranks, as DDP keeps them
(docs/usage.md#buffers).

DDP broadcasts rank 0's buffers before every forward (``broadcast_buffers=True``, its default).
:class:`BufferSync` gives the same values without a message inside ``step()``: after each step of
the synchronous schedule, once the step's own collectives are done, it *starts* one broadcast of
rank 0's buffers (packed as bytes into one flat buffer, so float statistics and the int64
``num_batches_tracked`` travel together) and returns; a forward pre-hook on the model completes it
and copies the result into the buffers before the next forward (training or evaluation), so the
message overlaps whatever runs between the step and the next forward (data loading, logging).
``optimizer.state_dict()`` completes it too. Where nothing runs in between, the forward waits for a
small message's latency, DDP's own cost. Values: before every forward, every rank holds rank 0's
buffers as of the last step, as under DDP.

A buffer changed by someone else after the broadcast started (``model.load_state_dict``, Horovod's
``broadcast_parameters(model.state_dict())``) keeps its new value: the result is dropped when a
buffer's version counter moved. Delayed and model-averaging schedules broadcast at wrap time only:
a message started after their step would queue behind the rounds they keep in flight.

At wrap time the buffers' names, shapes and dtypes are compared across ranks (the model check of
docs/cross-rank-check.md#settings) and rank 0's buffers are broadcast; with
``broadcast_buffers=False`` their values are compared instead (one exchange) and a warning names
the buffers that differ.
"""
from __future__ import annotations

import warnings
import weakref

import torch

from hvd_commopt import cross_rank_state as crs
from hvd_commopt.comm.communicator import Communicator
from hvd_commopt.comm.handle import Handle
from hvd_commopt.engine import TensorSpec
from hvd_commopt.engine.specs import verify_same_tensors

from .ops import TorchOps

__all__ = ["BufferSync"]

_OPS = TorchOps()


class BufferSync:
    """Rank 0's buffers onto every rank, one message per step (module docstring).

    Args:
        comm: the optimizer's communicator.
        model: the module whose buffers are kept equal (its forward pre-hook completes a broadcast).
        broadcast: broadcast at wrap time and after each step (``every_step``); False: only check.
        every_step: the synchronous schedule (a broadcast after each step).
    """

    def __init__(self, comm: Communicator, model: torch.nn.Module, broadcast: bool, every_step: bool):
        self.comm = comm
        self.named = [(n, b) for n, b in model.named_buffers() if b is not None]
        self.every_step = broadcast and every_step and comm.size > 1 and bool(self.named)
        self._pending: tuple[Handle, list[int]] | None = None
        verify_same_tensors(comm, [TensorSpec(n, tuple(b.shape), _OPS.dtype_name(b)) for n, b in self.named],
                            what="model's buffers")
        if broadcast:
            self.start()
            self.settle()
        else:
            self._warn_if_different()
        if self.every_step:
            me = weakref.ref(self)  # the optimizer owns this object; the model's hook must not keep it

            def before_forward(module, args):
                sync = me()
                if sync is not None:
                    sync.settle()
            hook = model.register_forward_pre_hook(before_forward)
            weakref.finalize(self, hook.remove)

    def start(self) -> None:
        """Start broadcasting rank 0's buffers (no-op alone or without buffers)."""
        if self.comm.size == 1 or not self.named:
            return
        self.settle()  # no forward of the model ran since the last one (e.g. a submodule called alone)
        with torch.no_grad():
            parts = [b.detach().reshape(-1).contiguous().view(torch.uint8) for _, b in self.named]
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        # no per-call negotiation: the wrap-time check made the layout equal on every rank
        self._pending = (self.comm.broadcast_tensor_async(_OPS, flat, 0, "broadcast_buffers"),
                         [b._version for _, b in self.named])

    def settle(self) -> None:
        """Complete the broadcast in flight, if any, and copy rank 0's values into the buffers."""
        if self._pending is None:
            return
        handle, versions = self._pending
        self._pending = None
        out = self.comm.wait(handle)
        if self.comm.rank == 0:
            return
        with torch.no_grad():
            off = 0
            for (_, b), v in zip(self.named, versions):
                n = b.numel() * b.element_size()
                if b._version == v:  # else set since the broadcast started (a load): keep the new value
                    b.copy_(out[off:off + n].view(b.dtype).view(b.shape))
                off += n

    def after_step(self) -> None:
        if self.every_step:
            self.start()

    def _warn_if_different(self) -> None:
        if self.comm.size == 1:
            return
        entries = crs.fingerprint(_OPS, dict(self.named), "buffer")
        everyone = self.comm.allgather_object(entries, name="verify.buffers")
        differ = [p[len("buffer."):] for p in entries if len({d.get(p) for d in everyone}) > 1]
        if differ:
            warnings.warn(f"rank {self.comm.rank}: the model's buffers differ across ranks: {differ[:10]}"
                          f"{' ...' if len(differ) > 10 else ''}. With broadcast_buffers=False they are "
                          f"not synchronised; pass broadcast_buffers=True, or call "
                          f"broadcast_parameters(model.state_dict(), root_rank=0) (docs/usage.md#buffers)",
                          RuntimeWarning, stacklevel=4)
