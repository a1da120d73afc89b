"""Communicators: a blocking :class:`Backend` per transport, made asynchronous once by
:class:`Communicator`. Backends here: ``mpi`` (mpi4py), ``inproc`` (threads, for tests) and
``local`` (size 1). Framework-native backends (torch.distributed) live in the adapters and
register themselves with :func:`register_backend`."""
from __future__ import annotations

from typing import Callable

from ..errors import ConfigError
from .base import REDUCE_OPS, Backend
from .communicator import Communicator, TrafficCounter
from .handle import Handle
from .inproc import InProcBackend, InProcWorld, run_ranks

__all__ = ["Backend", "Communicator", "Handle", "TrafficCounter", "InProcWorld", "InProcBackend",
           "run_ranks", "REDUCE_OPS", "register_backend", "create_backend", "backend_names"]

_FACTORIES: dict[str, Callable[..., Backend]] = {}
# Backends an adapter provides: asking for one before its adapter is imported names the fix.
_ADAPTER_BACKENDS = {"gloo": "torch", "nccl": "torch"}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make ``init(backend=name)`` build ``factory(timeout_s=..., chosen=...)`` (adapters register
    torch.distributed here; the timeout is the communicator's, so the transport's own waits end
    when ours do; ``chosen``: the runtime chose the backend, the user did not name it)."""
    _FACTORIES[name] = factory


def backend_names() -> list[str]:
    return sorted(set(_FACTORIES) | {"mpi", "local"})


def create_backend(name: str, timeout_s: float | None = None, chosen: bool = False) -> Backend:
    if name == "mpi":
        from .mpi import MPIBackend
        return MPIBackend()
    if name == "local":
        return InProcBackend(InProcWorld(1), 0)
    if name in _FACTORIES:
        return _FACTORIES[name](timeout_s=timeout_s, chosen=chosen)
    if name in _ADAPTER_BACKENDS:
        raise ConfigError(
            f"backend {name!r} is torch.distributed's and needs PyTorch: pip install torch and start with "
            f"torch_plugin's init() (import torch_plugin as hco; hco.init()), or choose "
            f"HVD_COMMOPT_BACKEND=mpi (TensorFlow and NumPy tensors run on MPI)")
    raise ConfigError(f"unknown backend {name!r}; available: {backend_names()} "
                      f"(gloo/nccl appear once torch_plugin is imported)")
