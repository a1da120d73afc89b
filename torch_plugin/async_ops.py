"""Horovod's asynchronous calls: ``*_async`` returns an integer handle at once (the cross-rank
check done, the communication queued on the progress thread), ``poll(handle)`` says whether it
finished, ``synchronize(handle)`` waits and returns the result. Explicit names must be unique
among the handles not yet synchronized (a ValueError otherwise, as in Horovod)."""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

import torch

from hvd_commopt import collectives, scatter
from hvd_commopt.errors import ConfigError
from hvd_commopt.process_sets import ProcessSet

from . import functions as F

__all__ = ["allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_",
           "alltoall_async", "reducescatter_async", "grouped_allreduce_async", "grouped_allreduce_async_",
           "grouped_allgather_async", "grouped_reducescatter_async", "sparse_allreduce_async", "poll", "synchronize"]

_lock = threading.Lock()
_ids = itertools.count(1)
_handles: dict[int, tuple[Any, Callable[[Any], Any], str | None]] = {}


def _register(work: Any, post: Callable[[Any], Any], name: str | None) -> int:
    with _lock:
        h = next(_ids)
        _handles[h] = (work, post, name)
    return h


def _check_name(name: str | None) -> None:
    if name is None:
        return
    with _lock:
        if any(n == name and not w.done() for w, _, n in _handles.values()):  # Horovod frees a name once done
            raise ConfigError(f"a collective named '{name}' is already in flight on this rank: synchronize it "
                              f"first or use another name")


def poll(handle: int) -> bool:
    """True when the operation of ``handle`` has finished (synchronize will not block)."""
    if handle not in _handles:
        raise ConfigError(f"unknown or already synchronized handle {handle!r}")
    return _handles[handle][0].done()


def synchronize(handle: int) -> Any:
    """Wait for ``handle`` and return its result (the reduced/gathered/broadcast tensor)."""
    with _lock:
        item = _handles.pop(handle, None)
    if item is None:
        raise ConfigError(f"unknown or already synchronized handle {handle!r}")
    work, post, _ = item
    return post(work.wait())


def allreduce_async_(tensor: torch.Tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set: ProcessSet | None = None) -> int:
    """In-place :func:`allreduce_async`: ``synchronize`` writes the result into ``tensor``."""
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set, inplace=True)


def allreduce_async(tensor: torch.Tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set: ProcessSet | None = None) -> int:
    return _allreduce(tensor, average, name, op, prescale_factor, postscale_factor, process_set, inplace=False)


def _allreduce(tensor, average, name, op, pre, post, process_set, inplace):
    _check_name(name)
    kw = F._reduce_kw(average, op, None, pre, post)
    work = collectives.allreduce_async(F._comm(None, process_set), F._ops, F._flat_copy(tensor),
                                       shape=tuple(tensor.shape), name=name or "allreduce", **kw)
    if inplace:
        return _register(work, lambda out: F._write_back(tensor, out), name)
    return _register(work, lambda out: out.reshape(tensor.shape), name)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set: ProcessSet | None = None, _inplace: bool = False) -> int:
    _check_name(name)
    kw = F._reduce_kw(average, op, None, prescale_factor, postscale_factor)
    work = collectives.grouped_allreduce_async(F._comm(None, process_set), F._ops, [F._flat_copy(t) for t in tensors],
                                               [tuple(t.shape) for t in tensors], name=name or "grouped_allreduce",
                                               **kw)
    if _inplace:
        return _register(work, lambda outs: [F._write_back(t, o) for t, o in zip(tensors, outs)], name)
    return _register(work, lambda outs: [o.reshape(t.shape) for t, o in zip(tensors, outs)], name)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set: ProcessSet | None = None) -> int:
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                                   _inplace=True)


def allgather_async(tensor: torch.Tensor, name=None, process_set: ProcessSet | None = None) -> int:
    _check_name(name)
    t = tensor.detach().contiguous()
    rest = F._rest(t)
    work = collectives.allgather_async(F._comm(None, process_set), F._ops, t.reshape(-1), rest, name or "allgather")
    return _register(work, lambda r: r[0].reshape((-1,) + rest) if t.dim() > 0 else r[0], name)


def grouped_allgather_async(tensors, name=None, process_set: ProcessSet | None = None) -> int:
    _check_name(name)
    ts = [t.detach().contiguous() for t in tensors]
    work = collectives.grouped_allgather_async(F._comm(None, process_set), F._ops, [t.reshape(-1) for t in ts],
                                               [F._rest(t) for t in ts], name or "grouped_allgather")
    return _register(work, lambda outs: [o.reshape((-1,) + F._rest(t)) for (o, _), t in zip(outs, ts)], name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0, name=None, process_set: ProcessSet | None = None) -> int:
    return _broadcast(tensor, root_rank, name, process_set, inplace=True)


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0, name=None, process_set: ProcessSet | None = None) -> int:
    return _broadcast(tensor, root_rank, name, process_set, inplace=False)


def _broadcast(tensor, root_rank, name, process_set, inplace):
    _check_name(name)
    work = collectives.broadcast_async(F._comm(None, process_set), F._ops, F._flat_copy(tensor),
                                       F._root(root_rank, process_set), name or "broadcast", tuple(tensor.shape))
    if inplace:
        return _register(work, lambda out: F._write_back(tensor, out), name)
    return _register(work, lambda out: out.reshape(tensor.shape), name)


def alltoall_async(tensor: torch.Tensor, splits=None, name=None, process_set: ProcessSet | None = None) -> int:
    _check_name(name)
    t = tensor.detach().contiguous()
    sp = None if splits is None else [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    work = scatter.alltoall_async(F._comm(None, process_set), F._ops, t.reshape(-1), tuple(t.shape), sp,
                                  name or "alltoall")
    return _register(work, lambda r: (r[0].reshape((-1,) + tuple(t.shape[1:])),
                                      torch.tensor(r[1], dtype=torch.int32)), name)


def reducescatter_async(tensor: torch.Tensor, name=None, op=None, process_set: ProcessSet | None = None,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    _check_name(name)
    kw = F._reduce_kw(None, op, None, prescale_factor, postscale_factor)
    work = scatter.reducescatter_async(F._comm(None, process_set), F._ops, F._flat_copy(tensor), tuple(tensor.shape),
                                       name=name or "reducescatter", **kw)
    return _register(work, lambda out: out.reshape((-1,) + tuple(tensor.shape[1:])), name)


def grouped_reducescatter_async(tensors, name=None, op=None, process_set: ProcessSet | None = None,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    _check_name(name)
    kw = F._reduce_kw(None, op, None, prescale_factor, postscale_factor)
    work = scatter.grouped_reducescatter_async(F._comm(None, process_set), F._ops, [F._flat_copy(t) for t in tensors],
                                               [tuple(t.shape) for t in tensors],
                                               name=name or "grouped_reducescatter", **kw)
    return _register(work, lambda outs: [o.reshape((-1,) + tuple(t.shape[1:])) for o, t in zip(outs, tensors)],
                     name)


def sparse_allreduce_async(tensor: torch.Tensor, name=None, op=None, process_set: ProcessSet | None = None):
    """Allreduce of a sparse COO tensor: its indices and values are allgathered (one check) and
    summed into a coalesced sparse result; op Average divides by the size. Returns a callable
    that waits and gives the result (Horovod's form)."""
    _check_name(name)
    from hvd_commopt.reduce import Average  # noqa: PLC0415
    op = collectives.resolve_op(None, op)
    t = tensor.detach().coalesce()
    idx, val = t.indices().t().contiguous(), t.values().contiguous()
    comm = F._comm(None, process_set)
    work = collectives.grouped_allgather_async(comm, F._ops, [idx.reshape(-1), val.reshape(-1)],
                                               [F._rest(idx), F._rest(val)], name or "sparse_allreduce")

    def post(outs):
        i = outs[0][0].reshape((-1,) + F._rest(idx)).t()
        v = outs[1][0].reshape((-1,) + F._rest(val))
        if op == Average:
            v = v / comm.size
        return torch.sparse_coo_tensor(i, v, tuple(t.shape)).coalesce()
    handle = _register(work, post, name)
    return lambda: synchronize(handle)  # Horovod returns a callable that waits
