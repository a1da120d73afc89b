"""The low-bit quantiser's host kernels (the C extension ``hvd_commopt.compress._quantkernels``):
encode and decode in one pass each over host memory (docs/quantize.md#native).

The composed route (the adapter's ``quantize_blocks`` and ``pack_bits``, then a cat) makes about a
dozen passes and as many temporaries over a bucket: on one core of the 2-core test machine, 47 ms
to encode 6.1M elements in int8 and 15 ms to decode them, where the whole step's bf16 cast takes
3 ms, so at 1 Gbit/s the quantisers cost more compute than the bytes they save
(docs/auto-compression.md#limits). The kernel reads each block of ``block`` elements once (it stays
in cache), writes the scale, the packed codes and the decoded value, and gives the same bytes and
values as the reference, :class:`hvd_commopt.numpy_ops.NumpyOps`' kernels (the same float32
operations in the same order; tests/unit/test_quant_native.py).

Where it applies: the extension is built (setup.py, optional: without a C compiler the composed
route runs, with the same bits) and the tensor lives in host memory (a CPU tensor of any adapter,
a NumPy array). A CUDA tensor keeps the adapter's device kernels: nothing crosses to the host.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

try:  # built by setup.py where a C compiler is there (optional: the composed route stands in)
    from . import _quantkernels as _native  # type: ignore[attr-defined]  # the C extension: no stub
except ImportError:  # pragma: no cover - an install without the compiled extension
    _native = None

__all__ = ["available", "host_float32", "host_bytes", "encode", "encode_parts", "decode_into", "decode_parts",
           "empty_float32"]


def available() -> bool:
    """Whether the native kernels are built."""
    return _native is not None


def host_float32(ops: Any, t: Any) -> np.ndarray | None:
    """t's float32 values as a flat contiguous host array without a copy where the kernels apply
    (built, t in host memory), else None."""
    if _native is None or ops.on_device(t):
        return None
    a = ops.host_view(t)
    if a is None or a.dtype != np.float32 or not a.flags.c_contiguous:
        return None
    return a.reshape(-1)


def host_bytes(ops: Any, t: Any) -> np.ndarray | None:
    """A uint8 payload in host memory as a contiguous NumPy array (no copy for a torch CPU tensor
    or an array) where the kernels apply, else None."""
    if _native is None or ops.on_device(t):
        return None
    a = np.asarray(ops.to_numpy(t))
    if a.dtype != np.uint8:
        return None
    return np.ascontiguousarray(a.reshape(-1))


def empty_float32(n: int) -> np.ndarray:
    return np.empty(n, np.float32)


def encode(x: np.ndarray, bits: int, block: int, nbytes: int,
           decoded: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """(payload uint8 of ``nbytes``, decoded float32 or None) of the flat float32 host array x: the
    scales, then the codes (``nbytes``: compress.quantize.encoded_bytes, which imports this module)."""
    out = np.empty(nbytes, np.uint8)
    dec = np.empty(x.size, np.float32) if decoded else None
    _native.encode(x, bits, block, out, dec)
    return out, dec


def encode_parts(x: np.ndarray, counts: Sequence[int], sizes: Sequence[int], bits: int, block: int,
                 dec: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The payloads of x's consecutive parts (``counts`` elements each, every part blocked on its
    own, ``sizes`` bytes each) one after the other, and the decoded values of all of x (into
    ``dec`` when given)."""
    out = np.empty(sum(sizes), np.uint8)
    dec = np.empty(x.size, np.float32) if dec is None else dec
    off = boff = 0
    for c, ln in zip(counts, sizes):
        _native.encode(x[off:off + c], bits, block, out[boff:boff + ln], dec[off:off + c])
        off += c
        boff += ln
    return out, dec


def decode_into(buf: np.ndarray, n: int, bits: int, block: int, out: np.ndarray, accumulate: bool) -> None:
    """``out = decode(buf)`` (or ``out += decode(buf)``, each sum in float32), n elements."""
    _native.decode(buf, n, bits, block, out, accumulate)


def decode_parts(buf: np.ndarray, counts: Sequence[int], lens: Sequence[int], bits: int, block: int) -> np.ndarray:
    """The float32 values of consecutive payloads (``lens`` bytes, ``counts`` elements each)."""
    out = np.empty(sum(counts), np.float32)
    off = boff = 0
    for c, ln in zip(counts, lens):
        _native.decode(buf[boff:boff + ln], c, bits, block, out[off:off + c], False)
        off += c
        boff += ln
    return out
