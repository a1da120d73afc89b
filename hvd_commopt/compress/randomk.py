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
* No n/k rescaling: with error feedback the unsent mass is kept in the residual, so the
  unscaled values are the right update (GRACE does the same).
* The step number is the round's (the optimizer step that produced the gradient), the same
  on every rank; a checkpoint restores it with the engine's step counter.
"""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from ..buckets import Bucket
from ..tensor_ops import TensorOps
from .topk import Density, SparseCompressor

__all__ = ["RandomKCompressor", "randomk_indices"]


def randomk_indices(seed: int, name: str, step: int, n: int, k: int) -> np.ndarray:
    """The k ascending int64 indices of ``range(n)`` drawn for (seed, bucket name, step)."""
    if k >= n:
        return np.arange(n, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode()), int(step)]))
    return np.sort(rng.choice(n, size=k, replace=False, shuffle=False)).astype(np.int64)


class RandomKCompressor(SparseCompressor):
    """k uniformly random elements of the bucket, the same k on every rank.

    Args:
        density: fraction of each bucket sent (float, per-layer dict or callable).
        seed: shared base seed; must be equal on every rank (it is part of the reducer's
            configuration, like the model).
    """

    name = "randomk"
    collective = "allreduce"

    def __init__(self, density: Density = 0.001, seed: int = 0):
        super().__init__(density)
        self.seed = int(seed)

    def select(self, ops: TensorOps, acc: Any, bucket: Bucket | None = None, step: int = 0) -> tuple[Any, Any]:
        n = ops.numel(acc)
        name = bucket.name if bucket is not None else ""
        idx = ops.from_numpy(randomk_indices(self.seed, name, step, n, self.k_for(n, bucket, step)), like=acc)
        return ops.gather(acc, idx), idx

    def config(self) -> dict:
        return {**super().config(), "seed": self.seed}

    def __repr__(self) -> str:
        return f"RandomKCompressor(density={self.density!r}, seed={self.seed})"
