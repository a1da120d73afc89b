"""One GPU per rank under NCCL: which ranks would share a device (docs/backends.md#one-gpu-per-rank).

NCCL refuses two ranks of one communicator on one GPU, but only when the first CUDA collective
creates the communicator, with its own words ("Duplicate GPU detected") and from inside whatever
call came first (``broadcast_parameters`` in a Horovod script). The ranks' device ids are
exchanged over the host side of the process group when the backend starts, and
:func:`check_one_device_per_rank` decides from them alone, before any CUDA collective: a pure
function of the ids, so a test gives it any ids it likes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hvd_commopt.errors import ConfigError

__all__ = ["DeviceId", "shared_devices", "check_one_device_per_rank"]


@dataclass(frozen=True)
class DeviceId:
    """Where a rank's device is. ``host`` and ``device`` identify it across processes: ``device``
    is the GPU's UUID where the framework gives one, else the visible-device list and index (two
    processes with the same list and index use the same GPU). ``index`` is the ``cuda:<index>``
    the rank uses in its own process, for the message."""

    host: str
    device: str
    index: int


def shared_devices(ids: Sequence[DeviceId | None]) -> list[list[int]]:
    """The groups of ranks (each sorted, the groups by their first rank) whose ids name one
    device on one host; ranks with no id (None: no accelerator) share nothing."""
    owners: dict[tuple[str, str], list[int]] = {}
    for r, d in enumerate(ids):
        if d is not None:
            owners.setdefault((d.host, d.device), []).append(r)
    return sorted((rs for rs in owners.values() if len(rs) > 1), key=lambda rs: rs[0])


def check_one_device_per_rank(ids: Sequence[DeviceId | None], backend: str = "nccl") -> None:
    """Raise one ConfigError, the same on every rank, when two ranks would share a GPU.

    Raises:
        ConfigError: naming the ranks and their device, and the fixes: one GPU per rank (as many
            ranks per host as GPUs, ``--nproc-per-node`` / ``-np``, or one ``CUDA_VISIBLE_DEVICES``
            entry per rank), or Gloo, which may share a GPU (``backend="gloo"`` /
            ``HVD_COMMOPT_BACKEND=gloo``).
    """
    groups = shared_devices(ids)
    if not groups:
        return
    first = groups[0]
    where = "; ".join(f"ranks {', '.join(map(str, g))} on {d.host if (d := ids[g[0]]) else '?'}" for g in groups)
    d = ids[first[0]] or DeviceId("?", "?", -1)  # never None: shared_devices skips ranks without one
    raise ConfigError(
        f"{len(first)} ranks would share one GPU (cuda:{d.index}, {d.device}) under {backend}: {where}. "
        f"{backend.upper()} needs one GPU per rank: start at most as many ranks per host as it has GPUs "
        f"(torchrun --nproc-per-node, mpirun -np / -H host:slots), or give each rank its own GPU with "
        f"CUDA_VISIBLE_DEVICES; to run several ranks on one GPU, choose Gloo: init(backend=\"gloo\") "
        f"or HVD_COMMOPT_BACKEND=gloo (CUDA tensors are then staged through host memory, "
        f"docs/backends.md#cuda-on-gloo)")
