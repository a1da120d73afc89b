"""The cross-rank check that every rank registered the same tensors."""
from __future__ import annotations

import hashlib
from typing import Sequence

from ..buckets import TensorSpec
from ..comm.communicator import Communicator
from ..errors import ConfigError, RankMismatchError

__all__ = ["TensorSpec", "verify_same_tensors"]


def _digest(specs: Sequence[TensorSpec]) -> str:
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}|{s.shape}|{s.dtype};".encode())
    return h.hexdigest()


def verify_same_tensors(comm: Communicator, specs: Sequence[TensorSpec], what: str = "model") -> None:
    """Refuse to start unless every rank registered the same tensors (names, shapes, dtypes).

    Compares a 32-byte digest across ranks; only on a mismatch are the full lists exchanged, so
    the error can name the first differing tensor. Every rank raises the same error (nobody is
    left waiting in a collective).

    Raises:
        RankMismatchError: naming the first differing tensor and the ranks concerned.
    """
    names = [s.name for s in specs]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ConfigError(f"tensor names must be unique; duplicates: {dups}. Pass "
                          f"named_parameters=model.named_parameters().")
    if comm.size == 1:
        return
    digests = comm.allgather_object(_digest(specs), name="verify.digest")
    if len(set(digests)) == 1:
        return
    lists = comm.allgather_object([(s.name, tuple(s.shape), s.dtype) for s in specs], name="verify.specs")
    ref = lists[0]
    for r, other in enumerate(lists[1:], start=1):
        if other == ref:
            continue
        for i in range(max(len(ref), len(other))):
            a = ref[i] if i < len(ref) else None
            b = other[i] if i < len(other) else None
            if a != b:
                def fmt(t):
                    return "nothing" if t is None else f"'{t[0]}' shape {tuple(t[1])} {t[2]}"
                raise RankMismatchError(
                    f"the {what} differs across ranks: tensor #{i} is {fmt(a)} on rank 0 but {fmt(b)} "
                    f"on rank {r} (rank 0 has {len(ref)} tensors, rank {r} has {len(other)}). Build the "
                    f"same model on every rank (same code, same arguments) before wrapping the optimizer.")
