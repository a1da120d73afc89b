"""The measured gaps of the sparse methods at their defaults, warned about when an optimizer is wrapped.

The convergence matrix (benchmarks/convergence_matrix.py, docs/convergence-matrix.md) trains every
algorithm at its defaults next to S-SGD. The target is 0.5 points of test accuracy and 1 % of
validation loss; where a sparse method misses it under an optimizer family, wrapping that
combination warns once per process (docs/convergence-matrix.md#warnings), naming the gap as
measured, the set-up it was measured on, and what trained within the target there. The entries
are data from measurements, not a model: a combination that was not measured does not warn.

Choices:

* Keyed by the sparse method and the wrapped optimizer's family (the typed seam
  :class:`~hvd_commopt.host.OptimizerFamily`: "sgd" with a momentum, or "adaptive"), not by
  schedule or fusion: OD + DGC, SSD + Top-k and LAGS (Top-k with one bucket per layer) were
  measured to lag exactly as much as, or more than, their compressor alone
  (docs/convergence-matrix.md#early-lag), so the compressor's warning covers them.
* Only at the densities measured (1 %) or below; a per-layer density (a dict or callable)
  warns too, since its smallest density is not known before the buckets are.
* Two schedules are here: CoCoD-SGD, which sends everything but whose period-late averaging
  missed the target on the digits MLP, and local SGD under Adam-type optimizers, whose plain
  averaging missed it on the small GPT where DiLoCo's outer step did not
  (:mod:`hvd_commopt.schedule.averaging` asks when it is attached).
* Random-k is not here: it has warnings of its own for both families (docs/topk.md#randomk-momentum,
  docs/adaptive-optimizers.md#randomk).
* Once per (method, family) per process, so a training loop that re-wraps does not repeat it;
  the standard ``warnings`` filters silence it (category :class:`MeasuredGapWarning`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from ..host import ADAPTIVE, OptimizerFamily, ScheduleHost

__all__ = ["KnownGap", "KNOWN_GAPS", "MeasuredGapWarning", "MEASURED_DENSITY", "warn_known_gap"]

#: the density the matrix measured the sparse methods at; sparser selections warn too
MEASURED_DENSITY = 0.01


class MeasuredGapWarning(UserWarning):
    """A sparse method under an optimizer family where the convergence matrix measured it
    short of S-SGD by more than the target (docs/convergence-matrix.md#warnings). A
    ``UserWarning``, not a ``RuntimeWarning``: it is advice about a choice, measured on other
    models, not a sign that this run is going wrong."""


@dataclass(frozen=True)
class KnownGap:
    """One measured combination: what fell short, by how much, where, and what to use instead."""

    method: str  # "topk", "gtopk", "oktopk", "dgc"; "cocod" (a schedule)
    family: str  # "sgd" (with momentum) or "adaptive"
    measured: str  # the gap and its set-up, in words
    alternative: str  # what trained within the target there
    namespace: str = "Compression"  # or "Schedule"

    def message(self, density: float | None) -> str:
        d = "" if self.namespace != "Compression" else (
            " at per-layer densities" if density is None else f" at density {density:g}")
        opt = "an adaptive optimizer (Adam, AdamW, ...)" if self.family == ADAPTIVE else "SGD with momentum"
        return (f"{self.namespace}.{self.method}{d} under {opt} trained short of S-SGD in the convergence matrix: "
                f"{self.measured} (target: within 0.5 points, 1 % of the loss; "
                f"docs/convergence-matrix.md#warnings). {self.alternative}")


_SGD_ALT = ("Within the target there: local SGD with a period of 4 (Schedule.local_sgd(4), "
            "a quarter of the syncs; -0.19 / -0.09 points at 2 / 4 ranks). Closer with this method: a dense warm-up, "
            "warmup_steps=50 (gTop-k -0.31 / -1.00 points at 2 / 4 ranks, 10 seeds).")
_ADAPTIVE_ALT = ("Closer: a longer dense warm-up (warmup_steps=, docs/adaptive-optimizers.md#warmup-steps): "
                 "Top-k with warmup_steps=200 of the 400 steps ended +0.6 % (seed 0); or no compression.")

#: (method, family) -> the gap measured at the defaults (docs/convergence-matrix.md#warnings).
#: SGD: the digits MLP (64-128-64-10), SGD lr 0.1 momentum 0.9 with cosine decay, density 1 %,
#: batch 16 per rank, 10 epochs. Adaptive: a 2-layer GPT on bytes, 400 AdamW steps, 2 ranks,
#: density 1 %, the 100-step dense warm-up. Gap of the means to S-SGD's.
_MLP = "on the digits MLP (SGD lr 0.1, momentum 0.9, density 1 %, 10 epochs, 2026-11-26)"
_GPT = "on a small GPT (400 AdamW steps, 2 ranks, density 1 %, 2026-11-26)"
_ADAM_DIGITS = "on the digits MLP / CNN (AdamW lr 1e-3, 10 epochs, 2 ranks, 3 seeds)"
KNOWN_GAPS: dict[tuple[str, str], KnownGap] = {
    (g.method, g.family): g for g in (
        KnownGap("topk", "sgd", f"-0.44 points at 2 ranks and -0.78 at 4 {_MLP}, 10 seeds (LAGS, one bucket "
                                f"per layer: -0.28 at 2 ranks, 3 seeds; at 4 ranks -1.85 with masking on, "
                                f"3 seeds)", _SGD_ALT),
        KnownGap("gtopk", "sgd", f"-0.72 points at 2 ranks and -2.64 at 4 {_MLP}, 10 seeds", _SGD_ALT),
        KnownGap("oktopk", "sgd", f"-0.72 points at 2 ranks and -2.39 at 4 {_MLP}, 10 seeds", _SGD_ALT),
        KnownGap("dgc", "sgd", f"-1.20 points at 2 ranks and -2.04 at 4 {_MLP}, 3 seeds", _SGD_ALT),
        KnownGap("cocod", "sgd", f"-0.56 points at 2 ranks and -0.65 at 4 {_MLP}, 3 seeds (period 4)",
                 "Within the target there: local SGD with the same period (Schedule.local_sgd(4), -0.19 / "
                 "-0.09 points).", "Schedule"),
        KnownGap("local_sgd", ADAPTIVE, "+5.9 % of S-SGD's validation loss at period 50 on a 0.12M-parameter GPT "
                                        "(3000 AdamW steps with cosine decay, 2 ranks, seed 0, 2026-11-26)",
                 "Within the target there: DiLoCo's outer step on the same averages, "
                 "Schedule.diloco(50, outer_lr=1.0, outer_momentum=0.5): +0.77 / +0.84 % (seeds 0, 1; "
                 "docs/diloco.md#measured).", "Schedule"),
        KnownGap("topk", ADAPTIVE, f"+2.2 and +2.7 % of S-SGD's validation loss {_GPT}, seeds 0 and 1 "
                                   f"(LAGS +3.9 %, seed 1); {_ADAM_DIGITS} -1.67 / -1.02 points (LAGS -1.57 / "
                                   f"-1.20)", _ADAPTIVE_ALT),
        KnownGap("gtopk", ADAPTIVE, f"+2.7 and +3.1 % of S-SGD's validation loss {_GPT}, seeds 0 and 1; "
                                    f"{_ADAM_DIGITS} -2.04 / -1.20 points", _ADAPTIVE_ALT),
        KnownGap("oktopk", ADAPTIVE, f"+3.1 % of S-SGD's validation loss {_GPT}, seed 1; {_ADAM_DIGITS} "
                                     f"-2.04 / -1.20 points", _ADAPTIVE_ALT),
        KnownGap("dgc", ADAPTIVE, f"+2.7 % of S-SGD's validation loss {_GPT}, seed 1; {_ADAM_DIGITS} "
                                  f"-1.67 / -1.02 points", _ADAPTIVE_ALT),
    )
}

_warned: set[tuple[str, str]] = set()


def _family(host: ScheduleHost, names: list[str]) -> str | None:
    """"adaptive", "sgd" (SGD with a momentum: the matrix's SGD rows) or None (not measured)."""
    family = host.optimizer_family() if isinstance(host, OptimizerFamily) else None
    if family == ADAPTIVE:
        return ADAPTIVE
    if family == "sgd" and names and float(host.param_hyper(names[0], "momentum", 0.0) or 0.0) > 0:
        return "sgd"
    return None


def warn_known_gap(method: str, density: float | None, host: ScheduleHost, names: list[str],
                   namespace: str = "Compression") -> KnownGap | None:
    """Warn once per process when ``method`` at ``density`` (None: per-layer) under the host's
    optimizer has a measured gap (:data:`KNOWN_GAPS`); the entry, or None when nothing applies.
    A gradient-capturing host (no optimizer) never warns."""
    if not host.holds_weights or (density is not None and density > MEASURED_DENSITY):
        return None
    family = _family(host, names)
    gap = KNOWN_GAPS.get((method, family)) if family is not None else None
    if gap is None or gap.namespace != namespace:
        return None
    if (method, gap.family) not in _warned:
        _warned.add((method, gap.family))
        warnings.warn(gap.message(density), MeasuredGapWarning, stacklevel=6)
    return gap
