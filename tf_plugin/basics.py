"""Horovod's process queries as TensorFlow ops, the build-information queries, and the object
collectives: ``rank_op()`` & co., ``mpi_built()`` & co., ``allgather_object``,
``broadcast_object_fn``, ``broadcast_global_variables``.

The ``*_op()`` functions return int32 scalar tensors (constants: a process's rank and size do
not change while the runtime runs; Horovod's ops read the same values at run time).
"""
from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from hvd_commopt import collectives, runtime
from hvd_commopt.build_info import (ccl_built, cuda_built, ddl_built, gloo_enabled, mpi_built, mpi_enabled,
                                    mpi_threads_supported, nccl_built, rocm_built)
from hvd_commopt.errors import ConfigError
from hvd_commopt.join import join as _join
from hvd_commopt.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

from .functions import _comm, broadcast_object, broadcast_variables
from .ops import TFOps

__all__ = ["rank_op", "size_op", "local_rank_op", "local_size_op", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built", "ccl_built", "ddl_built",
           "cuda_built", "rocm_built", "allgather_object", "broadcast_object_fn", "broadcast_global_variables",
           "join", "barrier", "add_process_set", "remove_process_set", "ProcessSet", "global_process_set"]


def _op(value: int, name: str | None) -> tf.Tensor:
    return tf.constant(value, dtype=tf.int32, name=name)


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank as an int32 tensor."""
    return _op(runtime.rank(), name)


def size_op(name: str | None = None) -> tf.Tensor:
    """The number of processes as an int32 tensor."""
    return _op(runtime.size(), name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """The rank within this host as an int32 tensor."""
    return _op(runtime.local_rank(), name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of processes on this host as an int32 tensor."""
    return _op(runtime.local_size(), name)


def gloo_built(verbose: bool = False) -> bool:
    """False: the TensorFlow adapter has no Gloo collectives (Gloo is the torch adapter's)."""
    return False


def allgather_object(obj: Any, name: str | None = None, process_set=None, communicator=None) -> list:
    """Every rank's picklable ``obj``, in rank order (eager only, like ``broadcast_object``)."""
    if not tf.executing_eagerly():
        raise ConfigError("allgather_object runs eagerly only; call it outside tf.function")
    return list(collectives.allgather_object(_comm(communicator, process_set), obj, name=name or "allgather_object"))


def broadcast_object_fn(root_rank: int = 0, session=None, name: str | None = None, communicator=None) -> Callable:
    """A function ``obj -> root's obj`` (Horovod's TF1 helper; here it broadcasts eagerly)."""
    del session

    def _bcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name=name, communicator=communicator)
    return _bcast


def broadcast_global_variables(root_rank: int = 0):
    """Graph mode (TF1 style): the op that assigns root's values to every global variable.

    Raises:
        RuntimeError: (a ConfigError) in eager mode, where there are no global variables; use
            ``broadcast_variables(model.variables + optimizer.variables)``.
    """
    if tf.executing_eagerly():
        raise ConfigError("broadcast_global_variables() does not work in eager mode (TF2): call "
                          "hco.broadcast_variables(model.variables, root_rank) (and the optimizer's variables), "
                          "or use callbacks.BroadcastGlobalVariablesCallback with Keras")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def join(device: str = "", communicator=None) -> tf.Tensor:
    """This rank has no more data: take part (with zeros) in the allreduces the other ranks still
    run until every rank joined; returns the rank that joined last (an int32 tensor, the same on
    every rank). Eager only."""
    del device
    if not tf.executing_eagerly():
        raise ConfigError("join() runs eagerly only; call it outside tf.function")
    comm = communicator if communicator is not None else runtime.communicator()
    return tf.constant(_join(comm, TFOps(), tf.zeros([0])), dtype=tf.int32)


def barrier(process_set=None, communicator=None) -> None:
    """Wait until every rank (of the process set) calls barrier."""
    collectives.barrier(_comm(communicator, process_set))
