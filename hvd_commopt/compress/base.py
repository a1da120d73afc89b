"""Compressor: what moves. A compressor never communicates (GRACE's lesson); it declares the
collective its payload needs so the engine can check compatibility when the optimizer is built."""
from __future__ import annotations

import abc
from typing import Any

from ..tensor_ops import TensorOps

__all__ = ["Compressor"]


class Compressor(abc.ABC):
    """Turns a flat bucket into a payload and back.

    Attributes:
        collective: "allreduce" when payloads from different ranks can be summed element-wise
            (none, fp16, bf16, random-k with a shared seed), "sparse" when they must be exchanged
            as (values, indices) and merged (top-k, DGC, gTop-k).
        predivide: True when the average must be taken *before* the sum (fp16 overflows
            otherwise); the engine then scales by 1/P before compressing.
    """

    collective: str = "allreduce"
    predivide: bool = False
    name: str = "abstract"

    @abc.abstractmethod
    def compress(self, ops: TensorOps, flat: Any) -> tuple[Any, Any]:
        """Return (payload, ctx); ctx is whatever decompress needs."""

    @abc.abstractmethod
    def decompress(self, ops: TensorOps, payload: Any, ctx: Any) -> Any:
        """Inverse of compress on the reduced payload; returns a tensor of ctx's dtype."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
