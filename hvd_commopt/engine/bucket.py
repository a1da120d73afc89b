"""Buckets: groups of tensors packed into one flat fusion buffer and reduced together."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError
from .specs import TensorSpec

__all__ = ["Bucket", "build_buckets"]


@dataclass
class Bucket:
    """One fusion buffer's layout (the buffers themselves belong to rounds, engine/rounds.py).

    Attributes:
        index: position in the launch order (identical on every rank).
        names: member tensors, in backward order; ``offsets[i]`` is where ``names[i]`` starts.
        numel: total elements; dtype: the members' common dtype.
    """

    index: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    numel: int
    dtype: str

    @property
    def name(self) -> str:
        first = self.names[0]
        return f"bucket{self.index}:{first}" + (f"+{len(self.names) - 1}" if len(self.names) > 1 else "")


def build_buckets(specs_backward: Sequence[TensorSpec], plan: Sequence[Sequence[int]]) -> list[Bucket]:
    """Turn a plan (groups of positions in backward order) into buckets.

    A group whose members have different dtypes is split at each dtype change, because one
    flat buffer holds one dtype; the split keeps the order, so every rank splits identically.
    """
    buckets: list[Bucket] = []
    for group in plan:
        run: list[TensorSpec] = []
        for pos in group:
            s = specs_backward[pos]
            if run and run[-1].dtype != s.dtype:
                buckets.append(_bucket(len(buckets), run))
                run = []
            run.append(s)
        if run:
            buckets.append(_bucket(len(buckets), run))
    if sum(len(b.names) for b in buckets) != len(specs_backward):
        raise ConfigError("internal: the plan does not cover every tensor exactly once")
    return buckets


def _bucket(index: int, members: list[TensorSpec]) -> Bucket:
    offsets, off = [], 0
    for s in members:
        offsets.append(off)
        off += s.numel
    return Bucket(index, [s.name for s in members], [tuple(s.shape) for s in members], offsets, off, members[0].dtype)
