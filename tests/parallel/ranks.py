"""Rank-side helpers for the scripts that tests/parallel's wrappers launch under ``mpirun``.

launch.py is the launching side (the pytest process that starts ``mpirun``); this module is what
every rank imports: the guard that skips a rank-side module outside ``mpirun``, the core
communicator on the backend the wrapper asked for (or tf_plugin, initialised), and the allgather
of every rank's rows that the oracles compare against. It imports neither torch nor the adapters
unless asked to.
"""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import env


def require_mpirun(launched_by: str, min_size: int = 2) -> None:
    """Skip the calling module (at import) unless it runs under ``mpirun -np >= min_size``.

    Collected on its own (no launcher, size 1) a rank-side module has nothing to check;
    ``launched_by`` names the wrapper test that runs it under ``mpirun``, for the skip message.
    """
    launch = env.detect_launch()
    if launch.launcher not in ("openmpi", "mpich") or launch.size < min_size:
        pytest.skip(f"runs under mpirun -np >= {min_size} (see {launched_by})", allow_module_level=True)


def init_comm():
    """The core communicator (``hvd_commopt.init()``) on the backend the wrapper asked for.

    ``HVD_COMMOPT_BACKEND=gloo`` (or ``nccl``) names a torch.distributed backend, which exists only
    once torch_plugin has registered it; importing torch_plugin does that (and nothing else here),
    so the NumPy-only runs under MPI never import torch.
    """
    if env.backend_name() in ("gloo", "nccl"):
        import torch_plugin  # noqa: F401  (registers the torch.distributed backends)
    import hvd_commopt as hvd

    return hvd.init()


def init_tf_plugin(launched_by: str):
    """tf_plugin, initialised on this rank, for a TF rank-side module (skipped without TF or mpirun).

    One TF thread per rank (2-core machine), set before TF's runtime starts: before any op runs.
    """
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    pytest.importorskip("mpi4py")
    require_mpirun(launched_by)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import tf_plugin

    tf_plugin.init()
    return tf_plugin


def gather_rows(comm, x):
    """Every rank's 1-D array or tensor (same length on every rank), as a ``size x n`` stack in
    rank order.

    A NumPy array comes back as a NumPy array, a torch tensor as a torch tensor: over a host-buffer
    backend (mpi) the tensor crosses as its NumPy view, over a native one (Gloo) as itself.
    """
    if isinstance(x, np.ndarray):
        out, _ = comm.allgather(np.ascontiguousarray(x))
        return out.reshape(comm.size, -1)
    if comm.buffer_kind == "numpy":
        import torch

        return torch.from_numpy(gather_rows(comm, x.numpy()))
    out, _ = comm.allgather(x.contiguous())
    return out.reshape(comm.size, -1)
