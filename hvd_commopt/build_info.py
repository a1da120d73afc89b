"""Horovod's build-information queries (``mpi_built()``, ``nccl_built()``, ...), answered for
hvd_commopt: what this installation and this job can use. Horovod's answers are about the
compiled library; ours are about the Python packages present and the backend ``init()`` chose,
which is what scripts use them for (choosing a code path or skipping a test).
"""
from __future__ import annotations

import importlib.util

from . import runtime

__all__ = ["mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
           "mpi_enabled", "gloo_enabled", "mpi_threads_supported"]


def mpi_built(verbose: bool = False) -> bool:
    """True when mpi4py (the MPI backend's binding) is installed."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_built(verbose: bool = False) -> bool:
    """True when torch.distributed is installed (the gloo backend comes with it)."""
    return importlib.util.find_spec("torch") is not None


def nccl_built(verbose: bool = False) -> int:
    """0: collectives on NCCL go through torch.distributed's own NCCL, not a Horovod NCCL build
    (Horovod returns its NCCL version, or 0)."""
    return 0


def ddl_built(verbose: bool = False) -> bool:
    return False


def ccl_built(verbose: bool = False) -> bool:
    return False


def cuda_built(verbose: bool = False) -> bool:
    """False: hvd_commopt has no CUDA kernels of its own (GPU tensors use the framework's)."""
    return False


def rocm_built(verbose: bool = False) -> bool:
    return False


def _backend() -> str | None:
    return runtime.communicator().backend.name if runtime.is_initialized() else None


def mpi_enabled() -> bool:
    """True when init() chose the MPI backend."""
    return _backend() == "mpi"


def gloo_enabled() -> bool:
    """True when init() chose the gloo backend."""
    return _backend() == "gloo"


def mpi_threads_supported() -> bool:
    """True when the MPI library gives MPI_THREAD_MULTIPLE (needed only for the timeout diagnosis)."""
    if not mpi_enabled():
        return False
    from mpi4py import MPI  # noqa: PLC0415 - only with the MPI backend
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE
