"""TensorFlow 2 / Keras 3 adapter of hvd_commopt, with Horovod's names: change one import.

    import tf_plugin as hco
    hco.init()
    # custom loop
    tape = hco.DistributedGradientTape(tape, compression=hco.Compression.fp16)
    grads = tape.gradient(loss, model.trainable_variables)
    # Keras 3
    opt = hco.DistributedOptimizer(keras.optimizers.SGD(0.01 * hco.size()))
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(x, y, callbacks=[hco.callbacks.BroadcastGlobalVariablesCallback(0),
                               hco.callbacks.MetricAverageCallback()])

The adapter only supplies tensor ops (:class:`TFOps`) and glue; the engine, compressors, fusion
planners and schedules are the core's (:mod:`hvd_commopt`), shared with ``torch_plugin``.
Collectives run eagerly, or as one ``tf.py_function`` per call site inside ``tf.function``
(:mod:`tf_plugin.bridge` explains the strategy and its cost).
"""
from __future__ import annotations

import tensorflow as tf

from hvd_commopt import Compression, Schedule, runtime
from hvd_commopt.process_sets import add_at_init
from hvd_commopt.tensor_ops import register_ops
from hvd_commopt.errors import (CollectiveTimeoutError, ConfigError, HvdCommoptError, RankFailedError,
                                RankMismatchError)
from hvd_commopt.reduce import Adasum, Average, Max, Min, Product, Sum

from . import callbacks, util
from .basics import (ProcessSet, add_process_set, allgather_object, barrier, broadcast_global_variables,
                     broadcast_object_fn, ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                     global_process_set, join, local_rank_op, local_size_op, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                     rank_op, remove_process_set, rocm_built, size_op)
from .errors import CollectiveMismatchError
from .functions import allgather, allreduce, broadcast, broadcast_, broadcast_object, broadcast_variables
from .grouped import alltoall, grouped_allgather, grouped_allreduce, grouped_reducescatter, reducescatter
from .keras import DistributedOptimizer
from .ops import TFOps
from .reducer import clear_engines as _clear_engines
from .tape import DistributedGradientTape, PartialDistributedGradientTape

__all__ = ["init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
           "size", "rank", "local_rank", "local_size",
           "DistributedGradientTape", "DistributedOptimizer", "Compression", "Schedule", "Average", "Sum", "Adasum",
           "allreduce", "allgather", "broadcast", "broadcast_variables", "broadcast_object", "callbacks",
           "TFOps", "HvdCommoptError", "CollectiveTimeoutError", "RankMismatchError", "RankFailedError", "ConfigError",
           "CollectiveMismatchError", "rank_op", "size_op", "local_rank_op", "local_size_op", "allgather_object",
           "broadcast_object_fn", "broadcast_global_variables", "mpi_built", "mpi_enabled", "mpi_threads_supported",
           "gloo_built", "gloo_enabled", "nccl_built", "ccl_built", "ddl_built", "cuda_built", "rocm_built", "util",
           "Min", "Max", "Product", "broadcast_", "alltoall", "grouped_allgather", "grouped_allreduce",
           "grouped_reducescatter", "reducescatter", "join", "barrier", "add_process_set", "remove_process_set",
           "ProcessSet", "global_process_set", "PartialDistributedGradientTape", "SyncBatchNormalization"]


def init(backend: str | None = None, timeout_s: float | None = None, process_sets=None):
    """Start the runtime: backend from the argument, HVD_COMMOPT_BACKEND, or the launcher
    (mpirun -> mpi, none -> size 1). Idempotent. ``process_sets``: lists of ranks (or
    ProcessSets) to register at once, as Horovod's ``init(process_sets=...)`` (``"dynamic"`` is
    accepted: sets may always be added later)."""
    comm = runtime.init(backend, timeout_s)
    add_at_init(process_sets)
    return comm


def shutdown() -> None:
    """Stop the runtime and forget the cached engines (``init()`` may be called again)."""
    _clear_engines()
    runtime.shutdown()


is_initialized = runtime.is_initialized
start_timeline = runtime.start_timeline
stop_timeline = runtime.stop_timeline
size = runtime.size
rank = runtime.rank
local_rank = runtime.local_rank
local_size = runtime.local_size

# Horovod's compressor interface called without ops (Compression.fp16.compress(tensor)) finds
# TFOps through the core's registry.
register_ops(tf.Tensor, TFOps())
register_ops(tf.Variable, TFOps())
_executing_eagerly = util._executing_eagerly  # Horovod's TF module exposes it; its tests call it


def __getattr__(name: str):
    # SyncBatchNormalization needs Keras, imported only when used (like DistributedOptimizer's).
    if name == "SyncBatchNormalization":
        from .sync_batch_norm import SyncBatchNormalization  # noqa: PLC0415
        return SyncBatchNormalization
    raise AttributeError(f"module 'tf_plugin' has no attribute {name!r}")
