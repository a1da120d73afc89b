"""Fusion buffers of released rounds, kept per bucket for reuse (docs/wrapper.md#grad-views).

A round's buffers go back to the pool once the round is applied. A released buffer may still be
referenced: the engine hands out views of it, which a host may keep as its gradients. Such a
buffer is reused only once nothing else refers to it (``TensorOps.exclusive``), so packing never
writes into a gradient the user can still see, nor reads from the buffer it writes.
"""
from __future__ import annotations

from typing import Any

from ..buckets import Bucket

__all__ = ["BufferPool", "SPARES"]

# per bucket, released buffers kept; past this many, those someone still holds are dropped first,
# oldest first (their holders keep them alive), else the oldest
SPARES = 4


class BufferPool:
    """Per bucket, the released fusion buffers (``spares[i]`` for bucket i)."""

    def __init__(self, ops: Any):
        self.ops = ops
        self.spares: list[list[Any]] = []

    def reset(self, buckets: int) -> None:
        """A new bucket layout: forget every kept buffer (their sizes are the old layout's)."""
        self.spares = [[] for _ in range(buckets)]

    def take(self, bucket: Bucket, like: Any) -> Any:
        """A buffer for ``bucket``: a kept one that nothing else refers to any more, else a new one
        (on ``like``'s device)."""
        spare = self.spares[bucket.index]
        exclusive = self.ops.exclusive
        for j in range(len(spare)):
            if exclusive(spare[j]):
                return spare.pop(j)
        return self.ops.empty(bucket.numel, bucket.dtype, like=like)

    def give_back(self, flats: list[Any]) -> None:
        """A finished round's buffers, one per bucket (None where the round made none)."""
        for spare, flat in zip(self.spares, flats):
            if flat is not None:
                self._keep(spare, flat)

    def _keep(self, spare: list[Any], flat: Any) -> None:
        spare.append(flat)
        while len(spare) > SPARES:
            held = [j for j in range(len(spare)) if not self.ops.exclusive(spare[j])]
            spare.pop(held[0] if held else 0)
