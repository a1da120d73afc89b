"""Move per-bucket memory state into a new bucket layout (docs/lags-omgs.md#replan-residuals).

A re-plan (the tuner's OMGS/MG-WFBP plan replacing the threshold buckets, or ``set_plan``)
renames the buckets, and a memory's state (error-feedback residuals, DGC/momentum-correction
velocities and momenta) is keyed by bucket name: without moving it, a few steps of gradient would
be lost. Each memory declares which of its stores are per bucket (``Memory.relayout``) and hands
them here: every ``{old bucket name: flat}`` store is taken apart per tensor with the old layout's
offsets and reassembled with the new one's; tensors of a new bucket with no state get zeros.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..buckets import Bucket

__all__ = ["relayout_flats"]


def _host(ops: Any, t: Any) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else np.asarray(ops.to_numpy(t))


def relayout_flats(ops: Any, flats: dict[str, Any], old: Sequence[Bucket],
                   new: Sequence[Bucket]) -> dict[str, Any] | None:
    """``flats`` (``{old bucket name: flat tensor}``, as a store's ``state_dict()`` holds them)
    rewritten for the ``new`` buckets; None when there is nothing to move (no state, or state
    that is not keyed by the old buckets). Flat tensors come back as NumPy arrays (every store's
    ``load_state_dict`` takes them and moves them onto the device when the bucket is next seen)."""
    by_name = {b.name: b for b in old}
    if not flats or not all(k in by_name for k in flats):
        return None
    pieces: dict[str, np.ndarray] = {}
    for bname, flat in flats.items():
        b, arr = by_name[bname], _host(ops, flat).reshape(-1)
        for i, t in enumerate(b.names):
            n = int(np.prod(b.shapes[i], dtype=np.int64))
            pieces[t] = arr[b.offsets[i]:b.offsets[i] + n]
    dtype = next(iter(pieces.values())).dtype
    out = {}
    for nb in new:
        if not any(t in pieces for t in nb.names):
            continue
        buf = np.zeros(nb.numel, dtype)
        for i, t in enumerate(nb.names):
            if t in pieces:
                buf[nb.offsets[i]:nb.offsets[i] + pieces[t].size] = pieces[t]
        out[nb.name] = buf
    return out
