"""Low-bit quantisation with a scale per chunk (docs/quantize.md#encoding): the encoding of
``Compression.quantize(bits)``; the exchange is :mod:`hvd_commopt.reduce.quantized`.

A flat float32 vector is cut into chunks of ``block`` elements; each chunk is sent as its scale
``s = max|x| / q`` (float32, ``q = 2**(bits-1) - 1``) and one signed code per element,
``c = round(x / s)`` in ``[-q, q]``, stored offset by q in ``bits`` bits (codes packed little-end
first into bytes). Decoding is ``c * s``. Choices:

* Symmetric, round to nearest (numpy's ``rint``, ties to even), no stochastic rounding: error
  feedback carries what rounding drops, so the bias does not accumulate (docs/quantize.md#error-feedback).
* 2 bits is ternary ``{-s, 0, s}`` (q = 1), SparseLoCo's 2-bit setting; 8 bits is int8 (q = 127).
* The per-element error is at most ``s / 2 = max|chunk| / (2q)``; and with ``|c| >= 1`` the decoded
  value lies within a factor 2 of x, so ``x - decode`` is exact in float32 (Sterbenz) and
  ``decode + (x - decode) == x`` bit for bit: error feedback loses nothing (docs/quantize.md#invariants).

Written against :class:`~hvd_commopt.tensor_ops.TensorOps`: the per-block arithmetic
(``quantize_blocks``, ``dequantize_blocks``) and the bit packing (``pack_bits``, ``unpack_bits``)
are adapter kernels with one specification, so a CUDA tensor is encoded on its device, with the
same bytes and values as the NumPy reference (docs/quantize.md#device).
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..tensor_ops import TensorOps

__all__ = ["check_bits", "levels", "encode", "decode", "encoded_bytes", "DEFAULT_BLOCK"]

Tensor = Any

#: Elements per float32 scale unless ``block=`` says otherwise (``Compression.quantize``, and ``auto``'s quantisers).
DEFAULT_BLOCK = 256


def check_bits(bits: object, block: object = DEFAULT_BLOCK) -> tuple[int, int]:
    """``(bits, block)`` validated: bits in 2..8, block >= 1."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ConfigError(f"quantize bits must be an integer from 2 to 8 (8 = int8, 4 = int4, 2 = ternary), got "
                          f"{bits!r}; for 16 bits use Compression.fp16 / Compression.bf16, for 1 bit the ternary "
                          f"or sign compressors")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ConfigError(f"quantize block must be a positive integer (elements per scale), got {block!r}")
    return bits, block


def levels(bits: int) -> int:
    """q: codes lie in [-q, q]."""
    return (1 << (bits - 1)) - 1


def encoded_bytes(n: int, bits: int, block: int) -> int:
    """Bytes of ``encode`` for n elements: one float32 scale per block, then the packed codes."""
    return 4 * (-(-n // block)) + (n * bits + 7) // 8


def encode(ops: TensorOps, x: Tensor, bits: int, block: int) -> tuple[Tensor, Tensor]:
    """(the bytes to send, the decoded values): ``x`` (1-D float32) quantised per block; the bytes
    are the float32 scales, then the codes packed ``bits`` bits each (a uint8 tensor on x's device)."""
    scales, codes, dec = ops.quantize_blocks(x, bits, block)
    return ops.cat([ops.as_bytes(scales), ops.pack_bits(codes, bits)]), dec


def decode(ops: TensorOps, buf: Tensor, n: int, bits: int, block: int) -> Tensor:
    """The float32 values of an :func:`encode` payload (uint8 tensor) of n elements."""
    nb = -(-n // block)
    scales = ops.from_bytes(ops.slice(buf, 0, 4 * nb), "float32")
    codes = ops.unpack_bits(ops.slice(buf, 4 * nb, ops.numel(buf)), n, bits)
    return ops.dequantize_blocks(scales, codes, bits, block)
