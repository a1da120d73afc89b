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

The kernels run on host NumPy arrays (the tensor ops' zero-copy host views for CPU tensors);
device tensors are copied to the host and back (docs/quantize.md#device).
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError

__all__ = ["check_bits", "levels", "encode", "decode", "encoded_bytes"]


def check_bits(bits: object, block: object = 256) -> tuple[int, int]:
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


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return codes
    if 8 % bits == 0:  # 2 or 4 bits: whole codes per byte
        per = 8 // bits
        flat = np.zeros(-(-codes.size // per) * per, np.uint8)
        flat[:codes.size] = codes
        c = flat.reshape(-1, per)
        out = c[:, 0].copy()
        for j in range(1, per):
            out |= c[:, j] << np.uint8(bits * j)
        return out
    planes = np.unpackbits(codes[:, None], axis=1, bitorder="little")[:, :bits]  # 3, 5, 6, 7 bits
    return np.packbits(planes.reshape(-1), bitorder="little")


def _unpack(buf: np.ndarray, n: int, bits: int) -> np.ndarray:
    if bits == 8:
        return buf[:n]
    if 8 % bits == 0:
        per = 8 // bits
        shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :]
        return ((buf[:, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(-1)[:n]
    planes = np.unpackbits(buf, bitorder="little")[:n * bits].reshape(n, bits)
    return np.packbits(planes, axis=1, bitorder="little").reshape(-1)


def encode(x: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes to send, the decoded values): ``x`` (1-D float32) quantised per block."""
    n, q = x.size, levels(bits)
    nb = -(-n // block)
    flat = np.zeros(nb * block, np.float32)
    flat[:n] = x
    xp = flat.reshape(nb, block)
    scale = (np.abs(xp).max(axis=1) / np.float32(q)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.clip(np.rint(xp / safe[:, None]), -q, q)
    dec = (codes * scale[:, None]).astype(np.float32).reshape(-1)[:n]
    packed = _pack((codes.reshape(-1)[:n] + q).astype(np.uint8), bits)
    return np.concatenate([scale.view(np.uint8), packed]), dec


def decode(buf: np.ndarray, n: int, bits: int, block: int) -> np.ndarray:
    """The float32 values of an :func:`encode` payload of n elements."""
    nb, q = -(-n // block), levels(bits)
    scale = buf[:4 * nb].view(np.float32)
    codes = _unpack(buf[4 * nb:], n, bits).astype(np.float32) - np.float32(q)
    out = np.zeros(nb * block, np.float32)
    out[:n] = codes
    return (out.reshape(nb, block) * scale[:, None]).reshape(-1)[:n]
