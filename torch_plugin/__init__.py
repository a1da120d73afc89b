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
from hvd_commopt.process_sets import add_at_init
from hvd_commopt.reduce import Adasum, Max, Min, Product

from .api import (ProcessSet, add_process_set, barrier, ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                  global_process_set, join, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                  remove_process_set, rocm_built)
from .async_ops import (allgather_async, allreduce_async, allreduce_async_, alltoall_async, broadcast_async,
                        broadcast_async_, grouped_allgather_async, grouped_allreduce_async, grouped_allreduce_async_,
                        grouped_reducescatter_async, poll, reducescatter_async, sparse_allreduce_async, synchronize)
from .comm import TorchDistBackend, native_backend, register as _register_backends
from .functions import (allgather, allgather_object, allreduce, allreduce_, alltoall, broadcast, broadcast_,
                        broadcast_object, broadcast_optimizer_state, broadcast_parameters, grouped_allgather,
                        grouped_allreduce, grouped_allreduce_, grouped_reducescatter, reducescatter)
from .ops import TorchOps
from .optimizer import Average, DistributedOptimizer, Sum
from .outer import TorchOuter  # noqa: F401  (registers torch.optim classes as DiLoCo outer optimizers)
from .sync_batch_norm import SyncBatchNorm

_register_backends()

# Horovod's name for "a collective failed; the job cannot go on" (elastic training catches it).
HorovodInternalError = HvdCommoptError

__all__ = ["init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
           "size", "rank", "local_rank", "local_size", "DistributedOptimizer",
           "Compression", "Schedule", "Average", "Sum", "Min", "Max", "Product", "Adasum",
           "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allgather", "alltoall", "reducescatter", "grouped_reducescatter",
           "allgather_object", "allreduce_async", "allreduce_async_", "allgather_async", "broadcast_async",
           "broadcast_async_", "alltoall_async", "reducescatter_async", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_allgather_async", "grouped_reducescatter_async",
           "sparse_allreduce_async", "poll", "synchronize", "join", "barrier", "ProcessSet", "global_process_set",
           "add_process_set", "remove_process_set", "SyncBatchNorm", "mpi_built", "gloo_built", "nccl_built",
           "ddl_built", "ccl_built", "cuda_built", "rocm_built", "mpi_enabled", "gloo_enabled",
           "mpi_threads_supported", "TorchOps", "TorchDistBackend", "HvdCommoptError", "HorovodInternalError",
           "CollectiveTimeoutError", "RankMismatchError", "RankFailedError", "ConfigError"]


def init(backend: str | None = None, timeout_s: float | None = None, process_sets=None):
    """Start the runtime: backend from the argument, HVD_COMMOPT_BACKEND, else the tensors'
    own collectives under any launcher (NCCL with CUDA, else Gloo; MPI stays the control plane
    under mpirun), none -> size 1. Idempotent. ``process_sets``: lists of ranks (or ProcessSets)
    to register at once, as Horovod's ``init(process_sets=...)`` (``"dynamic"`` is accepted:
    sets may always be added later)."""
    comm = runtime.init(backend, timeout_s, native=native_backend())
    add_at_init(process_sets)
    return comm


shutdown = runtime.shutdown
is_initialized = runtime.is_initialized
start_timeline = runtime.start_timeline
stop_timeline = runtime.stop_timeline
size = runtime.size
rank = runtime.rank
local_rank = runtime.local_rank
local_size = runtime.local_size
