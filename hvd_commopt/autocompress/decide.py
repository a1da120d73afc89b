"""Rank 0's decision of ``compression="auto"``: from the profile to the assignment and its report.

:func:`decide` turns what the policy measured (:class:`Profile`: per bucket the backward gap and
the time its ``start`` took, the step's period) plus the link model and each candidate's measured
compute into the per-bucket choice (:func:`~hvd_commopt.autocompress.choose.choose`) and the report
(docs/auto-compression.md#report). It takes the candidates' compute as a function, so the timing
(:mod:`.local_cost`, on the adapter's tensors) stays with the policy and this module holds no state.

The report gives, per bucket, the method in use while profiled, its price measured alone and the
time its ``start`` took in the step (docs/auto-compression.md#in-situ).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..fusion.cost_model import CostModel
from .choose import DENSE, choose, predict
from .options import AutoOptions, Method
from .pricing import SelectFit, bucket_costs

__all__ = ["Profile", "decide", "candidates", "measured_methods", "TRIALS"]

#: How many uniform assignments are measured after a decision, at most (docs/auto-compression.md#trial).
TRIALS = 2


@dataclass(frozen=True)
class Profile:
    """The profiled steps, medians per bucket (seconds): ``gaps[b]`` the compute before bucket b's
    launch, ``starts[b]`` the time its ``start`` took with the method then in use, ``period`` the
    step; ``steps`` how many were profiled (0 before step 0, where every figure is 0)."""

    gaps: tuple[float, ...]
    starts: tuple[float, ...]
    period: float
    steps: int

    @classmethod
    def of(cls, samples: Sequence[tuple[float, Sequence[float], Sequence[float]]], nbuckets: int) -> Profile:
        """Medians of ``(period, gaps, starts)`` samples, one per profiled step."""
        gaps = tuple(statistics.median(s[1][b] for s in samples) for b in range(nbuckets))
        starts = tuple(statistics.median(s[2][b] for s in samples) for b in range(nbuckets))
        return cls(gaps, starts, statistics.median(s[0] for s in samples), len(samples))


def candidates(buckets: Sequence[Any], options: AutoOptions, *, ranks: int, adaptive: bool,
               banned: set[tuple[str, str]]) -> tuple[dict[str, tuple[Method, ...]], list[tuple[bool, str]]]:
    """Per bucket, the methods the decision may give it (dense fp32 always), and per bucket whether
    a compressor applies and, if not or if restricted, why. A pure function of what every rank
    holds alike, so every rank can name the methods whose compute is measured
    (docs/auto-compression.md#costs-every-rank)."""
    notes = []
    for b in buckets:
        if b.dtype != "float32":
            notes.append((False, f"{b.dtype} gradients: the casts and sparse methods here take float32"))
        elif b.dense:
            notes.append((True, "1-D tensors, sent whole (docs/topk.md#dense-1d)"))
        elif adaptive:
            notes.append((True, "Adam-type optimizer: sparse methods are not candidates "
                                "(docs/auto-compression.md#adaptive)"))
        else:
            notes.append((True, ""))
    if ranks == 1:
        return {b.name: (DENSE,) for b in buckets}, [(False, "one rank: nothing is sent")] * len(buckets)
    cands = {b.name: tuple(m for m in (options.candidates(sparse_ok=not (b.dense or adaptive)) if ok else (DENSE,))
                           if m == DENSE or (b.name, m.kind) not in banned) for b, (ok, _) in zip(buckets, notes)}
    return cands, notes


def measured_methods(buckets: Sequence[Any], cands: dict[str, tuple[Method, ...]]) -> tuple[list[Method], int]:
    """The methods whose compute :func:`decide` measures (every candidate but dense fp32, least
    lossy first) and the largest bucket's elements, the largest size measured."""
    methods = sorted({m for ms in cands.values() for m in ms if m != DENSE}, key=lambda m: m.lossiness)
    return methods, max((b.numel for b in buckets), default=1)


def decide(buckets: Sequence[Any], profile: Profile, current: Sequence[Method], cost: CostModel,
           options: AutoOptions, fits_for: Callable[[Sequence[Method], int], dict[str, SelectFit]], *,
           ranks: int, adaptive: bool, banned: set[tuple[str, str]], comm_cpu: float,
           kinds: str = "") -> dict[str, Any]:
    """``{"assignment", "report", "warning", "alternatives"}`` of the engine's ``buckets`` (name, numel, dtype,
    dense), the current methods ``current`` and the ``profile``; ``fits_for(methods, max_numel)``
    measures the candidates' compute (:func:`.local_cost.measure_local_costs`); ``banned`` are
    (bucket, kind) pairs measured slower than predicted (docs/auto-compression.md#revert);
    ``alternatives`` are the (at most :data:`TRIALS`) fastest predicted uniform assignments (each
    bucket that cannot take the method dense) that differ from the decision and are predicted
    within ``options.margin`` of it, which the policy measures after it. ``kinds``: the line on
    the optimizer and model kinds read and the candidates they gave (docs/auto-compression.md#kinds)."""
    cands, notes = candidates(buckets, options, ranks=ranks, adaptive=adaptive, banned=banned)
    warning = None
    if ranks > 1 and not any(ok for ok, _ in notes):
        warning = (f"compression='auto': no compressor applies to these gradients ({notes[0][1]}); "
                   f"sending them dense")
    methods, max_numel = measured_methods(buckets, cands)
    fits = fits_for(methods, max_numel)
    costs = [bucket_costs(b.name, b.numel * 4, profile.gaps[i], cands[b.name], cost, fits, notes[i][1])
             for i, b in enumerate(buckets)]
    current = [m if m in c.costs else DENSE for m, c in zip(current, costs)]
    update_s = max(0.0, profile.period - predict(costs, current, comm_cpu=comm_cpu).iteration_time)
    choice = choose(costs, update_s, comm_cpu=comm_cpu)
    report = {
        "phase": "decided", "profiled_steps": profile.steps, "profiled_period_s": profile.period, "update_s": update_s,
        "comm_cpu": comm_cpu, "predicted_s": choice.predicted_s, "dense_predicted_s": choice.dense_s,
        "measured_s": None, "prediction_error": None, "margin": options.margin, "period": options.period,
        "uniform_best": choice.uniform.key,
        "buckets": [{"bucket": c.name, "bytes": costs[i].nbytes, "method": c.method.key,
                     "compress_ms": c.compress_s * 1e3, "comm_ms": c.comm_s * 1e3,
                     "measured_start_ms": profile.starts[i] * 1e3, "in_use": current[i].key,
                     "in_use_alone_ms": costs[i].costs[current[i]][0] * 1e3, "why": c.why}
                    for i, c in enumerate(choice.buckets)],
        "select_fits": {k: list(v) for k, v in fits.items()},
        "cost_model": cost.to_dict() if cost is not None else None,
        "allow": list(options.allow), "min_density": options.min_density, "adaptive_optimizer": adaptive,
        "kinds": kinds,
    }
    assignment = {c.name: c.method.key for c in choice.buckets}
    # the fastest predicted uniform assignments that differ from the decision, measured after it
    # (docs/auto-compression.md#trial)
    alternatives: list[dict[str, str]] = []
    for u, t in choice.uniforms:
        alt = {c.name: (u if u in c.costs else DENSE).key for c in costs}
        near = t <= choice.predicted_s * (1 + options.margin)  # within the model's stated error
        if near and len(alternatives) < TRIALS and alt != assignment and alt not in alternatives:
            alternatives.append(alt)
    return {"assignment": assignment, "report": report, "warning": warning, "alternatives": alternatives}
