"""Schedules: *when* gradients (or models) move and when they are applied (issue 4; spec §2.3-§6).

User API: ``DistributedOptimizer(..., schedule=Schedule.ssd(delay=5, warmup_steps=500))`` with

* ``Schedule.sync()``: synchronous SGD (default);
* ``Schedule.od(...)``: OD-SGD, :mod:`.delayed`;
* ``Schedule.ssd(delay=k, ...)``: SSD-SGD, :mod:`.delayed` (OD-SGD is k = 1; k = 0 disables the delay);
* ``Schedule.cd(...)``: CD-SGD, :mod:`.cd`;
* ``Schedule.cocod(period)``: CoCoD-SGD, :mod:`.cocod`;
* ``Schedule.local_sgd(period)``: local SGD, :mod:`.local_sgd`.

:func:`build_scheduler` validates the combination with the engine's compression and returns the
scheduler the engine drives. The adapter implements :class:`ScheduleHost` (see :mod:`.base` for
the division of labour between core and adapter).
"""
from __future__ import annotations

from typing import Any

from ..compress.cast import NoneCompressor
from ..errors import ConfigError
from ..reduce.dense import DenseAllreduce
from .base import RoundPlan, ScheduleHost, Scheduler
from .cd import CDScheduler, TernaryAllreduce
from .cocod import CoCoDScheduler
from .config import AveragingConfig, CDConfig, DelayConfig, Schedule, SyncConfig
from .delayed import DelayedScheduler
from .local_opt import LocalOptimizer
from .local_sgd import LocalSGDScheduler
from .ops import NumpyUpdateOps, UpdateOps
from .sync import SyncScheduler

__all__ = ["Schedule", "SyncConfig", "DelayConfig", "CDConfig", "AveragingConfig", "build_scheduler",
           "Scheduler", "ScheduleHost", "RoundPlan", "SyncScheduler", "DelayedScheduler", "CDScheduler",
           "CoCoDScheduler", "LocalSGDScheduler", "LocalOptimizer", "TernaryAllreduce", "UpdateOps",
           "NumpyUpdateOps"]


def _compression_name(reducer: Any) -> str:
    if isinstance(reducer, DenseAllreduce):
        return reducer.compressor.name
    return getattr(reducer, "name", type(reducer).__name__)


def build_scheduler(schedule: Any, engine: Any) -> Scheduler:
    """The scheduler for ``schedule`` (None = sync), after checking it against the engine.

    Refused, with the reason (the papers define no such combination):

    * OD/SSD with a sparse exchange (Top-k, DGC, gTop-k): the delay is defined on dense
      gradients; fp16/bf16 casts are fine (still a dense allreduce).
    * CD-SGD with any ``compression=``: CD-SGD brings its own (ternary) compression.
    * CoCoD-SGD / local SGD with any ``compression=``: they average models, not gradients.
    """
    if schedule is None:
        schedule = SyncConfig()
    reducer = engine.reducer
    dense = isinstance(reducer, DenseAllreduce)
    uncompressed = dense and isinstance(reducer.compressor, NoneCompressor)
    if isinstance(schedule, SyncConfig):
        return SyncScheduler(schedule, engine)
    if isinstance(schedule, CDConfig):
        if not uncompressed:
            raise ConfigError(f"Schedule.cd() quantizes gradients itself (ternary signs, int8 allreduce); "
                              f"drop compression={_compression_name(reducer)!r} (use Compression.none)")
        return CDScheduler(schedule, engine)
    if isinstance(schedule, DelayConfig):
        if not dense:
            raise ConfigError(
                f"Schedule.{schedule.kind}() with the sparse exchange {_compression_name(reducer)!r} is not "
                f"supported: OD/SSD-SGD delay dense gradients and the papers define no sparse variant. "
                f"Use Schedule.cd() for delay with compression, or Schedule.sync() with sparse compression.")
        return DelayedScheduler(schedule, engine)
    if isinstance(schedule, AveragingConfig):
        if not uncompressed:
            raise ConfigError(f"Schedule.{schedule.kind}() averages models, not gradients; "
                              f"drop compression={_compression_name(reducer)!r} (use Compression.none)")
        cls = CoCoDScheduler if schedule.kind == "cocod" else LocalSGDScheduler
        return cls(schedule, engine)
    raise ConfigError(f"schedule must be a Schedule.* value (Schedule.sync(), Schedule.od(), Schedule.ssd(), "
                      f"Schedule.cd(), Schedule.cocod(period), Schedule.local_sgd(period)), got {schedule!r}")
