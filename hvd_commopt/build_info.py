"""Horovod's build-information queries (``mpi_built()``, ``nccl_built()``, ...), answered for
hvd_commopt: which transports this installation can use and which one the runtime chose.

Horovod answers them from its compiled extension; code written for Horovod calls them to decide
what to run or skip (``if hvd.nccl_built(): ...``). hvd_commopt has no compiled collectives of its
own: MPI is mpi4py, Gloo and NCCL are torch.distributed's (the torch adapter's backends). So:

* ``mpi_built()``: mpi4py can be imported. ``mpi_enabled()``: the running backend is MPI.
* ``gloo_built()`` / ``nccl_built()``: the adapter passes whether its framework offers them
  (TensorFlow: no; torch: torch.distributed's availability). ``nccl_built()`` returns an int like
  Horovod (0 when absent, else 1: no NCCL version is linked here).
* ``ccl_built``, ``ddl_built``, ``cuda_built``, ``rocm_built``: False (no compiled GPU kernels:
  the frameworks' own tensors and collectives are used).
"""
from __future__ import annotations

import importlib.util

from . import runtime

__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "ccl_built", "ddl_built", "cuda_built", "rocm_built"]


def mpi_built() -> bool:
    """True when mpi4py is installed (the MPI backend can run)."""
    return importlib.util.find_spec("mpi4py") is not None


def _backend() -> str | None:
    return getattr(runtime.communicator().backend, "name", None) if runtime.is_initialized() else None


def mpi_enabled() -> bool:
    """True when ``init()`` chose the MPI backend."""
    return _backend() == "mpi"


def mpi_threads_supported() -> bool:
    """True with MPI: the backend's progress thread calls MPI (it requires MPI_THREAD_MULTIPLE)."""
    return mpi_built()


def gloo_built(available: bool = False) -> bool:
    return bool(available)


def gloo_enabled() -> bool:
    """True when ``init()`` chose torch.distributed's Gloo backend."""
    return _backend() == "gloo"


def nccl_built(available: bool = False) -> int:
    return 1 if available else 0


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False
