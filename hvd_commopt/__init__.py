"""hvd_commopt: communication optimisation for data-parallel training, framework-neutral core.

This package imports neither torch nor tensorflow; the adapters ``torch_plugin`` and
``tf_plugin`` supply tensor ops and gradient hooks. See README.md for the user API.
"""
from __future__ import annotations

from .builder import build_engine
from .comm import Communicator, Handle, InProcWorld, run_ranks
from .compression import Compression
from .engine import CommEngine, TensorSpec
from .errors import (CollectiveTimeoutError, ConfigError, HvdCommoptError, LaunchEnvironmentError,
                     NonFiniteGradientError, RankFailedError, RankMismatchError)
from .host import GradientCapture, ScheduleHost
from .numpy_ops import NumpyOps
from .reduce import Average, Sum
from .runtime import communicator, init, is_initialized, local_rank, local_size, rank, shutdown, size
from .schedule import Schedule

__version__ = "0.1.0"

__all__ = [
    "__version__", "init", "shutdown", "is_initialized", "communicator", "rank", "size", "local_rank",
    "local_size", "Communicator", "Handle", "InProcWorld", "run_ranks", "Compression", "CommEngine",
    "build_engine", "TensorSpec", "NumpyOps", "ScheduleHost", "GradientCapture", "Average", "Sum",
    "HvdCommoptError", "CollectiveTimeoutError", "RankMismatchError", "RankFailedError",
    "LaunchEnvironmentError", "NonFiniteGradientError",
    "ConfigError", "Schedule",
]
