"""``build_engine``: the one place that puts an engine and its scheduler together.

The engine (:mod:`hvd_commopt.engine`) knows buckets, rounds and reducers; the schedulers
(:mod:`hvd_commopt.schedule`) know steps. Neither imports the other's module: the scheduler drives
the engine through its round port, the engine calls the scheduler through a protocol. This
function composes them into a :class:`~hvd_commopt.engine.trainer.Trainer` (the object adapters
train through) and checks the combinations that involve both.
"""
from __future__ import annotations

from typing import Any

from .comm.communicator import Communicator
from .engine.engine import CommEngine
from .engine.trainer import Trainer
from .engine.tuner import PLANNED
from .errors import ConfigError
from .reduce.base import Average
from .schedule import SyncScheduler, build_scheduler
from .streams import DeviceStreams
from .tensor_ops import TensorOps

__all__ = ["build_engine"]


def build_engine(comm: Communicator, ops: TensorOps, *, schedule: Any = None, compression: Any = None,
                 fusion_threshold: int | None = None, op: str = Average, gradient_predivide_factor: float = 1.0,
                 backward_passes_per_step: int = 1, fusion: str = "threshold", fusion_options: Any = None,
                 streams: DeviceStreams | None = None) -> Trainer:
    """An engine with the scheduler of ``schedule`` attached, both held by the returned Trainer.

    Args: those of :class:`~hvd_commopt.engine.CommEngine`, plus ``schedule``: a ``Schedule.*``
    config (default ``Schedule.sync()``; see :mod:`hvd_commopt.schedule`). Combinations the
    papers do not support are refused here, with the reason. ``streams`` is the adapter's
    (CUDA tensors: docs/backends.md#cuda-streams), not a user's option.
    """
    engine = CommEngine(comm, ops, compression=compression, fusion_threshold=fusion_threshold, op=op,
                        gradient_predivide_factor=gradient_predivide_factor,
                        backward_passes_per_step=backward_passes_per_step, fusion=fusion,
                        fusion_options=fusion_options, streams=streams)
    scheduler = build_scheduler(schedule, engine)
    if fusion in PLANNED and not isinstance(scheduler, SyncScheduler):
        raise ConfigError(f"fusion={fusion!r} plans buckets from profiled synchronous steps; with schedule "
                          f"'{scheduler.name}' use fusion='threshold' or 'none'")
    return Trainer(engine, scheduler, scheduler)
