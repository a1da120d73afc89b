"""``fusion_options=``: the knobs of the planned fusion strategies (:mod:`.tuner` runs them).

Checked when built (a bad value fails at ``DistributedOptimizer(...)``, not after profiling);
:meth:`FusionOptions.coerce` takes a dict of fields as well, so adapters pass the user's value on
as is. :data:`FIRST_BUCKET_BYTES` is the default cap of the ``"threshold"`` plan's first bucket.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError
from ..fusion.cost_model import CostModel

__all__ = ["FusionOptions", "FIRST_BUCKET_BYTES"]

# DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES): the last layers' small
# gradients go out while backward still runs instead of waiting for a 25 MiB bucket to fill
# (docs/wrapper.md#first-bucket).
FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class FusionOptions:
    """Knobs of the planned strategies (``DistributedOptimizer(fusion_options=...)``, a dict works).

    Attributes:
        warmup_steps: steps run before profiling (allocation, first-touch); >= 0.
        profile_steps: steps whose gradient-ready times are recorded; >= 1 (MG-WFBP uses 50).
        measure_steps: steps timed with the new plan for the report; 0 = report without it.
        cost_model: a :class:`CostModel`, its ``to_dict()``, or the path of the JSON written by
            ``python -m hvd_commopt.calibrate --out`` (read on rank 0); None = calibrate.
        calibrate: keyword arguments of :func:`hvd_commopt.calibrate.calibrate` (sizes, repeats,
            warmup, statistic, ...).
        select_s: sparse reducers: OMGS's top-k cost coefficient; None = fit it on rank 0.
        resolution_s: sparse ``optimal``: the Pareto DP's resolution (0 = exact; see
            :func:`~hvd_commopt.fusion.exact.plan_optimal`).
        verbose: print the report once on rank 0; None = ``HVD_COMMOPT_VERBOSE``.
        first_bucket_bytes: ``"threshold"`` fusion of a dense reducer: cap of the first bucket
            (the last layers' gradients), so communication starts early in backward; None =
            DDP's 1 MiB (docs/wrapper.md#first-bucket), 0 = no separate cap.
        plan_file: pin the plan (docs/lags-omgs.md#pinned-plan): a JSON path. If it exists, rank 0
            reads it and every rank uses its plan as is (no profiling: two runs bucket alike);
            otherwise the plan is made as usual and rank 0 writes it there.
    """

    warmup_steps: int = 2
    profile_steps: int = 10
    measure_steps: int = 10
    cost_model: Any = None
    calibrate: Mapping[str, Any] | None = None
    select_s: float | None = None
    resolution_s: float = 1e-6
    verbose: bool | None = None
    first_bucket_bytes: int | None = None
    plan_file: str | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.profile_steps < 1 or self.measure_steps < 0:
            raise ConfigError(f"fusion options need warmup_steps >= 0, profile_steps >= 1 and "
                              f"measure_steps >= 0; got {self.warmup_steps}, {self.profile_steps}, "
                              f"{self.measure_steps}")
        if self.cost_model is not None and not isinstance(self.cost_model, (CostModel, Mapping, str)):
            raise ConfigError(f"cost_model must be a CostModel, its to_dict(), or a JSON path; got "
                              f"{type(self.cost_model).__name__}")

    @classmethod
    def coerce(cls, value: Any, **overrides: Any) -> FusionOptions:
        """``value`` (None, a dict of fields, or FusionOptions) with ``overrides`` that are not None."""
        if value is None:
            value = {}
        if isinstance(value, cls):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}
        if not isinstance(value, Mapping):
            raise ConfigError(f"fusion_options must be a dict or FusionOptions, got {type(value).__name__}")
        value = {**value, **{k: v for k, v in overrides.items() if v is not None}}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown fusion option(s) {unknown}; valid: {sorted(known)}")
        return cls(**value)
