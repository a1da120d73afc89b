"""Density warm-up: send more of each bucket in the first steps, down to the density (docs/adaptive-optimizers.md#warmup).

Two schedules over the first ``W`` optimizer steps:

* **dense** (the default): every bucket is sent whole for ``W`` steps, then at the density. This
  is the uncompressed warm-up of 1-bit Adam (Tang et al., ICML 2021, arXiv:2102.02888) and 0/1
  Adam (Lu et al., ICLR 2023, arXiv:2202.06009), run while Adam's second moment settles; it is
  the one measured to train closest to S-SGD under AdamW (docs/adaptive-optimizers.md#measured).
* **exponential**: Deep Gradient Compression's "warm-up training" (Lin et al., ICLR 2018,
  arXiv:1712.01887, section 3.3; ``ratio_e = r^((e+1)/(W+1))`` per epoch in the reference code,
  :func:`hvd_commopt.compress.dgc.warmup_ratio`) with one "epoch" per step, so a warm-up needs no
  epoch length: ``density(s) = r^((s+1)/(W+1))`` for step ``s < W`` (about 96 % of each bucket
  at step 0 for W = 100, r = 0.01). It sends about ``W/ln(1/r)`` buckets' worth, a fifth of the
  dense warm-up's at r = 0.01.

Choices made here:

* **Only ever more than the density**: the warm-up's count is ``ceil(n·density(s))`` and the
  selector's own k (its density and ``min_k`` floor) is the least that is sent; a bucket whose
  warm-up count reaches ``n`` is reduced dense (the sparse reducers' ``dense_when_full``).
* **A pure function of the step**: every rank computes the same k from the shared step counter,
  so exact-count exchanges stay equal-sized (docs/topk.md#equal-sizes) and a restored checkpoint
  (which restores the step) resumes the schedule where it was; nothing to save.
"""
from __future__ import annotations

import math

from ..errors import ConfigError

__all__ = ["DensityWarmup"]


class DensityWarmup:
    """A density warm-up over ``steps`` optimizer steps (see the module docstring).

    Args:
        steps: optimizer steps of warm-up (>= 1); from step ``steps`` on the selector's own k.
        exponential: DGC's exponential decay from dense to the density instead of dense throughout.
    """

    def __init__(self, steps: int, exponential: bool = False):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"a density warm-up lasts a whole number of optimizer steps >= 1, got {steps!r}: "
                              f"e.g. DensityWarmup(100); for none, set the selector's warmup to None")
        if not isinstance(exponential, bool):
            raise ConfigError(f"exponential must be True (DGC's decay) or False (dense), got {exponential!r}")
        self._set(int(steps), exponential)

    def _set(self, steps: int, exponential: bool) -> None:
        self.steps = steps
        self.exponential = exponential

    @classmethod
    def none(cls) -> "DensityWarmup":
        """No warm-up, chosen explicitly (``warmup_steps=0`` on the factories): the density from
        step 0 also under an adaptive optimizer, whose default warm-up it replaces
        (docs/adaptive-optimizers.md#warmup)."""
        w = cls.__new__(cls)  # steps 0 is not a warm-up a user builds, so not the constructor's
        w._set(0, False)
        return w

    @classmethod
    def from_steps(cls, warmup_steps: int | None) -> "DensityWarmup | None":
        """The factories' ``warmup_steps=``: None, the default (none; the adaptive optimizers'
        warm-up under Adam and kin); 0, none at all; n >= 1, n steps sent whole."""
        if warmup_steps is None:
            return None
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"warmup_steps is a whole number of optimizer steps >= 0 sent whole before the "
                              f"density applies (0: none, also under Adam; None: the default), got {warmup_steps!r}")
        return cls.none() if warmup_steps == 0 else cls(warmup_steps)

    def density(self, base: float, step: int) -> float:
        """The density at ``step`` for a target density ``base`` (``base`` once the warm-up is over)."""
        if step >= self.steps or base >= 1.0:
            return base
        if not self.exponential:
            return 1.0
        return max(base ** ((step + 1) / (self.steps + 1)), base)

    def k(self, k: int, numel: int, step: int) -> int:
        """Elements to send from ``numel`` at ``step`` when the selector would send ``k``: the
        warm-up's ``ceil(numel·density)`` at least, never fewer than ``k``, never more than ``numel``."""
        if step >= self.steps or numel <= 0 or k >= numel:
            return k
        d = self.density(k / numel, step)
        return min(max(k, int(math.ceil(numel * d))), numel)

    def config(self) -> dict:
        return {"warmup_steps": self.steps, "exponential": self.exponential}

    def __repr__(self) -> str:
        return f"DensityWarmup(steps={self.steps}, exponential={self.exponential})"
