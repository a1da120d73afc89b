"""Sparse compression under an adaptive optimizer (Adam, AdamW, ...): docs/adaptive-optimizers.md#adaptive-optimizers.

Error feedback and momentum correction were designed for SGD with momentum. Before Adam they
meet an optimizer that divides each coordinate by its own second moment, and a coordinate that
error feedback delivers in one burst every ~1/density steps moves about sqrt(1/density) times
less under Adam than the same gradient delivered every step (docs/adaptive-optimizers.md#why).
When the wrapped optimizer is adaptive (the host says so through the typed seam
:class:`~hvd_commopt.host.OptimizerFamily`), :func:`adapt_to_optimizer` makes a sparse reducer:

* start with a **dense warm-up** of :data:`ADAPTIVE_WARMUP_STEPS` steps
  (:class:`~hvd_commopt.compress.warmup.DensityWarmup`) unless the selector already has one:
  Adam's second moment is estimated from (nearly) dense gradients while it settles, as 1-bit
  Adam's and 0/1 Adam's uncompressed warm-ups do (docs/adaptive-optimizers.md#warmup);
* keep **error feedback without momentum correction**: Adam's first moment is its momentum, so
  there is no SGD momentum to correct (the optimizer has no ``momentum``: μ = 0), and DGC left
  at ``momentum=None`` trains without a momentum of its own, on purpose, with no warning;
* **warn** for random-k below density 0.3 (it trained far off S-SGD under AdamW,
  docs/adaptive-optimizers.md#randomk), naming the methods that do train;
* **warn** when DGC is given a momentum of its own (``Compression.dgc(momentum=0.9)``): it is
  then applied before Adam's first moment, two momenta in series, measured far off S-SGD
  (docs/adaptive-optimizers.md#dgc-momentum).

Everything here is decided once, when the optimizer is attached (``Reducer.bind_host``), from
plain values; nothing is probed.
"""
from __future__ import annotations

import warnings
from typing import Any

from ..compress.randomk import RANDOMK_MIN_DENSITY, RandomKSelector
from ..compress.selector import Selector
from ..compress.warmup import DensityWarmup
from ..host import ADAPTIVE, OptimizerFamily
from ..memory.base import Memory, MomentumMemory

__all__ = ["ADAPTIVE_WARMUP_STEPS", "adapt_to_optimizer", "is_adaptive"]

#: Steps of density warm-up under an adaptive optimizer (docs/adaptive-optimizers.md#warmup).
ADAPTIVE_WARMUP_STEPS = 100


def is_adaptive(host: Any) -> bool:
    """The host's wrapped optimizer divides by a per-coordinate second moment (Adam and kin)."""
    return isinstance(host, OptimizerFamily) and host.optimizer_family() == ADAPTIVE


def adapt_to_optimizer(memory: Memory, selector: Selector | None, host: Any) -> bool:
    """Adapt a sparse reducer's ``selector`` and ``memory`` to an adaptive wrapped optimizer (the
    module docstring); True when the optimizer is adaptive. Nothing changes otherwise."""
    if not is_adaptive(host):
        return False
    if selector is not None and selector.warmup is None:
        selector.warmup = DensityWarmup(ADAPTIVE_WARMUP_STEPS)
    d = selector.density.constant if isinstance(selector, RandomKSelector) else None
    if d is not None and d < RANDOMK_MIN_DENSITY:
        warnings.warn(f"random-k at density {d} under an adaptive optimizer (Adam, AdamW, ...) trained far off "
                      f"S-SGD even after the warm-up (docs/adaptive-optimizers.md#randomk): use "
                      f"Compression.topk, gtopk, oktopk or dgc, or random-k at density >= {RANDOMK_MIN_DENSITY}.",
                      RuntimeWarning, stacklevel=5)
    if isinstance(memory, MomentumMemory) and memory.from_optimizer:
        # Adam's first moment is the momentum: μ = 0 here is the intended error feedback, so
        # DGC's "no momentum anywhere" warning (docs/dgc.md#no-momentum) does not apply; it
        # warns once per memory, so binding 0 here, silenced, settles it for the later binding.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            memory.bind_momentum(0.0)
    elif isinstance(memory, MomentumMemory) and memory.momentum > 0:
        warnings.warn(f"DGC applies its own momentum {memory.momentum} before the wrapped optimizer, which is "
                      f"adaptive (Adam, AdamW, ...) and applies its first moment after the exchange: two "
                      f"momenta in series, measured far off S-SGD (docs/adaptive-optimizers.md#dgc-momentum). "
                      f"Leave DGC's momentum to the optimizer: Compression.dgc(..., momentum=None) (the "
                      f"default) or momentum=0.0.", RuntimeWarning, stacklevel=5)
    return True
