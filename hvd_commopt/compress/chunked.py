"""Chunk-wise top-k: SparseLoCo's selection (docs/quantize.md#chunked).

Paper: Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo", arXiv:2508.15706
(top-k chosen per chunk of 4096 elements, 2-bit values, error feedback with decay, on DiLoCo's
pseudo-gradient); the selection comes from DeMo / CCLoco, which chunk each tensor and keep the
same number of entries from every chunk.

Choices:

* Chunks never straddle tensors: each member tensor of a bucket is cut into chunks of ``chunk``
  elements from its first element, its last chunk shorter when ``chunk`` does not divide it. A
  flat buffer with no bucket is one tensor.
* A chunk of m elements keeps ``min(m, max(1, ceil(density * m)))`` entries (so every full chunk
  the same ``ceil(density * chunk)``): every region of the model sends every round, so a layer of
  small values is not starved by one of large values, as a whole-bucket top-k starves it.
* Inside a chunk the selection is :meth:`TensorOps.topk_abs` (ties to the lower index), and the
  positions come out ascending over the bucket.
* Wire form: a position is sent as its offset inside its chunk, an int16 (``chunk`` is at most
  32 768): half of an int32 index (SparseLoCo sends 12 bits for 4 096). The receiver adds each
  chunk's start, which every rank knows from the bucket's layout (:func:`chunk_plan`).
* A pure function of the layout and the density; no state, no communication.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..buckets import Bucket
from ..errors import ConfigError
from ..tensor_ops import TensorOps

__all__ = ["MAX_CHUNK", "check_chunk", "member_sizes", "chunk_plan", "chunk_starts", "chunked_topk"]

Tensor = Any
MAX_CHUNK = 1 << 15  # an offset inside a chunk fits an int16


def check_chunk(chunk: object) -> int | None:
    """``chunk`` validated: None (the whole bucket's top-k) or an integer in 1..32768."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
        raise ConfigError(f"chunk must be None (top-k of the whole bucket) or the elements per chunk, an integer "
                          f"from 1 to {MAX_CHUNK} (an offset inside a chunk travels as an int16; SparseLoCo uses "
                          f"4096), got {chunk!r}")
    return chunk


def member_sizes(bucket: Bucket | None, n: int) -> list[int]:
    """Element counts of the tensors making up a flat buffer of n elements (one without a bucket)."""
    if bucket is None or bucket.numel != n:
        return [n]
    return [bucket.member_numel(i) for i in range(len(bucket.names))]


def chunk_plan(sizes: Sequence[int], chunk: int, density: float) -> list[tuple[int, int, int]]:
    """``(start, stop, k)`` of every chunk of a flat buffer made of tensors of ``sizes`` elements
    (in order): chunks of ``chunk`` elements inside each tensor, k = min(m, max(1, ceil(density*m)))
    of a chunk of m elements. A pure function."""
    plan, off = [], 0
    for size in sizes:
        for s in range(0, int(size), chunk):
            m = min(chunk, int(size) - s)
            plan.append((off + s, off + s + m, min(m, max(1, int(math.ceil(density * m))))))
        off += int(size)
    return plan


def chunk_starts(plan: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """The start of the chunk of every selected entry, in the order :func:`chunked_topk` lists
    them (int64, host): what a receiver adds to the int16 offsets."""
    return np.repeat(np.array([s for s, _, _ in plan], dtype=np.int64), [k for _, _, k in plan])


def chunked_topk(ops: TensorOps, x: Tensor, plan: Sequence[tuple[int, int, int]]) -> tuple[Tensor, Tensor]:
    """(int64 positions in x, ascending; int64 offsets inside their chunks) of the k largest
    ``|x|`` of every chunk of ``plan``."""
    offs = []
    for s, e, k in plan:
        part = ops.slice(x, s, e)
        offs.append(ops.topk_abs(part, k)[1] if k < e - s else ops.arange(e - s, like=x))
    local = offs[0] if len(offs) == 1 else ops.cat(offs)
    return ops.add(ops.from_numpy(chunk_starts(plan), like=local), local), local
