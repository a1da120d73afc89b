"""Compressor: what moves in a dense exchange. A compressor never communicates (GRACE's lesson); it
declares the collective its payload needs so the engine can check compatibility when the
optimizer is built. Sparse selections (top-k, random-k, DGC) are not compressors but selectors
(:class:`~hvd_commopt.compress.selector.Selector`), used by the sparse reducers."""
from __future__ import annotations

import abc
from typing import Any

from ..tensor_ops import TensorOps

__all__ = ["Compressor"]


class Compressor(abc.ABC):
    """Turns a flat bucket into a payload that can be summed element-wise, and back.

    Attributes:
        collective: "allreduce": payloads from different ranks are summed element-wise.
        predivide: True when the average must be taken *before* the sum (fp16 overflows
            otherwise); the dense reducer then scales by 1/P before compressing.
        lossless: True when decompress(compress(x)) == x exactly (nothing for an error-feedback
            memory to remember).
        wire_bytes_ratio: bytes on the wire per byte of a float32 bucket (the planners' price).
    """

    collective: str = "allreduce"
    predivide: bool = False
    lossless: bool = False
    wire_bytes_ratio: float = 1.0
    name: str = "abstract"

    @abc.abstractmethod
    def compress(self, ops: TensorOps, flat: Any) -> tuple[Any, Any]:
        """Return (payload, ctx); ctx is whatever decompress needs."""

    @abc.abstractmethod
    def decompress(self, ops: TensorOps, payload: Any, ctx: Any) -> Any:
        """Inverse of compress on the reduced payload; returns a tensor of ctx's dtype."""

    def decompress_into(self, ops: TensorOps, payload: Any, ctx: Any, into: Any) -> Any:
        """``decompress``, where the compressor may write its result into ``into`` (a buffer of the
        uncompressed dtype and size that nothing reads any more: the round's fusion buffer); by
        default the result is decompress's own."""
        return self.decompress(ops, payload, ctx)

    def config(self) -> dict:
        """The configuration, as plain values: compared across ranks (they must agree)."""
        return {"name": self.name}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
