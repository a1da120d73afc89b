"""Tensor collectives and broadcasts for PyTorch (Horovod's names and argument names), a thin
layer over :mod:`hvd_commopt.collectives`: flatten, call the core, reshape."""
from __future__ import annotations

import io
from typing import Any

import torch

from hvd_commopt import collectives, runtime
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.errors import ConfigError
from hvd_commopt.reduce import Average, Sum

from .ops import TorchOps

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allreduce",
           "allreduce_", "allgather", "broadcast", "broadcast_"]

_ops = TorchOps()


def _op(average: bool | None, op: str | None) -> str:
    if op is None:
        op = Average if average is None or average else Sum
    return op


def _write_back(tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Copy ``flat``'s values into ``tensor`` unless they already are its storage."""
    with torch.no_grad():
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
    return tensor


def _comm(communicator):
    return communicator if communicator is not None else runtime.communicator()


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, compression=None,
               op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               communicator=None) -> torch.Tensor:
    """In-place allreduce of ``tensor``: ``op`` Average (default) or Sum (``average`` is Horovod's
    old flag); ``compression`` Compression.none/fp16/bf16; scale factors before/after the sum.
    ``communicator``: a core Communicator (default: the one ``init()`` made), as in tf_plugin."""
    flat = tensor.detach().reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        flat = flat.clone()
    out = collectives.allreduce(_comm(communicator), _ops, flat, op=_op(average, op), compression=compression,
                                prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                name=name or "allreduce")
    return _write_back(tensor, out)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, compression=None,
              op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              communicator=None) -> torch.Tensor:
    """Allreduce into a new tensor (see :func:`allreduce_`)."""
    return allreduce_(tensor.detach().clone(), average, name, compression, op, prescale_factor, postscale_factor,
                      communicator)


def allgather(tensor: torch.Tensor, name: str | None = None, communicator=None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ; others must match)."""
    t = tensor.detach().contiguous()
    rest = tuple(t.shape[1:]) if t.dim() > 0 else ()
    out = collectives.allgather(_comm(communicator), _ops, t.reshape(-1), rest, name or "allgather")
    return out.reshape((-1,) + rest) if t.dim() > 0 else out


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, communicator=None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's, in place."""
    flat = tensor.detach().reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        flat = flat.clone()
    return _write_back(tensor, collectives.broadcast(_comm(communicator), _ops, flat, root_rank,
                                                     name or "broadcast"))


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, communicator=None) -> torch.Tensor:
    return broadcast_(tensor.detach().clone(), root_rank, name, communicator)


def broadcast_parameters(params: Any, root_rank: int = 0, communicator=None) -> None:
    """Copy root's parameters (a ``state_dict()`` or ``named_parameters()``) to every rank in place.

    Tensors are fused per dtype into one buffer per broadcast; names, shapes and dtypes are
    checked across ranks first (see :func:`hvd_commopt.collectives.broadcast_tensors`).
    """
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in items):
        raise ConfigError("broadcast_parameters expects model.state_dict() or model.named_parameters()")
    items = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
    specs = [TensorSpec(n, tuple(t.shape), _ops.dtype_name(t)) for n, t in items]
    flats = [t.detach().reshape(-1) for _, t in items]
    new = collectives.broadcast_tensors(_comm(communicator), _ops, specs, flats, root_rank,
                                        what="set of parameters to broadcast", label="broadcast_parameters")
    with torch.no_grad():
        for (_, t), f in zip(items, new):
            if f.data_ptr() != t.data_ptr():
                t.copy_(f.view_as(t))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Root's Python object (tensors included) on every rank, via torch.save/torch.load."""
    comm = runtime.communicator()
    data = None
    if comm.rank == root_rank:
        b = io.BytesIO()
        torch.save(obj, b)
        data = b.getvalue()
    data = comm.broadcast_object(data, root_rank, name or "broadcast_object")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank root's optimizer state and hyper-parameters (lr, momentum buffers, ...)."""
    comm = runtime.communicator()
    comm.check_rank(root_rank, "root")  # at size 1 too: the script fails here, not on a bigger job
    if comm.size == 1:
        return
    state = broadcast_object(optimizer.state_dict(), root_rank, "broadcast_optimizer_state")
    if comm.rank != root_rank:
        dev = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        for s in state.get("state", {}).values():
            for k, v in list(s.items()):
                if isinstance(v, torch.Tensor) and k != "step":
                    s[k] = v.to(dev)
        optimizer.load_state_dict(state)
