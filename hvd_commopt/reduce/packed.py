"""Several equal-length parts of different dtypes as one byte message (docs/topk.md#one-message).

A sparse bucket's selection is k values and k indices. Sent as two allgathers it pays the
per-collective cost twice (a Gloo allgather between hosts is two round trips: sizes, then data),
which with one bucket per layer (LAGS) dominates a step on a fast link. Packing both into one
uint8 buffer per rank makes it one collective carrying exactly the same bytes, so the traffic
accounting (bytes = (P-1)·n sent) is unchanged.

Layout per rank: the parts' raw bytes one after the other (``TensorOps.as_bytes``). After the
allgather, rank r's segment holds ``counts[r] / sum(widths)`` elements of every part; each part
is rebuilt by concatenating its slice of every segment, in rank order, and viewing the bytes back
(``TensorOps.from_bytes``): bit for bit the tensors separate allgathers would have returned.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..dtypes import numpy_dtype

__all__ = ["dtype_width", "pack_parts", "unpack_gathered"]


def dtype_width(name: str) -> int:
    """Bytes per element of the core dtype ``name`` (host names such as "uint16" included; a
    bfloat16 is its uint16 bit pattern)."""
    return numpy_dtype(name).itemsize


def pack_parts(ops: Any, parts: Sequence[Any]) -> Any:
    """One 1-D uint8 tensor: the bytes of every part, in order."""
    return ops.cat([ops.as_bytes(p) for p in parts])


def unpack_gathered(ops: Any, buf: Any, counts: Sequence[int], dtypes: Sequence[str]) -> list[Any]:
    """The parts of an allgather of :func:`pack_parts` messages: for each dtype, every rank's part
    concatenated in rank order. ``counts`` are the bytes each rank sent."""
    widths = [dtype_width(d) for d in dtypes]
    row = sum(widths)
    pieces: list[list[Any]] = [[] for _ in dtypes]
    off = 0
    for c in counts:
        c = int(c)
        if c % row:
            raise ValueError(f"packed message of {c} bytes is not a whole number of {row}-byte elements "
                             f"({list(dtypes)}): the ranks disagree on the dtypes")
        k = c // row
        pos = off
        for j, w in enumerate(widths):
            pieces[j].append(ops.slice(buf, pos, pos + k * w))
            pos += k * w
        off += c
    return [ops.from_bytes(p[0] if len(p) == 1 else ops.cat(p), d) for p, d in zip(pieces, dtypes)]
