"""Precision-reducing compressors: none, fp16, bf16 (Horovod's ``Compression.none``/``.fp16``).

Choice: fp16 and bf16 divide by P *before* the sum (``predivide``), so a sum of P gradients
cannot overflow half precision's range; the cost is that tiny gradients divided by P may
underflow in fp16 (bf16 keeps fp32's exponent range and does not).
"""
from __future__ import annotations

from typing import Any

from ..tensor_ops import TensorOps, ops_for
from .base import Compressor

_NO_CTX = object()


def _horovod_form(ops, flat, payload=_NO_CTX):
    """Horovod's user code calls ``compress(tensor)`` / ``decompress(tensor, ctx)`` without ops:
    shift the arguments and look the ops up from the tensor (docs/horovod_api.md#compressors)."""
    if payload is _NO_CTX:
        return ops_for(ops), ops, flat
    return ops, flat, payload

__all__ = ["NoneCompressor", "FP16Compressor", "BF16Compressor"]


class NoneCompressor(Compressor):
    """Sends the bucket as it is."""

    name = "none"
    lossless = True

    def compress(self, ops: TensorOps, flat: Any = _NO_CTX) -> tuple[Any, Any]:
        if flat is _NO_CTX:  # Horovod's form: compress(tensor)
            return ops, None
        return flat, None

    def decompress(self, ops: TensorOps, payload: Any, ctx: Any = _NO_CTX) -> Any:
        return ops if ctx is _NO_CTX else payload


class _CastCompressor(Compressor):
    target = "float16"
    predivide = True
    wire_bytes_ratio = 0.5

    def compress(self, ops: TensorOps, flat: Any = _NO_CTX) -> tuple[Any, Any]:
        if flat is _NO_CTX:  # Horovod's form: compress(tensor)
            ops, flat = ops_for(ops), ops
        dtype = ops.dtype_name(flat)
        if not dtype.startswith("float") or dtype == self.target:
            return flat, None  # integers and already-narrow tensors travel unchanged
        return ops.cast(flat, self.target), dtype

    def decompress(self, ops: TensorOps, payload: Any, ctx: Any = _NO_CTX) -> Any:
        ops, payload, ctx = _horovod_form(ops, payload, ctx)
        return payload if ctx is None else ops.cast(payload, ctx)

    def decompress_into(self, ops: TensorOps, payload: Any, ctx: Any, into: Any) -> Any:
        """The cast back written into ``into``, the round's float buffer: no new buffer, whose page
        faults cost more than the cast itself (docs/auto-compression.md#dense-path)."""
        return payload if ctx is None else ops.cast_into(into, payload)


class FP16Compressor(_CastCompressor):
    """Casts floating buckets to float16 for the wire and back afterwards."""

    name = "fp16"
    target = "float16"


class BF16Compressor(_CastCompressor):
    """Casts floating buckets to bfloat16 for the wire and back afterwards."""

    name = "bf16"
    target = "bfloat16"
