"""Schedules: *when* gradients (or models) move and when they are applied (docs/README.md#summary).

User API: ``DistributedOptimizer(..., schedule=Schedule.ssd(delay=5, warmup_steps=500))`` with

* ``Schedule.sync()``: synchronous SGD (default);
* ``Schedule.od(...)``: OD-SGD, :mod:`.delayed`;
* ``Schedule.ssd(delay=k, ...)``: SSD-SGD, :mod:`.delayed` (OD-SGD is k = 1; k = 0 disables the delay);
* ``Schedule.cd(...)``: CD-SGD, :mod:`.cd`;
* ``Schedule.cocod(period)``: CoCoD-SGD, :mod:`.cocod`;
* ``Schedule.local_sgd(period)``: local SGD, :mod:`.local_sgd`;
* ``Schedule.diloco(period, outer=..., fragments=F, overlap=tau)``: DiLoCo / Streaming DiLoCo, :mod:`.diloco`.

:func:`build_scheduler` validates the combination with the engine's compression and returns the
scheduler; :func:`hvd_commopt.build_engine` attaches it to the engine. The adapter implements
:class:`~hvd_commopt.host.ScheduleHost` (see :mod:`hvd_commopt.host` for the division of labour
between core and adapter).
"""
from __future__ import annotations

from typing import Any

from ..autocompress.reducer import AutoReducer
from ..errors import ConfigError
from ..host import ScheduleHost
from ..reduce.base import Reducer
from ..reduce.dense import DenseAllreduce
from .base import RoundPlan, RoundPort, Scheduler
from .cd import CDScheduler
from .cocod import CoCoDScheduler
from ..reduce.adasum import AdasumReducer
from .averaging import uncompressed
from .config import AveragingConfig, CDConfig, DelayConfig, DiLoCoConfig, Schedule, SyncConfig
from .delayed import DelayedScheduler
from .diloco import DiLoCoScheduler
from .local_opt import LocalOptimizer
from .local_sgd import LocalSGDScheduler
from .sync import SyncScheduler

__all__ = ["Schedule", "SyncConfig", "DelayConfig", "CDConfig", "AveragingConfig", "build_scheduler",
           "Scheduler", "RoundPort", "ScheduleHost", "RoundPlan", "SyncScheduler", "DelayedScheduler",
           "CDScheduler", "CoCoDScheduler", "LocalSGDScheduler", "LocalOptimizer", "require_gradient_schedule",
           "DiLoCoConfig", "DiLoCoScheduler"]


def _compression_name(reducer: Reducer) -> str:
    if isinstance(reducer, DenseAllreduce):
        return reducer.compressor.name
    return reducer.name


def require_gradient_schedule(schedule: Any) -> None:
    """Refuse, with the fix, a schedule that updates weights itself (a replica, a local update,
    model averaging) where the caller only reduces gradients (TensorFlow's tape)."""
    if schedule is not None and not isinstance(schedule, SyncConfig):
        raise ConfigError(
            f"schedule {getattr(schedule, 'kind', schedule)!r} updates the weights itself (a global replica "
            f"and a local update, or model averaging), which a wrapper that only returns gradients cannot "
            f"do. Use the optimizer wrapper (tf_plugin.DistributedOptimizer(keras_optimizer, schedule=...)) "
            f"and give it this step's local gradients (a plain tape's) with apply_gradients.")


def build_scheduler(schedule: Any, port: RoundPort) -> Scheduler:
    """The scheduler for ``schedule`` (None = sync), after checking it against the engine.

    OD/SSD take every reducer, sparse ones included (docs/ssd-sgd.md#sparse-delayed): each round's
    bucket is selected with error feedback when it completes and exchanged while the next steps
    compute; the residual is keyed by bucket, not by round, so it stays exact across rounds in
    flight. Refused, with the reason (the papers define no such combination):

    CoCoD-SGD, local SGD and DiLoCo take every compressing reducer too: it then carries the
    pseudo-gradient, with its error feedback (docs/diloco.md#compressed). Refused, with the
    reason (the papers define no such combination):

    * CD-SGD with any ``compression=``: CD-SGD brings its own (ternary) compression.
    * Adasum with an averaging schedule: Adasum combines gradients, it does not average them.
    """
    if schedule is None:
        schedule = SyncConfig()
    reducer = port.reducer
    if isinstance(schedule, SyncConfig):
        return SyncScheduler(schedule, port)
    if isinstance(schedule, CDConfig):
        if not uncompressed(reducer):
            raise ConfigError(f"Schedule.cd() quantizes gradients itself (ternary signs, int8 allreduce); "
                              f"drop compression={_compression_name(reducer)!r} (use Compression.none)")
        return CDScheduler(schedule, port)
    if isinstance(schedule, DelayConfig):
        return DelayedScheduler(schedule, port)
    if isinstance(schedule, AveragingConfig):
        if isinstance(reducer, AutoReducer):  # docs/auto-compression.md#schedules
            raise ConfigError(f"Schedule.{schedule.kind}() sends a pseudo-gradient once a period, which "
                              f"compression='auto' (priced on the synchronous step) cannot choose for: "
                              f"drop compression='auto' and name one, e.g. Compression.topk(0.01) or "
                              f"Compression.quantize(4)")
        if isinstance(reducer, AdasumReducer):
            raise ConfigError(f"Schedule.{schedule.kind}() averages models (or their pseudo-gradients); Adasum "
                              f"does not average: use op=hco.Average")
        if isinstance(schedule, DiLoCoConfig):
            return DiLoCoScheduler(schedule, port)
        cls = CoCoDScheduler if schedule.kind == "cocod" else LocalSGDScheduler
        return cls(schedule, port)
    raise ConfigError(f"schedule must be a Schedule.* value (Schedule.sync(), Schedule.od(), Schedule.ssd(), "
                      f"Schedule.cd(), Schedule.cocod(period), Schedule.local_sgd(period), Schedule.diloco(period)), got {schedule!r}")
