"""Which device the wrapped parameters live on, checked across ranks at wrap time.

Why at wrap time: a rank whose gradients are CUDA tensors while another's are CPU tensors would
issue its collectives on a different transport (NCCL vs Gloo within our group) and the job would
hang or fail deep inside a collective. One small allgather when the optimizer is wrapped turns
that into one error naming a tensor (docs/backends.md#devices).

Also which GPU a rank uses (``cuda:<local rank>``, as Horovod's examples set it) and the check,
when the NCCL backend starts, that no two ranks share one (docs/backends.md#one-gpu-per-rank).
"""
from __future__ import annotations

import json
import os
import socket
from typing import Sequence

import torch
import torch.distributed as dist

from hvd_commopt.comm.device_owners import DeviceId, check_one_device_per_rank, shared_devices
from hvd_commopt.errors import ConfigError, RankMismatchError

__all__ = ["check_devices", "rank_cuda_index", "cuda_device_id", "exchange_device_ids", "check_one_gpu_per_rank",
           "native_backend"]

_ID_BYTES = 256  # a device id, JSON-encoded, padded to this many bytes for one equal-size allgather


def rank_cuda_index(local_rank: int, device_count: int) -> int:
    """The CUDA device a rank uses: ``cuda:<local rank>`` as in Horovod's examples; a rank that
    sees fewer devices than its local rank (one ``CUDA_VISIBLE_DEVICES`` entry per rank: 1 device)
    wraps around, and :func:`check_one_gpu_per_rank` then refuses two ranks on one GPU."""
    return local_rank % device_count


def cuda_device_id(index: int) -> DeviceId:
    """This process's ``cuda:<index>`` as a :class:`DeviceId`: the GPU's UUID where torch gives
    one, else the visible-device list and the index."""
    uuid = str(torch.cuda.get_device_properties(index).uuid or "")  # torch >= 2.1 gives it
    device = uuid or f"{os.environ.get('CUDA_VISIBLE_DEVICES', '*')}#{index}"
    return DeviceId(socket.gethostname(), device, index)


def exchange_device_ids(group, mine: DeviceId | None) -> list[DeviceId | None]:
    """Every rank's device id, in rank order, by one allgather of a small CPU tensor on ``group``
    (its host side: Gloo, also in a ``cpu:gloo,cuda:nccl`` group, so no CUDA collective runs)."""
    raw = json.dumps(None if mine is None else [mine.host, mine.device, mine.index]).encode()
    if len(raw) > _ID_BYTES:
        raise ConfigError(f"internal: device id {raw!r} longer than {_ID_BYTES} bytes")
    buf = torch.zeros(_ID_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, buf, group=group)
    out: list[DeviceId | None] = []
    for p in parts:
        v = json.loads(bytes(p.numpy()).rstrip(b"\0").decode())
        out.append(None if v is None else DeviceId(v[0], v[1], int(v[2])))
    return out


def check_one_gpu_per_rank(group, mine: DeviceId | None, backend: str = "nccl") -> list[DeviceId | None]:
    """Exchange the ranks' device ids on ``group`` and raise, on every rank alike, one ConfigError
    naming the fix when two ranks would share a GPU (docs/backends.md#one-gpu-per-rank); returns
    the ids. The NCCL backend calls it at start-up with this rank's :func:`cuda_device_id`."""
    ids = exchange_device_ids(group, mine)
    check_one_device_per_rank(ids, backend)
    return ids


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
    gpu = next((p.device for _, p in named if p.device.type == "cuda"), None)
    ids = [cuda_device_id(gpu.index if gpu.index is not None else torch.cuda.current_device())] if gpu else [None]
    every = comm.allgather_object(None if mine is None else (*mine, ids[0]), name="verify.devices")
    kinds = {e[0] for e in every if e is not None}
    if len(kinds) > 1:
        ref = every[0]
        r, other = next((r, e) for r, e in enumerate(every) if e is not None and (ref is None or e[0] != ref[0]))
        base = f"on {ref[0]} on rank 0" if ref is not None else "absent on rank 0"
        raise RankMismatchError(
            f"tensor '{other[1]}' is on {other[0]} on rank {r} but the parameters are {base}: every rank must "
            f"hold its model on the same device type (e.g. model.to('cuda') on every rank, or on none) before "
            f"wrapping the optimizer")
    if comm.backend.name == "nccl":
        _refuse_shared_gpus([None if e is None else e[2] for e in every])
    return mine[0] if mine else None


def _refuse_shared_gpus(ids: Sequence[DeviceId | None]) -> None:
    """At wrap time: ranks whose parameters sit on one GPU (``model.to('cuda:0')`` on every rank)
    would meet NCCL's "Duplicate GPU detected" at the first collective (docs/backends.md#one-gpu-per-rank)."""
    groups = shared_devices(ids)
    if groups:
        d = ids[groups[0][0]]
        raise ConfigError(
            f"the wrapped parameters of ranks {', '.join(map(str, groups[0]))} are on one GPU "
            f"({d.device if d else '?'}), and NCCL needs one GPU per rank: move each rank's model to its own GPU "
            f"after init() (model.cuda() uses cuda:<local rank>, which init() made current, or "
            f"model.to(f'cuda:{{hvd.local_rank()}}')), or choose Gloo (init(backend=\"gloo\"))")


def native_backend() -> str:
    """The torch.distributed backend for this process's tensors: ``nccl`` with CUDA, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"
