"""Tensor collectives and broadcasts for PyTorch (Horovod's names and argument names), a thin
layer over :mod:`hvd_commopt.collectives` / :mod:`hvd_commopt.scatter`: flatten, call the core,
reshape (the plain forms: torch_plugin/plain.py). Gradients flow through them
(torch_plugin/autograd.py); ``*_async`` forms live in torch_plugin/async_ops.py."""
from __future__ import annotations

import io
from typing import Any

import torch

from hvd_commopt import collectives, runtime
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.errors import ConfigError
from hvd_commopt.process_sets import ProcessSet, communicator_of as _comm, root_in_set as _root
from hvd_commopt.reduce import Average

from . import plain
from .autograd import (AllgatherFn, AllreduceFn, AlltoallFn, BroadcastFn, GroupedAllgatherFn, GroupedAllreduceFn,
                       GroupedReducescatterFn, ReducescatterFn)
from .plain import broadcast_plain

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allreduce",
           "allreduce_", "allgather", "broadcast", "broadcast_", "grouped_allreduce", "grouped_allreduce_",
           "grouped_allgather", "alltoall", "reducescatter", "grouped_reducescatter", "allgather_object"]

# the plain helpers under the names torch_plugin/async_ops.py and api.py use
_ops, _flat_copy, _write_back, _rest = plain.OPS, plain.flat_copy, plain.write_back, plain.rest_shape


def _reduce_kw(average, op, compression, prescale_factor, postscale_factor) -> dict:
    return {"op": collectives.resolve_op(average, op), "compression": compression, "prescale_factor": prescale_factor,
            "postscale_factor": postscale_factor}


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: str | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet | None = None,
               communicator=None, compression=None) -> torch.Tensor:
    """In-place allreduce of ``tensor`` (Horovod's positional order: no compression argument
    before ``op``): ``op`` Average (default), Sum, Min, Max, Product, Adasum (``average`` is
    Horovod's old flag); scale factors before/after the reduction. Ranks must agree on shape
    and dtype (else a RankMismatchError on every rank)."""
    flat = tensor.detach().reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        flat = flat.clone()
    out = collectives.allreduce(_comm(communicator, process_set), _ops, flat, shape=tuple(tensor.shape),
                                name=name or "allreduce",
                                **_reduce_kw(average, op, compression, prescale_factor, postscale_factor))
    return _write_back(tensor, out)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, compression=None,
              op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              communicator=None, process_set: ProcessSet | None = None) -> torch.Tensor:
    """Allreduce into a new tensor (see :func:`allreduce_`); ``compression``: Compression.none/
    fp16/bf16 or a Horovod-style compressor; differentiable."""
    return AllreduceFn.apply(tensor, name, _reduce_kw(average, op, compression, prescale_factor, postscale_factor),
                             _comm(communicator, process_set))


def grouped_allreduce_(tensors, average: bool | None = None, name: str | None = None, op: str | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet | None = None, compression=None):
    """In-place allreduce of a list of tensors as one operation."""
    outs = plain.grouped_allreduce_plain(list(tensors), name, _reduce_kw(average, op, compression, prescale_factor,
                                                           postscale_factor), _comm(None, process_set))
    return [_write_back(t, o.reshape(-1)) for t, o in zip(tensors, outs)]


def grouped_allreduce(tensors, average: bool | None = None, name: str | None = None, compression=None,
                      op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = None):
    """Allreduce of a list of tensors as one operation (one check, one fused reduction per
    dtype); new tensors, differentiable."""
    kw = _reduce_kw(average, op, compression, prescale_factor, postscale_factor)
    return list(GroupedAllreduceFn.apply(name, kw, _comm(None, process_set), *tensors))


def allgather(tensor: torch.Tensor, name: str | None = None, communicator=None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ; others and the dtype
    must match); differentiable."""
    return AllgatherFn.apply(tensor, name, _comm(communicator, process_set))


def grouped_allgather(tensors, name: str | None = None, process_set: ProcessSet | None = None):
    """Allgather of a list of tensors as one operation; differentiable."""
    return list(GroupedAllgatherFn.apply(name, _comm(None, process_set), *tensors))


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, communicator=None,
               process_set: ProcessSet | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with root's, in place (``root_rank`` is a global rank)."""
    return broadcast_plain(tensor, _root(root_rank, process_set), name, _comm(communicator, process_set))


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, communicator=None,
              process_set: ProcessSet | None = None) -> torch.Tensor:
    """Root's tensor in a new tensor; differentiable."""
    comm = _comm(communicator, process_set)
    return BroadcastFn.apply(tensor, _root(root_rank, process_set), name, comm)


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None, process_set: ProcessSet | None = None):
    """Send rows ``splits[j]`` (dim 0) to rank j, receive every rank's rows for this one.
    Returns the received tensor, or (tensor, received splits) when ``splits`` is given
    (Horovod's convention); differentiable."""
    sp = None if splits is None else [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    out, recv = AlltoallFn.apply(tensor, sp, name, _comm(None, process_set))
    return out if splits is None else (out, recv)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression=None, op: str = Average,
                  process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce every rank's tensor and keep this rank's part of dim 0 (the first ``d0 % size``
    ranks get one row more); differentiable."""
    kw = _reduce_kw(None, op, compression, prescale_factor, postscale_factor)
    return ReducescatterFn.apply(tensor, name, kw, _comm(None, process_set))


def grouped_reducescatter(tensors, name: str | None = None, compression=None, op: str = Average,
                          process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0):
    """Reducescatter of a list of tensors as one operation; differentiable."""
    kw = _reduce_kw(None, op, compression, prescale_factor, postscale_factor)
    return list(GroupedReducescatterFn.apply(name, kw, _comm(None, process_set), *tensors))


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet | None = None,
                     communicator=None) -> list:
    """Every rank's picklable object, in rank order."""
    return collectives.allgather_object(_comm(communicator, process_set), obj, name or "allgather_object")


def broadcast_parameters(params: Any, root_rank: int = 0, communicator=None,
                         process_set: ProcessSet | None = None) -> None:
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
    new = collectives.broadcast_tensors(_comm(communicator, process_set), _ops, specs, flats,
                                        _root(root_rank, process_set),
                                        what="set of parameters to broadcast", label="broadcast_parameters")
    with torch.no_grad():
        for (_, t), f in zip(items, new):
            if f.data_ptr() != t.data_ptr():
                t.copy_(f.view_as(t))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Root's Python object (tensors included) on every rank, via torch.save/torch.load."""
    comm = _comm(None, process_set)
    root = _root(root_rank, process_set)
    data = None
    if comm.rank == root:
        b = io.BytesIO()
        torch.save(obj, b)
        data = b.getvalue()
    data = comm.broadcast_object(data, root, name or "broadcast_object")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0, model=None,
                              process_set: ProcessSet | None = None) -> None:
    """Give every rank root's optimizer state and hyper-parameters (lr, momentum buffers, ...).

    An optimizer that has not stepped yet has no state (momentum buffers, Adam moments); as in
    Horovod, its state is first created by one step with zero gradients (parameters restored
    afterwards), so every rank's state has root's structure and values.
    """
    if process_set is None:  # at size 1 too: the script fails here, not on a bigger job
        runtime.communicator().check_rank(root_rank, "root")
    comm = _comm(None, process_set)
    _init_empty_state(optimizer)
    if comm.size == 1:
        return
    state = broadcast_object(optimizer.state_dict(), root_rank, "broadcast_optimizer_state", process_set)
    if comm.rank != _root(root_rank, process_set):
        dev = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        for s in state.get("state", {}).values():
            for k, v in list(s.items()):
                if isinstance(v, torch.Tensor) and k != "step":
                    s[k] = v.to(dev)
        optimizer.load_state_dict(state)


def _init_empty_state(optimizer: torch.optim.Optimizer) -> None:
    """Run the base optimizer's step once with zero gradients on a stateless optimizer, then put
    the parameters back: creates the state entries. As in Horovod, the parameters that require
    a gradient are left with a zero ``.grad`` where they had none. Unlike Horovod, the step
    counters are reset to 0, so the training that follows is the one a fresh optimizer would
    give (Adam's bias correction is not shifted by the zero step; SGD's zero momentum buffer
    gives the same first update unless ``dampening`` is set)."""
    if optimizer.state_dict()["state"]:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        return
    saved = [(p, p.detach().clone(), p.grad if p.grad is not None else torch.zeros_like(p)) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    base = getattr(type(optimizer), "_hco_base", type(optimizer))  # skip the gradient reduction
    base.step(optimizer)
    with torch.no_grad():
        for p, val, grad in saved:
            p.copy_(val)
            p.grad = grad
        for s in optimizer.state.values():
            if "step" in s:
                s["step"] = s["step"].zero_() if isinstance(s["step"], torch.Tensor) else 0
