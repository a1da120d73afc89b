"""Gradients through the tensor collectives (torch.autograd.Function), Horovod's rules:

* allreduce: the gradient is the same allreduce (op, scale factors) of the output gradient;
* allgather: the output gradient averaged over ranks (Horovod's choice), then this rank's rows;
* broadcast: the averaged output gradient on the root, zero elsewhere;
* alltoall: the output gradient sent back with the received splits;
* reducescatter: the output gradient scaled (by the size for Sum, and the scale factors) and
  allgathered.

The communication runs through the core (torch_plugin/plain.py's helpers, which
torch_plugin/functions.py shares), so these classes only record what backward needs.
"""
from __future__ import annotations

import torch

from hvd_commopt import scatter
from hvd_commopt.reduce import Average, Sum

from . import plain as P

__all__ = ["AllreduceFn", "GroupedAllreduceFn", "AllgatherFn", "GroupedAllgatherFn", "BroadcastFn", "AlltoallFn",
           "ReducescatterFn", "GroupedReducescatterFn"]

_AVERAGE = {"op": Average, "compression": None, "prescale_factor": 1.0, "postscale_factor": 1.0}


def _grad_kw(kw: dict) -> dict:
    return {**kw, "compression": None}


class AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, kw, comm):
        ctx.kw, ctx.comm = kw, comm
        return P.allreduce_plain(tensor, name, kw, comm)

    @staticmethod
    def backward(ctx, grad):
        return P.allreduce_plain(grad.contiguous(), None, _grad_kw(ctx.kw), ctx.comm), None, None, None


class GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, kw, comm, *tensors):
        ctx.kw, ctx.comm = kw, comm
        return tuple(P.grouped_allreduce_plain(list(tensors), name, kw, comm))

    @staticmethod
    def backward(ctx, *grads):
        out = P.grouped_allreduce_plain([g.contiguous() for g in grads], None, _grad_kw(ctx.kw), ctx.comm)
        return (None, None, None, *out)


def _own_rows(gathered: torch.Tensor, rows: list[int], rank: int) -> torch.Tensor:
    """This rank's rows of an allgathered tensor (``rows``: every rank's count, in rank order)."""
    return gathered.narrow(0, sum(rows[:rank]), rows[rank])


class AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, comm):
        out, rows = P.allgather_plain(tensor, name, comm)
        ctx.rows, ctx.comm = rows, comm
        return out

    @staticmethod
    def backward(ctx, grad):
        red = P.allreduce_plain(grad.contiguous(), None, _AVERAGE, ctx.comm)
        return _own_rows(red, ctx.rows, ctx.comm.rank), None, None


class GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, comm, *tensors):
        outs, rows = P.grouped_allgather_plain(list(tensors), name, comm)
        ctx.rows, ctx.comm = rows, comm
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        reds = P.grouped_allreduce_plain([g.contiguous() for g in grads], None, _AVERAGE, ctx.comm)
        return (None, None, *[_own_rows(red, rows, ctx.comm.rank) for red, rows in zip(reds, ctx.rows)])


class BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, name, comm):
        ctx.root, ctx.comm = root, comm
        return P.broadcast_plain(tensor.detach().clone(), root, name, comm)

    @staticmethod
    def backward(ctx, grad):
        red = P.allreduce_plain(grad.contiguous(), None, _AVERAGE, ctx.comm)
        if ctx.comm.rank != ctx.root:
            red = torch.zeros_like(red)
        return red, None, None, None


def _alltoall_plain(tensor, splits, name, comm):
    t = tensor.detach().contiguous()
    out, recv = scatter.alltoall_async(comm, P.OPS, t.reshape(-1), tuple(t.shape), splits,
                                       name or "alltoall").wait()
    return out.reshape((-1,) + tuple(t.shape[1:])), recv


class AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, comm):
        out, recv = _alltoall_plain(tensor, splits, name, comm)
        ctx.recv, ctx.comm = recv, comm
        recv_t = torch.tensor(recv, dtype=torch.int32)
        ctx.mark_non_differentiable(recv_t)
        return out, recv_t

    @staticmethod
    def backward(ctx, grad, _dead):
        back, _ = _alltoall_plain(grad, ctx.recv, None, ctx.comm)
        return back, None, None, None


class ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, kw, comm):
        ctx.kw, ctx.comm = kw, comm
        t = tensor.detach()
        work = scatter.reducescatter_async(comm, P.OPS, P.flat_copy(t), tuple(t.shape),
                                           name=name or "reducescatter", **kw)
        return work.wait().reshape((-1,) + tuple(t.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        out, _ = P.allgather_plain(_scatter_grad(grad, ctx.kw, ctx.comm), None, ctx.comm)
        return out, None, None, None


def _scatter_grad(grad, kw, comm):
    """Horovod's reducescatter gradient before the allgather: times the size for Sum, times the
    scale factors."""
    g = grad.contiguous()
    if kw["op"] == Sum:
        g = g * comm.size
    for f in (kw["prescale_factor"], kw["postscale_factor"]):
        if f != 1.0:
            g = g * f
    return g


class GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, kw, comm, *tensors):
        ctx.kw, ctx.comm = kw, comm
        return tuple(P.grouped_reducescatter_plain(list(tensors), name, kw, comm))

    @staticmethod
    def backward(ctx, *grads):
        outs, _ = P.grouped_allgather_plain([_scatter_grad(g, ctx.kw, ctx.comm) for g in grads], None, ctx.comm)
        return (None, None, None, *outs)
