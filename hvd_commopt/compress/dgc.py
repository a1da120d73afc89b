"""DGC: Deep Gradient Compression (Lin, Han, Mao, Wang, Dally; ICLR 2018, arXiv:1712.01887).

Transcribed from the paper's repository, synxlin/deep-gradient-compression
(``dgc/compression.py``), docs/dgc.md#update-rule. DGC has two parts, a selector and a memory:

* :class:`DGCSelector` (here) chooses what to send: a **sampled threshold** (the top
  ``ceil(num_samples·ratio)`` of strided samples with a random start) selects ``|v| >= thr``;
  if more than 1.3·k are selected the exact top-k among them is taken (``resample``), if fewer
  than 0.8·k the threshold is multiplied by 0.8, at most 10 times; the result is truncated to
  ``k = ceil(n·ratio)`` (DGC's rule, not Top-k's ``int``). Plus the **sparsity warm-up**.
* :class:`~hvd_commopt.memory.dgc.DGCMemory` is the memory the reducer uses instead of plain
  error feedback: momentum correction, momentum factor masking and local gradient clipping. DGC
  applies momentum itself, so the wrapped optimizer must not apply it again
  (docs/dgc.md#optimizer-momentum); the reference's ``DGCSGD`` likewise adds only weight decay. The
  same memory is Top-k's, gTop-k's and LAGS's momentum correction (docs/topk.md#momentum-correction).

Sparsity warm-up and the documented discrepancy (docs/dgc.md#sparsity-warm-up): the README lists the
exponential schedule ``0.25, 0.063, 0.015, 0.004, 0.001``, but the code's default (used when
``warmup_coeff`` is None) is ``ratio_e = max(r^((e+1)/(W+1)), r)``, i.e. ``0.316, 0.1, 0.0316,
0.01, 0.00316`` for r = 0.001, W = 5 (no 0.25 first). We follow the **code**; pass
``warmup_coeff=[0.25, 0.063, 0.015, 0.004, 0.001]`` for the README's schedule. A scalar
``warmup_coeff`` c gives ``max(c^(e+1), r)``, as in the code. The epoch comes from
``set_epoch(e)`` or from the round's step (the optimizer step) and ``steps_per_epoch``.

Other choices: the sample start is drawn from a generator seeded with (seed, bucket, step), so a
run is reproducible (the reference uses Python's unseeded ``random``; ranks need not agree since
DGC exchanges indices). DGC's reference compresses only ``dim > 1`` tensors; buckets here are
flat, so give biases ratio 1 with a per-layer density (``{"fc.bias": 1.0, "default": 0.001}``
or a callable).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..buckets import Bucket
from ..errors import ConfigError
from ..tensor_ops import TensorOps
from ..select.sampled import sampled_select
from .sampling import SampledThreshold
from ..select.strategies import SelectionStrategy
from .selector import Density, Selector, check_density

__all__ = ["DGCSelector", "warmup_ratio"]


def warmup_ratio(base: float, epoch: int, warmup_epochs: int,
                 warmup_coeff: float | Sequence[float] | None = None) -> float:
    """DGC's compress ratio at ``epoch`` (``dgc/compression.py: warmup_compress_ratio``)."""
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return base
    if isinstance(warmup_coeff, (list, tuple)):
        return float(warmup_coeff[epoch])
    coeff = base ** (1.0 / (warmup_epochs + 1)) if warmup_coeff is None else float(warmup_coeff)  # type: ignore[arg-type]  # a Sequence was taken above
    return max(coeff ** (epoch + 1), base)


class DGCSelector(Selector, SampledThreshold):
    """DGC's selection: sampled threshold with adaptation, and the sparsity warm-up.

    Args:
        density: the final compress ratio r (float, per-layer dict or callable), in (0, 1].
        sample_ratio: fraction of elements sampled for the threshold (clamped to [0.01, 1]).
        strided_sample: strided samples with a random start (True) or uniform random samples.
        compress_upper_bound / compress_lower_bound: the 1.3 / 0.8 adaptation bounds.
        max_adaptation_iters: at most this many threshold adaptations (10).
        resample: above the upper bound, take the exact top-k of the selected elements.
        warmup_epochs: epochs of sparsity warm-up (0 = none).
        warmup_coeff: None (the code's schedule), a scalar, or one ratio per warm-up epoch.
        steps_per_epoch: derive the epoch from the bucket's step number (else call set_epoch).
        seed: seeds the sample start.
        selection: "sampled" (DGC's own, above), "exact" or "threshold" (docs/selection.md),
            with ``k = ceil(n·ratio)`` in every mode; ``tau``/``band`` for "threshold".
    """

    name = "dgc"
    fuses_memory = True
    selection: SelectionStrategy

    def __init__(self, density: Density = 0.001, sample_ratio: float = 0.01, strided_sample: bool = True,
                 compress_upper_bound: float = 1.3, compress_lower_bound: float = 0.8,
                 max_adaptation_iters: int = 10, resample: bool = True, warmup_epochs: int = 0,
                 warmup_coeff: float | Sequence[float] | None = None, steps_per_epoch: int | None = None,
                 seed: int = 0, selection: str = "sampled", tau: int = 16, band: float = 0.2,
                 dense_1d: bool = True):
        Selector.__init__(self, density, 1, dense_1d)
        SampledThreshold.__init__(self, sample_ratio, strided_sample, compress_upper_bound, compress_lower_bound,
                                  max_adaptation_iters, resample, seed)
        self.selection = SelectionStrategy(selection, tau, band, sampled=self.sampled_select)
        self.warmup_epochs = int(warmup_epochs)
        if isinstance(warmup_coeff, (list, tuple)):
            if len(warmup_coeff) < self.warmup_epochs:
                raise ConfigError(f"warmup_coeff lists {len(warmup_coeff)} ratios but warmup_epochs="
                                  f"{self.warmup_epochs}; give one ratio per warm-up epoch")
            warmup_coeff = [check_density(c, "warmup_coeff entry") for c in warmup_coeff]
        elif warmup_coeff is not None:
            warmup_coeff = check_density(warmup_coeff, "warmup_coeff")
        self.warmup_coeff = warmup_coeff
        if steps_per_epoch is not None and int(steps_per_epoch) < 1:
            raise ConfigError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)
        self._epoch: int | None = None

    # -- schedule -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Tell the warm-up which epoch starts (call it at the start of every epoch)."""
        self._epoch = int(epoch)

    def epoch(self, step: int) -> int:
        if self._epoch is not None:
            return self._epoch
        if self.steps_per_epoch is not None:
            return step // self.steps_per_epoch
        if self.warmup_epochs > 0:
            raise ConfigError("DGC sparsity warm-up needs the epoch: pass steps_per_epoch=len(loader) to "
                              "Compression.dgc(...), or call set_epoch(epoch) on it at each epoch start")
        return 0

    def ratio(self, bucket: Bucket | None, numel: int, step: int = 0) -> float:
        base = self.density(bucket, numel)
        return warmup_ratio(base, self.epoch(step), self.warmup_epochs, self.warmup_coeff)

    def count(self, numel: int, bucket: Bucket | None, step: int) -> int:
        """DGC's ``num_selects = ceil(numel * ratio)``."""
        return int(math.ceil(numel * self.ratio(bucket, numel, step)))

    # -- selection ----------------------------------------------------------------------------
    @property
    def reads_parts(self) -> bool:
        """The exact and the sampled selection read the gradient in their sweep (the sampled one
        from its second step on: docs/dgc.md#sample-from-sums; docs/selection.md#grad-parts)."""
        return self.selection.mode in ("exact", "sampled")

    def select(self, ops: TensorOps, acc: Any, bucket: Bucket | None = None, step: int = 0) -> tuple[Any, Any]:
        vals, idx, _ = self.selection.select_acc(ops, acc, self.k_for(ops.numel(acc), bucket, step), bucket, step,
                                                 None)
        return vals, idx

    def select_acc(self, ops: TensorOps, r: Any, bucket: Bucket | None, step: int, addend: Any,
                   out: Any = None, finite: list | None = None) -> tuple[Any, Any, Any]:
        """(values, indices, acc) of ``acc = r + addend`` (into r, or into ``out`` with r intact):
        the fused form the memory calls (docs/selection.md#fused-ef); the verdict on acc's
        finiteness is appended to ``finite`` (docs/selection.md#finite-sweep)."""
        return self.selection.select_acc(ops, r, self.k_for(ops.numel(r), bucket, step), bucket, step, addend, out,
                                         finite)

    def sampled_select(self, ops: TensorOps, acc: Any, bucket: Bucket | None, step: int, addend: Any = None,
                       out: Any = None, finite: list | None = None) -> tuple[Any, Any, Any]:
        """(values, indices, acc) of DGC's sampled-threshold selection of ``acc`` (+ ``addend``:
        the sum made during the first threshold sweep, into ``out`` with acc intact when given,
        bit-identical to adding first; docs/selection.md#fused-ef). Appends to ``finite`` whether
        the sum is finite, read off the first sweep (docs/selection.md#finite-sweep). The steps are
        in :mod:`hvd_commopt.select.sampled`."""
        return sampled_select(self, ops, acc, bucket, step, addend, out, finite)

    def config(self) -> dict:
        return {**super().config(), "sample_ratio": self.sample_ratio, "strided_sample": self.strided_sample,
                "bounds": (self.upper, self.lower), "max_adaptation_iters": self.max_adaptation_iters,
                "resample": self.resample, "warmup_epochs": self.warmup_epochs,
                "warmup_coeff": self.warmup_coeff, "steps_per_epoch": self.steps_per_epoch, "seed": self.seed,
                **self.selection.config()}

    def state_dict(self) -> dict:
        return {**({} if self._epoch is None else {"epoch": self._epoch}), **self.selection.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._epoch = state.get("epoch")
        self.selection.load_state_dict(state)

    def __repr__(self) -> str:
        return (f"DGCSelector(density={self.density!r}, sample_ratio={self.sample_ratio}, "
                f"warmup_epochs={self.warmup_epochs}, warmup_coeff={self.warmup_coeff!r})")
