"""Threshold fusion with Horovod's meaning.

Plan representation used by every planner in :mod:`hvd_commopt.fusion`: a list of groups, each a
list of tensor positions in *backward order* (position 0 = the first gradient to become ready,
i.e. the last layer). Groups are contiguous, cover every position exactly once, and are
communicated in list order.

Horovod packs ready tensors into one fusion buffer until adding the next would exceed
``HOROVOD_FUSION_THRESHOLD`` bytes (a tensor larger than the threshold travels alone);
``threshold == 0`` disables fusion (one tensor per message). We plan that statically over the
backward order, which is what Horovod converges to when gradients arrive in that order.

:func:`plan_bucket_cap` is PyTorch DDP's rule instead (docs/wrapper.md#first-bucket): a bucket
takes tensors until it *reaches* its cap (1 MiB for the first, then the threshold), so it may
exceed the cap by its last tensor. On a model with large layers this moves bytes from the last
bucket (sent after backward) into the earlier ones (sent during backward).
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["plan_threshold", "plan_bucket_cap", "plan_per_tensor", "plan_single", "validate_plan"]


def plan_threshold(sizes_bytes: Sequence[int], threshold_bytes: int,
                   first_bytes: int | None = None) -> list[list[int]]:
    """Greedy contiguous packing of tensors (in backward order) under ``threshold_bytes``;
    the first group under ``first_bytes`` when given and smaller (DDP's small first bucket)."""
    return _pack(sizes_bytes, threshold_bytes, first_bytes, reach=False)


def plan_bucket_cap(sizes_bytes: Sequence[int], cap_bytes: int, first_bytes: int | None = None) -> list[list[int]]:
    """DDP's bucket assignment over the backward order: a group closes as soon as its bytes reach
    ``first_bytes`` (the first group, when given and smaller than the cap) or ``cap_bytes`` (the
    others); ``cap_bytes == 0`` is one tensor per group, as with :func:`plan_threshold`."""
    return _pack(sizes_bytes, cap_bytes, first_bytes, reach=True)


def _pack(sizes_bytes: Sequence[int], cap_bytes: int, first_bytes: int | None, reach: bool) -> list[list[int]]:
    """Contiguous groups under each group's limit (``first_bytes`` for the first when smaller):
    ``reach`` closes a group once it reaches the limit (DDP), else before it would exceed it
    (Horovod; a tensor larger than the limit travels alone)."""
    if cap_bytes < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {cap_bytes}")
    if cap_bytes == 0:
        return plan_per_tensor(len(sizes_bytes))
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, nb in enumerate(sizes_bytes):
        limit = min(cap_bytes, first_bytes) if first_bytes and not groups else cap_bytes
        if not reach and current and filled + nb > limit:
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += nb
        if reach and filled >= limit:
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    return groups


def plan_per_tensor(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


def plan_single(n: int) -> list[list[int]]:
    return [list(range(n))] if n else []


def validate_plan(plan: Sequence[Sequence[int]], n: int) -> None:
    """Raise ValueError unless ``plan`` is contiguous groups covering 0..n-1 once, in order."""
    flat = [i for g in plan for i in g]
    if flat != list(range(n)) or any(len(g) == 0 for g in plan):
        raise ValueError(f"invalid plan for {n} tensors: groups must be non-empty, contiguous and "
                         f"cover 0..{n - 1} in order; got {[list(g) for g in plan]}")
