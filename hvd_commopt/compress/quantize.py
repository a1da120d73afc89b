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
same bytes and values as the NumPy reference (docs/quantize.md#device). A tensor in host memory
takes the native kernel of :mod:`hvd_commopt.compress.quant_native` instead where it is built: the
same bytes in one pass over the bucket, where the composed ops make a dozen (docs/quantize.md#native).
"""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import ConfigError
from ..tensor_ops import TensorOps
from . import quant_native

__all__ = ["check_bits", "levels", "encode", "encode_payload", "encode_parts", "decode", "decode_sum", "decode_parts",
           "encoded_bytes", "DEFAULT_BLOCK"]

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
    hx = quant_native.host_float32(ops, x)
    if hx is not None:
        out, dec = quant_native.encode(hx, bits, block, encoded_bytes(hx.size, bits, block))
        return ops.from_numpy(out, like=x), ops.from_numpy(dec, like=x)
    scales, codes, dec = ops.quantize_blocks(x, bits, block)
    return ops.cat([ops.as_bytes(scales), ops.pack_bits(codes, bits)]), dec


def encode_payload(ops: TensorOps, x: Tensor, bits: int, block: int) -> Tensor:
    """:func:`encode`'s bytes alone (the decoded values are not written where the kernel runs)."""
    hx = quant_native.host_float32(ops, x)
    if hx is not None:
        return ops.from_numpy(quant_native.encode(hx, bits, block, encoded_bytes(hx.size, bits, block),
                                                  decoded=False)[0], like=x)
    return encode(ops, x, bits, block)[0]


def encode_parts(ops: TensorOps, x: Tensor, counts: Sequence[int], bits: int, block: int,
                 dec_into: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`encode` of consecutive parts of ``x`` (``counts`` elements each), every part with
    blocks of its own: (the parts' payloads one after the other, the decoded values of all of x).
    ``dec_into``: a mutable float32 tensor of x's size that the decoded values may be written into
    (the caller's buffer, reused from round to round: a fresh 25 MB vector costs its page faults,
    6 ms a round on the test machine, docs/quantize.md#native); the result is then that tensor."""
    hx = quant_native.host_float32(ops, x)
    if hx is not None:  # straight into the message and the decoded vector: no per-part buffers, no cat
        into = quant_native.host_float32(ops, dec_into) if dec_into is not None and ops.slices_are_views else None
        out, dec = quant_native.encode_parts(hx, counts, [encoded_bytes(c, bits, block) for c in counts], bits, block,
                                             into)
        return ops.from_numpy(out, like=x), (dec_into if into is not None else ops.from_numpy(dec, like=x))
    parts, decs, off = [], [], 0
    for c in counts:
        p, d = encode(ops, ops.slice(x, off, off + c), bits, block)
        parts.append(p)
        decs.append(d)
        off += c
    return ops.cat(parts), ops.cat(decs)


def decode_sum(ops: TensorOps, payloads: Sequence[Tensor], n: int, bits: int, block: int,
               into: Tensor | None = None) -> Tensor:
    """The float32 sum, in order, of the decoded payloads (at least one, n elements each): ``0 + d0 + d1 + ...``
    (a decoded value is never -0.0, so the first sum is the first decoding). ``into``: a mutable
    float32 tensor of n elements the sum may be written into where the kernel runs (the caller's
    buffer, reused); the result is then that tensor."""
    hbs = [quant_native.host_bytes(ops, p) for p in payloads]  # None where the kernels do not apply
    if all(hb is not None for hb in hbs):
        hi = quant_native.host_float32(ops, into) if into is not None and ops.slices_are_views else None
        out = quant_native.empty_float32(n) if hi is None else hi
        for j, hb in enumerate(hbs):
            quant_native.decode_into(hb, n, bits, block, out, accumulate=j > 0)
        return into if hi is not None else ops.from_numpy(out, like=payloads[0])
    out = ops.zeros(n, "float32", like=payloads[0])
    for p in payloads:
        out = ops.add(out, decode(ops, p, n, bits, block))
    return out


def decode_parts(ops: TensorOps, buf: Tensor, counts: Sequence[int], lens: Sequence[int], bits: int, block: int,
                 like: Tensor) -> Tensor:
    """The float32 values of consecutive :func:`encode` payloads (``lens`` bytes, ``counts``
    elements each) as one vector on like's device."""
    hb = quant_native.host_bytes(ops, buf)
    if hb is not None:
        return ops.from_numpy(quant_native.decode_parts(hb, counts, lens, bits, block), like=like)
    outs, off = [], 0
    for c, ln in zip(counts, lens):
        outs.append(decode(ops, ops.slice(buf, off, off + ln), c, bits, block))
        off += ln
    return ops.cat(outs)


def decode(ops: TensorOps, buf: Tensor, n: int, bits: int, block: int) -> Tensor:
    """The float32 values of an :func:`encode` payload (uint8 tensor) of n elements."""
    hb = quant_native.host_bytes(ops, buf)
    if hb is not None:
        out = quant_native.empty_float32(n)
        quant_native.decode_into(hb, n, bits, block, out, accumulate=False)
        return ops.from_numpy(out, like=buf)
    nb = -(-n // block)
    scales = ops.from_bytes(ops.slice(buf, 0, 4 * nb), "float32")
    codes = ops.unpack_bits(ops.slice(buf, 4 * nb, ops.numel(buf)), n, bits)
    return ops.dequantize_blocks(scales, codes, bits, block)
