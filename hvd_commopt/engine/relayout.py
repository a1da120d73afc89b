"""Move per-bucket reducer state into a new bucket layout (docs/lags-omgs.md#replan-residuals).

A re-plan (the tuner's OMGS/MG-WFBP plan replacing the threshold buckets, or ``set_plan``)
renames the buckets, and per-bucket state (error-feedback residuals, DGC/momentum-correction
velocities and momenta) is keyed by bucket name: without this it would be dropped, losing a few
steps of gradient. The reducer's ``state_dict()`` is taken apart per tensor with the old
layout's offsets and reassembled with the new one's, then loaded back; tensors of a new bucket
with no state get zeros. Works for any memory whose state is ``{bucket name: flat tensor}``
dicts (nested anywhere in the state), without knowing the memory.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..buckets import Bucket

__all__ = ["relayout_state"]


def _host(ops: Any, t: Any) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else np.asarray(ops.to_numpy(t))


def relayout_state(ops: Any, state: Any, old: Sequence[Bucket], new: Sequence[Bucket]) -> tuple[Any, int]:
    """``state`` with every ``{old bucket name: flat}`` dict rewritten for the ``new`` buckets.

    Returns (new state, number of per-bucket dicts moved). Flat tensors come back as NumPy
    arrays (every memory's ``load_state_dict`` takes them and moves them onto the device).
    """
    by_name = {b.name: b for b in old}
    moved = 0

    def split(d: dict) -> dict:
        pieces: dict[str, np.ndarray] = {}
        for bname, flat in d.items():
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

    def walk(x: Any) -> Any:
        nonlocal moved
        if isinstance(x, dict):
            if x and all(isinstance(k, str) and k in by_name for k in x):
                moved += 1
                return split(x)
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(state), moved
