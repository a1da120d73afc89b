"""PyTorch adapter of hvd_commopt, with Horovod's names: change one import.

    import torch_plugin as hco
    hco.init()
    opt = hco.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hco.broadcast_parameters(model.state_dict(), root_rank=0)
    hco.broadcast_optimizer_state(opt, root_rank=0)
"""
from __future__ import annotations

from hvd_commopt import Compression, Schedule, runtime
from hvd_commopt.errors import (CollectiveTimeoutError, ConfigError, HvdCommoptError, RankFailedError,
                                RankMismatchError)

from .comm import TorchDistBackend, native_backend, register as _register_backends
from .functions import (allgather, allreduce, allreduce_, broadcast, broadcast_, broadcast_object,
                        broadcast_optimizer_state, broadcast_parameters)
from .ops import TorchOps
from .optimizer import Average, DistributedOptimizer, Sum

_register_backends()

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size", "DistributedOptimizer",
           "Compression", "Schedule", "Average", "Sum", "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "TorchOps", "TorchDistBackend",
           "HvdCommoptError", "CollectiveTimeoutError", "RankMismatchError", "RankFailedError", "ConfigError"]


def init(backend: str | None = None, timeout_s: float | None = None):
    """Start the runtime: backend from the argument, HVD_COMMOPT_BACKEND, else the tensors'
    own collectives under any launcher (NCCL with CUDA, else Gloo; MPI stays the control plane
    under mpirun), none -> size 1. Idempotent."""
    return runtime.init(backend, timeout_s, native=native_backend())


shutdown = runtime.shutdown
is_initialized = runtime.is_initialized
size = runtime.size
rank = runtime.rank
local_rank = runtime.local_rank
local_size = runtime.local_size
