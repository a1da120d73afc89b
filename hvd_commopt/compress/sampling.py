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
import zlib
from typing import Any, Sequence

import numpy as np

from ..buckets import Bucket
from ..tensor_ops import TensorOps
from .selector import DensitySpec

__all__ = ["SampledThreshold", "DensitySampling", "counter_hash", "uniform_positions", "PRIME", "KEYS_PER_HASH"]

#: The Mersenne prime 2^31 - 1: :func:`counter_hash` works modulo it, so every product it makes
#: (below 2·p² < 2^63) is exact in int64 on every adapter and device.
PRIME = 2 ** 31 - 1
#: L'Ecuyer's multipliers modulo 2^31 - 1 (good lattice structure; Math. Comp. 68, 1999).
_MULTIPLIERS = (742938285, 950706376, 1226874159)
KEYS_PER_HASH = 5


def _mod(ops: TensorOps, x: Any, m: int) -> Any:
    """``x mod m`` for a non-negative int64 tensor (``x`` is consumed)."""
    return ops.sub(x, ops.scale(ops.trunc_divide(ops.clone(x), m), m))


def counter_hash(ops: TensorOps, counters: Any, keys: Sequence[int]) -> Any:
    """A hash in [0, 2^31 - 1) of each int64 counter in [0, 2^31 - 1), keyed by five integers in
    the same range: three affine rounds ``x = (a·x + key) mod p`` (L'Ecuyer's multipliers) with a
    quadratic round ``x = x·(x + key) mod p`` between them (an affine map alone keeps consecutive
    counters on a lattice and the keys' differences in the output; the products of two residues
    break both). Only ``scale``, ``shift``, ``mul``, ``trunc_divide`` and ``sub`` on values below
    2^63, so every adapter computes the same integers on any device: the counter-based draw behind
    :func:`uniform_positions` (docs/dgc.md#uniform-samples)."""
    if len(keys) != KEYS_PER_HASH:
        raise ValueError(f"internal: counter_hash takes {KEYS_PER_HASH} keys, got {len(keys)}")
    x = _mod(ops, ops.shift(ops.scale(ops.clone(counters), _MULTIPLIERS[0]), int(keys[0])), PRIME)
    for a, quad, key in zip(_MULTIPLIERS[1:], keys[1::2], keys[2::2]):
        x = _mod(ops, ops.mul(x, ops.shift(x, int(quad))), PRIME)  # x·(x + k) < p·2p
        x = _mod(ops, ops.shift(ops.scale(x, a), int(key)), PRIME)
    return x


def uniform_positions(ops: TensorOps, n: int, count: int, keys: Sequence[int], like: Any) -> Any:
    """``count`` positions drawn uniformly from [0, n), with replacement, from ten keys: sample i
    is ``(h1(i)·p + h2(i)) mod n`` with two :func:`counter_hash` of the counter i, a value spread
    over [0, p²) (p² > 2^61, so the modulo's bias is below n / 2^61). The host and the device
    compute it with the same TensorOps, so both routes draw the same samples
    (docs/dgc.md#uniform-samples)."""
    if count >= PRIME:
        raise ValueError(f"internal: {count} uniform samples; the counter hash takes fewer than 2^31 - 1")
    i = ops.arange(count, like=like)
    h = ops.scale(counter_hash(ops, i, keys[:KEYS_PER_HASH]), PRIME)
    return _mod(ops, ops.add(h, counter_hash(ops, i, keys[KEYS_PER_HASH:2 * KEYS_PER_HASH])), n)


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

    def sample_positions(self, ops: TensorOps, n: int, stride: int, num_samples: int, name: str, step: int,
                         like: Any) -> Any:
        """The sample's positions in a bucket of ``n`` elements (an int64 tensor on ``like``'s
        device), the same on the host route and the device route: strided from a random start, or
        ``num_samples`` uniform positions (:func:`uniform_positions`). The start and the keys come
        from a generator seeded with (seed, bucket name, step): a few Python integers, no tensor
        copied to the device (docs/dgc.md#uniform-samples)."""
        rng = np.random.Generator(np.random.PCG64([self.seed & 0xFFFFFFFF, zlib.crc32(name.encode()), int(step)]))
        if self.strided_sample:
            off = int(rng.integers(0, stride))
            return ops.shift(ops.scale(ops.arange(-(-(n - off) // stride), like=like), stride), off)
        keys = [int(k) for k in rng.integers(0, PRIME, size=2 * KEYS_PER_HASH)]
        return uniform_positions(ops, n, num_samples, keys, like)


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
