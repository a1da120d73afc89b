"""Tensor collectives and broadcasts for PyTorch (Horovod's names and argument names)."""
from __future__ import annotations

import io
from typing import Any, Iterable

import torch

from hvd_commopt import runtime
from hvd_commopt.engine.specs import TensorSpec, verify_same_tensors
from hvd_commopt.errors import ConfigError

from .ops import TorchOps

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allreduce",
           "allreduce_", "allgather", "broadcast", "broadcast_"]

_ops = TorchOps()


def _comm_buffer(comm, t: torch.Tensor):
    return _ops.to_numpy(t) if comm.buffer_kind == "numpy" else t


def _from_comm(comm, buf, like: torch.Tensor) -> torch.Tensor:
    return _ops.from_numpy(buf, like=like) if comm.buffer_kind == "numpy" else buf


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: str = "average") -> torch.Tensor:
    """In-place allreduce of ``tensor`` (``op`` "average" or "sum"; ``average`` is Horovod's old flag)."""
    comm = runtime.communicator()
    if average is not None:
        op = "average" if average else "sum"
    if op not in ("average", "sum"):
        raise ConfigError(f"op must be 'average' or 'sum', got {op!r}")
    flat = tensor.detach().reshape(-1)
    contiguous = flat.data_ptr() == tensor.data_ptr() and tensor.is_contiguous()
    work = flat if contiguous else flat.clone()
    buf = comm.allreduce_(_comm_buffer(comm, work), "sum", name or "allreduce")
    res = _from_comm(comm, buf, work)
    if op == "average":
        res = res.div_(comm.size) if res.is_floating_point() else res.floor_divide_(comm.size)
    with torch.no_grad():
        if res.data_ptr() != tensor.data_ptr():
            tensor.copy_(res.view_as(tensor))
    return tensor


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              op: str = "average") -> torch.Tensor:
    """Allreduce into a new tensor."""
    return allreduce_(tensor.detach().clone(), average, name, op)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ; others must match)."""
    comm = runtime.communicator()
    t = tensor.detach().contiguous()
    rest = tuple(t.shape[1:]) if t.dim() > 0 else ()
    shapes = comm.allgather_object(rest, name=f"{name or 'allgather'}.shape")
    if any(s != rest for s in shapes):
        raise ConfigError(f"allgather: tensors must agree beyond dim 0; got {shapes}")
    out, _ = comm.allgather(_comm_buffer(comm, t.reshape(-1)), name or "allgather")
    out = _from_comm(comm, out, t)
    return out.reshape((-1,) + rest) if t.dim() > 0 else out


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's, in place."""
    comm = runtime.communicator()
    work = tensor.detach()
    if not work.is_contiguous():
        work = work.contiguous()
    buf = comm.broadcast_(_comm_buffer(comm, work), root_rank, name or "broadcast")
    res = _from_comm(comm, buf, work)
    with torch.no_grad():
        if res.data_ptr() != tensor.data_ptr():
            tensor.copy_(res.view_as(tensor))
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None) -> torch.Tensor:
    return broadcast_(tensor.detach().clone(), root_rank, name)


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Copy root's parameters (a ``state_dict()`` or ``named_parameters()``) to every rank in place.

    Tensors are fused per dtype into one buffer per broadcast. The names, shapes and dtypes are
    checked across ranks first, so a model that differs fails with a clear error instead of a
    mismatched broadcast.
    """
    comm = runtime.communicator()
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in items):
        raise ConfigError("broadcast_parameters expects model.state_dict() or model.named_parameters()")
    items = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
    verify_same_tensors(comm, [TensorSpec(n, tuple(t.shape), _ops.dtype_name(t)) for n, t in items],
                        what="set of parameters to broadcast")
    if comm.size == 1:
        return
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for _, t in items:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _dev), tensors in by_dtype.items():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        buf = comm.broadcast_(_comm_buffer(comm, flat), root_rank, f"broadcast_parameters.{dtype}")
        flat = _from_comm(comm, buf, flat)
        off = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t))
                off += n


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
