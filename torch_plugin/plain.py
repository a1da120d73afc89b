"""The tensor collectives without gradients: flatten, call the core, reshape.

:mod:`.functions` (the public, differentiable forms) and :mod:`.autograd` (their backward
passes) both build on these; neither imports the other's way back, so there is no import circle.
"""
from __future__ import annotations

import torch

from hvd_commopt import collectives, scatter
from hvd_commopt.tensor_ops import register_ops

from .ops import TorchOps

__all__ = ["OPS", "flat_copy", "write_back", "rest_shape", "allreduce_plain", "grouped_allreduce_plain",
           "allgather_plain", "grouped_allgather_plain", "grouped_reducescatter_plain", "broadcast_plain"]

OPS = TorchOps()
register_ops(torch.Tensor, OPS)  # Compression.fp16.compress(tensor), Horovod's form


def flat_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D copy the core may overwrite."""
    return tensor.detach().reshape(-1).clone()


def write_back(tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Copy ``flat``'s values into ``tensor`` unless they already are its storage."""
    with torch.no_grad():
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return tensor


def rest_shape(t: torch.Tensor) -> tuple:
    """The shape after dim 0 (what every rank's rows must agree on)."""
    return tuple(t.shape[1:]) if t.dim() > 0 else ()


def allreduce_plain(tensor: torch.Tensor, name: str | None, kw: dict, comm) -> torch.Tensor:
    out = collectives.allreduce(comm, OPS, flat_copy(tensor), shape=tuple(tensor.shape),
                                name=name or "allreduce", **kw)
    return out.reshape(tensor.shape)


def grouped_allreduce_plain(tensors, name, kw, comm):
    work = collectives.grouped_allreduce_async(comm, OPS, [flat_copy(t) for t in tensors],
                                               [tuple(t.shape) for t in tensors], name=name or "grouped_allreduce", **kw)
    return [o.reshape(t.shape) for o, t in zip(work.wait(), tensors)]


def allgather_plain(tensor: torch.Tensor, name: str | None, comm) -> tuple[torch.Tensor, list[int]]:
    t = tensor.detach().contiguous()
    rest = rest_shape(t)
    out, rows = collectives.allgather_async(comm, OPS, t.reshape(-1), rest, name or "allgather").wait()
    return (out.reshape((-1,) + rest) if t.dim() > 0 else out), rows


def grouped_allgather_plain(tensors, name, comm):
    """(gathered tensors, rows per rank of each)."""
    ts = [t.detach().contiguous() for t in tensors]
    outs = collectives.grouped_allgather_async(comm, OPS, [t.reshape(-1) for t in ts], [rest_shape(t) for t in ts],
                                               name or "grouped_allgather").wait()
    return ([o.reshape((-1,) + rest_shape(t)) if t.dim() > 0 else o for (o, _), t in zip(outs, ts)],
            [rows for _, rows in outs])


def grouped_reducescatter_plain(tensors, name, kw, comm):
    work = scatter.grouped_reducescatter_async(comm, OPS, [flat_copy(t) for t in tensors],
                                               [tuple(t.shape) for t in tensors],
                                               name=name or "grouped_reducescatter", **kw)
    return [o.reshape((-1,) + tuple(t.shape[1:])) for o, t in zip(work.wait(), tensors)]


def broadcast_plain(tensor: torch.Tensor, root: int, name: str | None, comm) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``root``'s (a rank of ``comm``), in place."""
    flat = tensor.detach().reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        flat = flat.clone()
    return write_back(tensor, collectives.broadcast(comm, OPS, flat, root, name or "broadcast", tuple(tensor.shape)))
