"""Which device the wrapped parameters live on, checked across ranks at wrap time.

Why at wrap time: a rank whose gradients are CUDA tensors while another's are CPU tensors would
issue its collectives on a different transport (NCCL vs Gloo within our group) and the job would
hang or fail deep inside a collective. One small allgather when the optimizer is wrapped turns
that into one error naming a tensor (docs/backends.md#devices).
"""
from __future__ import annotations

from typing import Sequence

import torch

from hvd_commopt.errors import ConfigError, RankMismatchError

__all__ = ["check_devices"]


def check_devices(comm, named: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """The device type ("cpu", "cuda", ...) of every parameter in ``named``, the same on every rank.

    Raises:
        ConfigError: this rank's parameters span several device types (buckets fuse tensors
            into one buffer on one device), naming one tensor on each.
        RankMismatchError: on every rank, when the ranks' device types differ, naming the tensor.
    """
    first: dict[str, str] = {}
    for n, p in named:
        first.setdefault(p.device.type, n)
    if len(first) > 1:
        where = ", ".join(f"'{n}' on {d}" for d, n in first.items())
        raise ConfigError(f"the wrapped parameters are on several device types ({where}); put the whole "
                          f"model on one device (model.to(device)) before wrapping the optimizer")
    mine = next(iter(first.items()), None)  # (device type, a tensor on it) or None (no parameters)
    if comm.size == 1:
        return mine[0] if mine else None
    every = comm.allgather_object(mine, name="verify.devices")
    kinds = {e[0] for e in every if e is not None}
    if len(kinds) > 1:
        ref = every[0]
        r, other = next((r, e) for r, e in enumerate(every) if e is not None and (ref is None or e[0] != ref[0]))
        base = f"on {ref[0]} on rank 0" if ref is not None else "absent on rank 0"
        raise RankMismatchError(
            f"tensor '{other[1]}' is on {other[0]} on rank {r} but the parameters are {base}: every rank must "
            f"hold its model on the same device type (e.g. model.to('cuda') on every rank, or on none) before "
            f"wrapping the optimizer")
    return mine[0] if mine else None
