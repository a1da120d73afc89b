"""What an engine must agree on with every other rank, as data for
:func:`~hvd_commopt.engine.specs.verify_same_settings` (docs/cross-rank-check.md#settings).

Ranks that differ in any of these issue different collectives (different bucket sizes, a sparse
exchange against a dense one, different k, a delayed round against a synchronous one) and
corrupt memory or hang, so each is compared once at wrap time, by value.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

from ..buckets import Bucket
from ..reduce.base import Reducer
from .ports import RoundSource
from .specs import Setting
from .tuner import FusionTuner

__all__ = ["SettingsPort", "CountsPerBucket", "engine_settings", "plan_setting", "DERIVED"]

SAME_ARG = "pass the same {} on every rank"
# Follows from the others and the tensors; reported only when nothing else differs.
DERIVED = ("bucket plan", "compression k per bucket")


def plan_setting(plan: Sequence[Sequence[int]], hint: str) -> Setting:
    return Setting([list(map(int, g)) for g in plan], hint)


@runtime_checkable
class SettingsPort(Protocol):
    """What the wrap-time check reads of the engine (implemented by :class:`~hvd_commopt.engine.CommEngine`)."""

    tuner: FusionTuner
    fusion_threshold: int
    fusion_threshold_source: str
    reducer: Reducer
    op: str
    gradient_predivide_factor: float
    scheduler: RoundSource | None


@runtime_checkable
class CountsPerBucket(Protocol):
    """A sparse reducer's selector that sends ``k_for(numel, bucket, step)`` values per bucket."""

    def k_for(self, numel: int, bucket: Bucket | None, step: int) -> int: ...


def _schedule(scheduler: RoundSource) -> Any:
    config = scheduler.config
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {"schedule": type(config).__name__, **dataclasses.asdict(config)}
    return repr(config)


def _k_per_bucket(reducer: Reducer, buckets: Sequence[Bucket]) -> Any:
    selector = reducer.compressor
    if not reducer.sparse or not isinstance(selector, CountsPerBucket):
        return None
    try:  # a per-layer density callable is compared through what it returns
        return [int(selector.k_for(b.numel, b, 0)) for b in buckets]
    except Exception as e:  # noqa: BLE001 - shown on every rank instead of raised on this one
        return f"error: {type(e).__name__}: {e}"


def engine_settings(engine: SettingsPort, plan: Sequence[Sequence[int]], buckets: Sequence[Bucket]) -> dict[str, Setting]:
    """The settings of ``engine`` (a :class:`~hvd_commopt.engine.CommEngine`) with ``plan``."""
    tuner = engine.tuner
    src = engine.fusion_threshold_source
    out: dict[str, Setting] = {}
    if tuner.strategy != "none":
        out["fusion_threshold"] = Setting(
            engine.fusion_threshold,
            "pass the same fusion_threshold= on every rank, or set HVD_COMMOPT_FUSION_THRESHOLD (or "
            "HOROVOD_FUSION_THRESHOLD) the same on every node",
            {"default": "default", "fusion_threshold=": "argument"}.get(src, f"from {src}"))
    out["fusion"] = Setting(tuner.strategy, SAME_ARG.format("fusion="))
    out["compression"] = Setting(engine.reducer.config(), SAME_ARG.format("compression=") +
                                 ": the same Compression.* call with the same arguments")
    out["op"] = Setting(engine.op, SAME_ARG.format("op="))
    out["gradient_predivide_factor"] = Setting(engine.gradient_predivide_factor,
                                               SAME_ARG.format("gradient_predivide_factor="))
    # backward_passes_per_step is not compared: each rank still closes one round per step, and a
    # rank with less memory may accumulate more, smaller passes (docs/cross-rank-check.md#settings)
    if tuner.planned:
        o = tuner.options
        out["fusion_options"] = Setting(
            {"warmup_steps": o.warmup_steps, "profile_steps": o.profile_steps, "measure_steps": o.measure_steps,
             "calibrate": dict(o.calibrate or {}), "cost_model given": o.cost_model is not None},
            SAME_ARG.format("fusion_options="))
    if engine.scheduler is not None:
        out["schedule"] = Setting(_schedule(engine.scheduler), SAME_ARG.format("schedule="))
    k = _k_per_bucket(engine.reducer, buckets)
    if k is not None:
        out["compression k per bucket"] = Setting(k, "make the density give the same value on every rank")
    out["bucket plan"] = plan_setting(plan, "build the same model and pass the same plan on every rank")
    return out
