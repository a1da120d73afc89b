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
* Inside a chunk the selection is :meth:`TensorOps.topk_abs`'s (ties to the lower index), and the
  positions come out ascending over the bucket. It is made in a few batched calls, not one per
  chunk (:class:`ChunkLayout`, docs/quantize.md#batched-topk): the full chunks as the rows of one
  (chunks x chunk) view, the shorter ones (tensor tails, small tensors) zero-padded to the next
  power of two, one :meth:`TensorOps.topk_abs_rows` per row width, then one sort of the
  positions. The layout's plan, index maps and chunk starts are computed once per bucket layout
  and kept per device.
* Wire form: a position is sent as its offset inside its chunk in ``b`` bits, ``b`` the bit
  length of the longest chunk's last offset (:func:`offset_bits`: 12 for 4 096, 0 for chunks of
  one element), packed end to end: ``ceil(k*b/8)`` bytes for k offsets, 1.5 bytes each at 4 096
  where an int32 index takes 4 (:func:`pack_offsets`; docs/quantize.md#offsets). SparseLoCo's code
  (templar's ``pack_12bit_indices``) packs the same 12 bits two to three bytes; its newer codec
  Rice-codes the sorted offsets, variable-length, about 8 bits each at 1 % (not built: the
  message size would depend on the values). The receiver adds each chunk's start, which every
  rank knows from the bucket's layout (:func:`chunk_plan`).
* A pure function of the layout and the density; no state, no communication.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..buckets import Bucket
from ..errors import ConfigError
from ..tensor_ops import TensorOps

__all__ = ["MAX_CHUNK", "check_chunk", "member_sizes", "chunk_plan", "chunk_starts", "chunked_topk",
           "ChunkLayout", "offset_bits", "offset_bytes", "pack_offsets", "unpack_offsets"]

Tensor = Any
MAX_CHUNK = 1 << 15  # an offset inside a chunk takes at most 15 bits


def check_chunk(chunk: object) -> int | None:
    """``chunk`` validated: None (the whole bucket's top-k) or an integer in 1..32768."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
        raise ConfigError(f"chunk must be None (top-k of the whole bucket) or the elements per chunk, an integer "
                          f"from 1 to {MAX_CHUNK} (an offset inside a chunk travels in at most 15 bits; SparseLoCo "
                          f"uses 4096), got {chunk!r}")
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
    them (int64, host): what a receiver adds to the offsets."""
    return np.repeat(np.array([s for s, _, _ in plan], dtype=np.int64), [k for _, _, k in plan])


def chunked_topk(ops: TensorOps, x: Tensor, plan: Sequence[tuple[int, int, int]]) -> tuple[Tensor, Tensor]:
    """(int64 positions in x, ascending; int64 offsets inside their chunks) of the k largest
    ``|x|`` of every chunk of ``plan`` (:meth:`ChunkLayout.select`; a reducer keeps the layout)."""
    return ChunkLayout(plan).select(ops, x)


class ChunkLayout:
    """The chunk-wise top-k of one bucket layout, planned once (docs/quantize.md#batched-topk).

    Rows: the full chunks (``m == chunk``) as one group of width ``chunk``, read as contiguous
    slices of the buffer (runs of a tensor's consecutive full chunks, no index map); every shorter
    chunk in the group of its length's next power of two, gathered through an index map and
    zero-padded at the row's end. A pad never displaces a real value: it ranks below every
    nonzero magnitude and, at a tie with a zero, after it (a higher column), and a row keeps
    ``k <= m`` entries. Per group one :meth:`TensorOps.topk_abs_rows` with the group's largest k,
    the first k of each row kept (a gather, skipped when every row keeps all), the chunk starts
    added; one sort over the selected positions then lists them ascending, which is chunk by
    chunk ascending: :meth:`TensorOps.topk_abs` per chunk, the same set in the same order.
    """

    def __init__(self, plan: Sequence[tuple[int, int, int]]):
        self.plan = [(int(s), int(e), int(k)) for s, e, k in plan]
        self.k = sum(k for _, _, k in self.plan)
        self.bits = offset_bits(self.plan)
        self.starts = chunk_starts(self.plan)
        width = max((e - s for s, e, _ in self.plan), default=1)
        groups: dict[tuple[bool, int], list[tuple[int, int, int]]] = {}
        for s, e, k in self.plan:
            full = e - s == width
            groups.setdefault((full, width if full else 1 << (e - s - 1).bit_length()), []).append((s, e, k))
        self.groups = [_RowGroup(w, rows, full) for (full, w), rows in sorted(groups.items())]
        self._on: dict[tuple[str, str], list] = {}

    def _tensors(self, ops: TensorOps, like: Tensor) -> list:
        """[chunk starts, then per group its uploaded maps], on like's device (kept per device)."""
        key = (ops.name, ops.device_name(like))
        if key not in self._on:
            up = [None if a is None else ops.from_numpy(a, like=like) for g in self.groups for a in g.arrays()]
            self._on[key] = [ops.from_numpy(self.starts, like=like), *up]
        return self._on[key]

    def starts_on(self, ops: TensorOps, like: Tensor) -> Tensor:
        """:func:`chunk_starts` as an int64 tensor on like's device (uploaded once per device)."""
        return self._tensors(ops, like)[0]

    def select(self, ops: TensorOps, x: Tensor) -> tuple[Tensor, Tensor]:
        """(int64 positions in x, ascending; int64 offsets inside their chunks) of the k largest
        ``|x|`` of every chunk: :func:`chunked_topk`."""
        if not self.plan:
            empty = ops.zeros(0, "int64", like=x)
            return empty, ops.clone(empty)
        tensors = self._tensors(ops, x)
        starts, maps = tensors[0], tensors[1:]
        found = []
        for i, g in enumerate(self.groups):
            gmap, pads, sel, row_starts = maps[4 * i:4 * i + 4]
            if g.full:
                runs = [ops.slice(x, a, b) for a, b in g.runs]
                buf = runs[0] if len(runs) == 1 else ops.cat(runs)
            else:
                buf = ops.gather(x, gmap)
                if pads is not None:
                    buf = ops.index_fill(buf, pads, 0.0)
            cols = ops.topk_abs_rows(buf, g.width, g.kmax)
            if sel is not None:
                cols = ops.gather(cols, sel)
            found.append(ops.add(cols, row_starts))  # cols is a new tensor
        idx = ops.sort(found[0] if len(found) == 1 else ops.cat(found))
        return idx, ops.sub(ops.clone(idx), starts)


class _RowGroup:
    """Chunks of one row width: host arrays of the gather map (short rows), the pads' positions,
    the kept ranks (None when every row keeps kmax) and each kept entry's chunk start."""

    def __init__(self, width: int, rows: list[tuple[int, int, int]], full: bool):
        self.width, self.rows, self.full = width, rows, full
        self.kmax = max(k for _, _, k in rows)
        self.runs: list[tuple[int, int]] = []
        for s, e, _ in rows:  # consecutive full chunks of one tensor: one slice
            if full and self.runs and self.runs[-1][1] == s:
                self.runs[-1] = (self.runs[-1][0], e)
            else:
                self.runs.append((s, e))
        self.gmap = self.pads = None
        if not full:
            gmap = np.zeros((len(rows), width), np.int64)
            padded = np.ones((len(rows), width), bool)
            for r, (s, e, _) in enumerate(rows):
                gmap[r, :e - s] = np.arange(s, e)
                padded[r, :e - s] = False
            self.gmap = gmap.reshape(-1)
            self.pads = np.flatnonzero(padded).astype(np.int64) if padded.any() else None
        keep = [r * self.kmax + j for r, (_, _, k) in enumerate(rows) for j in range(k)]
        self.sel = None if len(keep) == len(rows) * self.kmax else np.array(keep, np.int64)
        self.row_starts = np.repeat(np.array([s for s, _, _ in rows], np.int64), [k for _, _, k in rows])

    def arrays(self) -> list:
        return [self.gmap, self.pads, self.sel, self.row_starts]


def offset_bits(plan: Sequence[tuple[int, int, int]]) -> int:
    """Bits per offset on the wire for the chunks of ``plan``: the bit length of the longest
    chunk's last offset (12 for chunks of 4 096, 0 when every chunk holds one element: its offset
    is always 0). Every rank computes it from the layout, so nothing about it travels."""
    return (max((e - s for s, e, _ in plan), default=1) - 1).bit_length()


def offset_bytes(k: int, bits: int) -> int:
    """Bytes of :func:`pack_offsets` for k offsets of ``bits`` bits: ``ceil(k*bits/8)``."""
    return (k * bits + 7) // 8


def pack_offsets(ops: TensorOps, offs: Tensor, bits: int) -> Tensor:
    """k int64 offsets (each below ``2**bits``, bits <= 16) as :func:`offset_bytes` uint8 bytes
    (docs/quantize.md#offsets): up to 8 bits one stream of ``bits`` bits each (:meth:`TensorOps.pack_bits`,
    least significant bit first); above 8 the k low bytes, then the high ``bits - 8`` bits of each
    as one such stream. ``k + ceil(k*(bits-8)/8) = ceil(k*bits/8)``: no bit is wasted but the last
    byte's. Only ``trunc_divide``, ``scale``, ``sub``, ``cast`` and the bit packing, so every
    adapter sends the same bytes from any device. ``offs`` is left intact."""
    if bits == 0:
        return ops.zeros(0, "uint8", like=offs)
    if bits <= 8:
        return ops.pack_bits(ops.cast(offs, "uint8"), bits)
    hi = ops.trunc_divide(ops.clone(offs), 256)
    lo = ops.sub(ops.clone(offs), ops.scale(ops.clone(hi), 256))
    return ops.cat([ops.cast(lo, "uint8"), ops.pack_bits(ops.cast(hi, "uint8"), bits - 8)])


def unpack_offsets(ops: TensorOps, buf: Tensor, k: int, bits: int, like: Tensor) -> Tensor:
    """The k int64 offsets of a :func:`pack_offsets` payload (``like``: where zeros are placed
    when ``bits`` is 0)."""
    if bits == 0:
        return ops.zeros(k, "int64", like=like)
    if bits <= 8:
        return ops.cast(ops.unpack_bits(buf, k, bits), "int64")
    lo = ops.cast(ops.slice(buf, 0, k), "int64")
    hi = ops.cast(ops.unpack_bits(ops.slice(buf, k, ops.numel(buf)), k, bits - 8), "int64")
    return ops.add(ops.scale(hi, 256), lo)
