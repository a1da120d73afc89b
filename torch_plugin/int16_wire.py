"""int16 buffers carried as float16 of the same bits on Gloo (docs/backends.md#int16-wire).

Gloo moves no int16 ("Invalid scalar type"). A collective that only moves data (allgather,
broadcast, alltoall, sendrecv) carries such a buffer as a float16 view of the same 16-bit words,
which Gloo moves unchanged, and the receiver views the result as int16 again. Nothing adds these
words: the core reduces small integers in int32 on native backends, so no float16 arithmetic ever
touches an int16 buffer.
"""
from __future__ import annotations

import torch

__all__ = ["movable", "restore"]

# dtype Gloo cannot move -> a dtype of the same width that it moves bit for bit
_MOVE_AS = {torch.int16: torch.float16}


def movable(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
    """(``t`` or a same-bits view Gloo can move, the dtype to view the result as; None: as it is)."""
    alias = _MOVE_AS.get(t.dtype)
    return (t, None) if alias is None else (t.view(alias), t.dtype)


def restore(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` viewed as ``dtype`` again (what :func:`movable` gave), or ``t`` where it was moved as it is."""
    return t if dtype is None or t is None else t.view(dtype)
