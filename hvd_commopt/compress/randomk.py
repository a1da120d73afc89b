"""Random-k sparsification with a seed shared by all ranks, so the values can be allreduced.

Reference: GRACE's ``RandomKCompressor`` (sands-lab/grace) and the random-k baseline of the
sparsified-SGD literature (Stich et al., "Sparsified SGD with memory", NeurIPS 2018); the
error-feedback wrapper is the same as Top-k's (docs/topk.md#update-rule).

Choices:

* Every rank draws the *same* k indices for a bucket at a step: the generator is seeded with
  ``(seed, crc32(bucket name), step)``, so the k selected values of all ranks line up element by
  element and a plain allreduce of k values replaces the (values, indices) allgather:
  ``collective = "allreduce"``, O(k) traffic instead of O(kP), and no indices on the wire.
* The indices are drawn on the host with NumPy's PCG64 (``Generator.choice(replace=False)``,
  O(k) for small k) and moved to the tensor's device: the draw is then identical for NumPy,
  PyTorch and TensorFlow tensors, and costs one k-element host-to-device copy.
* No n/k rescaling with error feedback: the unsent mass is kept in the residual, so the
  unscaled values are the right update (GRACE does the same). ``unbiased=True`` (only without
  error feedback) scales the sent values by n/k instead, an unbiased estimate of the gradient.
* Why random-k needs momentum correction (docs/topk.md#randomk-momentum): with error feedback each
  entry's residual grows for about 1/density steps before it is drawn, and the optimizer's
  momentum then multiplies that burst by about 1/(1-μ); it diverged at density 0.01 and 0.1 on
  digits. With momentum correction (the default, as Top-k's) the momentum is applied before the
  residual, and the burst is applied once.
* The step number is the round's (the optimizer step that produced the gradient), the same
  on every rank; a checkpoint restores it with the engine's step counter.
"""
from __future__ import annotations

import warnings
import zlib
from typing import Any

import numpy as np

from ..buckets import Bucket
from ..tensor_ops import TensorOps
from .selector import Density, Selector

__all__ = ["RandomKSelector", "randomk_indices", "RANDOMK_MIN_DENSITY"]

# below this density random-k with momentum did not reach S-SGD's accuracy (docs/topk.md#randomk-momentum)
RANDOMK_MIN_DENSITY = 0.3


def randomk_indices(seed: int, name: str, step: int, n: int, k: int) -> np.ndarray:
    """The k ascending int64 indices of ``range(n)`` drawn for (seed, bucket name, step)."""
    if k >= n:
        return np.arange(n, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode()), int(step)]))
    return np.sort(rng.choice(n, size=k, replace=False, shuffle=False)).astype(np.int64)


class RandomKSelector(Selector):
    """k uniformly random elements of the bucket, the same k on every rank.

    Args:
        density: fraction of each bucket sent (float, per-layer dict or callable).
        seed: shared base seed; must be equal on every rank (it is part of the reducer's
            configuration, like the model).
    """

    name = "randomk"
    collective = "allreduce"

    def __init__(self, density: Density = 0.001, seed: int = 0, min_k: int = 1, unbiased: bool = False,
                 dense_1d: bool = True):
        super().__init__(density, min_k, dense_1d)
        self.seed = int(seed)
        self.unbiased = bool(unbiased)

    def select(self, ops: TensorOps, acc: Any, bucket: Bucket | None = None, step: int = 0) -> tuple[Any, Any]:
        n = ops.numel(acc)
        name = bucket.name if bucket is not None else ""
        k = self.k_for(n, bucket, step)
        idx = ops.from_numpy(randomk_indices(self.seed, name, step, n, k), like=acc)
        vals = ops.gather(acc, idx)
        return (ops.scale(vals, n / k) if self.unbiased and k < n else vals), idx

    def check_momentum(self, momentum: float, corrected: bool) -> None:
        """Warn about the combinations measured not to train (docs/topk.md#randomk-momentum)."""
        d = self.density.constant
        if not momentum or self.unbiased:
            return
        if not corrected:
            warnings.warn(f"random-k with error feedback and the optimizer's momentum {momentum} applied after "
                          f"the exchange diverges: each entry's residual grows for about 1/density steps and "
                          f"is then multiplied by the momentum. Use momentum_correction=True (the default).",
                          RuntimeWarning, stacklevel=4)
        elif d is not None and d < RANDOMK_MIN_DENSITY:
            warnings.warn(f"random-k at density {d} sends each entry about every {1 / d:.0f} steps, so with "
                          f"momentum {momentum} the update it applies is that many steps stale; it did not train "
                          f"below density {RANDOMK_MIN_DENSITY} at lr 0.1 (docs/topk.md#randomk-momentum). Use "
                          f"Compression.topk/gtopk at low density, or density >= {RANDOMK_MIN_DENSITY}, or a "
                          f"smaller lr.", RuntimeWarning, stacklevel=4)

    def config(self) -> dict:
        return {**super().config(), "seed": self.seed, "unbiased": self.unbiased}

    def __repr__(self) -> str:
        return f"RandomKSelector(density={self.density!r}, seed={self.seed}, unbiased={self.unbiased})"
