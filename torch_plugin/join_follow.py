"""``join()`` on torch.distributed (Gloo, NCCL) under ``mpirun``: the joined rank follows the
others' collectives (docs/horovod_api.md#join).

The follower is MPI's (:func:`hvd_commopt.comm.mpi_join.follow`): it reads the peers' positions
from the MPI control plane's status responder (docs/backends.md#control-plane), where
:class:`~torch_plugin.comm.TorchDistBackend` marks each of its collectives with what a joined
rank needs to take part (:func:`described`). This module supplies only the part that differs:
taking part with torch zeros of the collective's dtype on its device (a CUDA collective on NCCL
needs a CUDA tensor, a CPU one Gloo's), through the backend's own methods, so the joined rank
takes the same transport as the others (the MPI lane for small CPU buffers, the pair sum, the
host staging of CUDA buffers on Gloo). Under ``torchrun`` there is no control plane: join() then
runs on the negotiation rounds only (:mod:`hvd_commopt.join`).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from hvd_commopt.comm import mpi_join
from hvd_commopt.errors import ConfigError

__all__ = ["ControlPlaneServices", "described", "follow"]


def described(buf: torch.Tensor, detail: Any) -> tuple:
    """What a joined rank needs to take part in a collective on ``buf``: (dtype, elements,
    ``detail`` (the reduce op, whether every rank sends as many, the root), device type)."""
    return (str(buf.dtype).removeprefix("torch."), buf.numel(), detail, buf.device.type)


def _zeros(dtype: str, n: int, device: str) -> torch.Tensor:
    on = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return torch.zeros(n, dtype=getattr(torch, dtype), device=on)


def take_part(be: Any, op: str, name: str, desc: Any, reply: bytes) -> None:
    """Run ``op`` on the TorchDistBackend ``be`` as a joined rank: zeros (an allreduce's sum is the
    others' sum), an empty part of an allgather (zeros where every rank promised its size: index 0
    with value 0 adds nothing), ``reply`` in an object exchange, the same barrier."""
    deadline = time.monotonic() + be._timeout.total_seconds()  # the others are in it already
    if op == "barrier":
        be.barrier(name, deadline)
        return
    if op == "allgather_object":
        be.allgather_host(np.frombuffer(reply, dtype=np.uint8).copy(), name, deadline)
        return
    dtype, n, detail, device = desc
    if op == "allreduce":
        be.allreduce_(_zeros(dtype, n, device), detail, name, deadline)
    elif op == "allgather" and detail:
        be.allgather_equal(_zeros(dtype, n, device), name, deadline)
    elif op == "allgather":
        be.allgather(_zeros(dtype, 0, device), name, deadline)
    elif op == "broadcast":
        be.broadcast_(_zeros(dtype, n, device), detail, name, deadline)
    elif op == "alltoall":
        be.alltoall(_zeros(dtype, 0, device), [0] * be.size, name, deadline)
    else:  # pragma: no cover - every kind TorchDistBackend marks with a description
        raise ConfigError(f"join(): no way to take part in a {op} ('{name}')")


def follow(be: Any, reply: bytes) -> int:
    """``join()`` on the TorchDistBackend ``be`` (which has a control plane): see the module docstring."""
    return mpi_join.follow(be.control, reply, lambda *call: take_part(be, *call))


class ControlPlaneServices:
    """TorchDistBackend's services of the MPI control plane (docs/backends.md#control-plane): the
    timeout diagnosis, the stall check, failure notices and join()'s follower; without a control
    plane (torchrun) the base class's defaults."""

    _control: Any

    def diagnose(self):
        return self._control.diagnose() if self._control is not None else super().diagnose()  # type: ignore[misc]

    def follow_joined(self, reply: bytes, deadline: float) -> int:
        return follow(self, reply)  # follows_joined: with a control plane (docs/horovod_api.md#join)

    def stalled(self, waited_s: float):
        return self._control.stalled(waited_s) if self._control is not None else None

    def peer_failure(self):
        return self._control.peer_failure() if self._control is not None else None

    def announce_failure(self, text: str) -> None:
        if self._control is not None:
            self._control.announce_failure(text)
