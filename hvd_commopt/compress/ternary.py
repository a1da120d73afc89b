"""Ternary quantization (MXNet's 2-bit ``quantize_2bit``), the compression of CD-SGD (docs/cd-sgd.md#update-rule).

With error feedback (:class:`~hvd_commopt.memory.error_feedback.ErrorFeedback`, which keeps
``r = acc - theta*s``), per bucket and step::

    acc = r + g;   s = +1 if acc >= theta, -1 if acc <= -theta, else 0;   r = acc - theta*s

The signs are what is sent, as integers, and they are **summed exactly by an integer
allreduce** (docs/cd-sgd.md#collective-equivalent, "recommended, exact"): ``sum_i q_i = theta * sum_i s_i``, the server's
dequantize-then-sum with one rounding (theta times an integer) instead of P-1, and bit-identical
to it when theta is a power of two (T-CD-4). Traffic: one byte per element instead of four.

Overflow guard: ``sum_i s_i`` lies in [-P, P], so int8 is exact for P <= 127; larger jobs use
int16 (P <= 32767) and then int32, chosen once from the number of ranks.

``DenseAllreduce(TernaryCompressor(theta, size), ErrorFeedback())`` is CD-SGD's reducer.
"""
from __future__ import annotations

from typing import Any

from ..tensor_ops import TensorOps
from .base import Compressor

__all__ = ["TernaryCompressor", "wire_dtype_for"]


def wire_dtype_for(size: int) -> str:
    """Smallest integer type in which a sum of ``size`` values in {-1, 0, 1} cannot overflow."""
    if size <= 127:
        return "int8"
    if size <= 32767:
        return "int16"
    return "int32"


class TernaryCompressor(Compressor):
    """Signs of ``|x| >= theta`` as integers; decompressed as ``theta * sum of signs``.

    Args:
        theta: the quantizer's threshold on the gradient it is given.
        size: the number of ranks (chooses the wire dtype).
    """

    name = "ternary"
    wire_bytes_ratio = 0.25  # one byte per float32 element (int8 up to 127 ranks)

    def __init__(self, theta: float, size: int):
        self.theta = float(theta)
        self.wire_dtype = wire_dtype_for(size)

    def compress(self, ops: TensorOps, flat: Any) -> tuple[Any, Any]:
        return ops.ternary(flat, self.theta, self.wire_dtype), ops.dtype_name(flat)

    def decompress(self, ops: TensorOps, payload: Any, ctx: Any) -> Any:
        return ops.scale(ops.cast(payload, ctx), self.theta)  # theta * sum_i s_i: one rounding

    def config(self) -> dict:
        return {"name": self.name, "theta": self.theta, "wire_dtype": self.wire_dtype}

    def __repr__(self) -> str:
        return f"TernaryCompressor(theta={self.theta}, wire={self.wire_dtype})"
