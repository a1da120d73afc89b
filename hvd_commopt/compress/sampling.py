"""DGC's sampled threshold: its parameters and per-bucket state (docs/dgc.md#update-rule).

:func:`~hvd_commopt.select.sampled.sampled_select` runs the selection; it reads of its
selector the parameters held here (sample ratio and layout, the 1.3/0.8 adaptation bounds, the
iteration cap, resampling, the seed, the next sweep's per-bucket lower bound) plus the selector's
``ratio(bucket, numel, step)`` and ``k_for(numel, bucket, step)``. Two selectors use it:
:class:`~hvd_commopt.compress.dgc.DGCSelector` (with its warm-up ratio) and Top-k's
``selection="sampled"`` through :class:`DensitySampling` (DGC's defaults over Top-k's densities).
"""
from __future__ import annotations

import math

from ..buckets import Bucket
from .selector import DensitySpec

__all__ = ["SampledThreshold", "DensitySampling"]


class SampledThreshold:
    """The sampled threshold's parameters (see :class:`~hvd_commopt.compress.dgc.DGCSelector`)."""

    def __init__(self, sample_ratio: float = 0.01, strided_sample: bool = True, compress_upper_bound: float = 1.3,
                 compress_lower_bound: float = 0.8, max_adaptation_iters: int = 10, resample: bool = True,
                 seed: int = 0):
        self.sample_ratio = min(max(float(sample_ratio), 0.01), 1.0)
        self.strided_sample = bool(strided_sample)
        self.upper, self.lower = float(compress_upper_bound), float(compress_lower_bound)
        self.max_adaptation_iters = int(max_adaptation_iters)
        self.resample = bool(resample)
        self.seed = int(seed)
        self.guesses: dict[str, float] = {}  # bucket -> where its next sweep starts (speed only; dgc_select)

    def sampling(self, numel: int, ratio: float) -> tuple[int, int, int]:
        """(sample_stride, num_samples, top_k_samples) as the reference's ``DGCCompressor.initialize``
        computes them."""
        if self.sample_ratio >= 1.0:
            stride, num_samples = 1, numel
        else:
            pct_numel = int(math.ceil(numel * self.sample_ratio))
            cpr_numel = int(math.ceil(2 / ratio))
            if numel <= cpr_numel:
                stride, num_samples = 1, numel
            else:
                want = max(pct_numel, cpr_numel)
                stride = int(math.ceil(numel / want / 32)) * 32 + 1
                num_samples = numel // stride
                while num_samples < want:
                    stride -= 8
                    num_samples = numel // stride
        return stride, num_samples, int(math.ceil(num_samples * ratio))


class DensitySampling(SampledThreshold):
    """DGC's sampled threshold at DGC's defaults over a selector's densities, with DGC's
    ``k = min(max(ceil(n·ratio), 1), n)`` (all of a dense bucket): Top-k's ``selection="sampled"``."""

    def __init__(self, density: DensitySpec):
        super().__init__()
        self.density = density

    def ratio(self, bucket: Bucket | None, numel: int, step: int = 0) -> float:
        return self.density(bucket, numel)

    def k_for(self, numel: int, bucket: Bucket | None = None, step: int = 0) -> int:
        if numel <= 0:
            return 0
        if bucket is not None and bucket.dense:
            return numel
        return min(max(int(math.ceil(numel * self.ratio(bucket, numel, step))), 1), numel)
