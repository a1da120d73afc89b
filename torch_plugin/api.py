"""Horovod's remaining torch API over the core: build queries, join, barrier, process sets."""
from __future__ import annotations

import torch

from hvd_commopt import collectives, runtime
from hvd_commopt.build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                                    mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from hvd_commopt.join import join as _join
from hvd_commopt.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

from . import functions as F

__all__ = ["mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
           "mpi_enabled", "gloo_enabled", "mpi_threads_supported", "join", "barrier", "ProcessSet",
           "global_process_set", "add_process_set", "remove_process_set"]


def join(device: int = -1) -> int:
    """This rank has no more data: take part (with zeros) in the allreduces the other ranks still
    run until every rank has joined; returns the rank that joined last, on every rank."""
    like = torch.empty(0, device=f"cuda:{device}") if device >= 0 and torch.cuda.is_available() else None
    return _join(runtime.communicator(), F._ops, like)


def barrier(process_set: ProcessSet | None = None) -> None:
    """Wait until every rank (of the process set) calls barrier."""
    collectives.barrier(F._comm(None, process_set))
