"""Dtype names and the host representation of half precision, shared by every host-buffer path.

The core names dtypes by strings ("float32", "bfloat16", ...), never by framework objects.
NumPy has no bfloat16, so on the host a bfloat16 tensor travels as its uint16 bit patterns;
these helpers widen such buffers (and float16 ones) to float32 for arithmetic and round them
back to nearest-even, the conversion the frameworks use.
"""
from __future__ import annotations

import numpy as np

__all__ = ["DTYPE_BYTES", "numpy_dtype", "half_to_float32", "float32_to_half"]

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype a host buffer of core dtype ``name`` uses (bfloat16: uint16 bit patterns)."""
    if name == "bfloat16":
        return np.dtype(np.uint16)
    return np.dtype(name)


def half_to_float32(a: np.ndarray) -> np.ndarray:
    """float16, or bfloat16 carried as uint16 bit patterns, to float32 (exact)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def float32_to_half(x: np.ndarray, dtype) -> np.ndarray:
    """float32 to float16, or to bfloat16 bit patterns (uint16) rounded to nearest even."""
    if np.dtype(dtype) == np.uint16:
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        return ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    return x.astype(np.float16)


# NumPy float dtype -> (key dtype, abs mask): |x| as its bit pattern (docs/selection.md#order)
_KEY_OF: dict[np.dtype, tuple[np.dtype, int]] = {np.dtype(np.float32): (np.dtype(np.int32), 0x7FFFFFFF),
                                                   np.dtype(np.float64): (np.dtype(np.int64), 0x7FFFFFFFFFFFFFFF),
                                                   np.dtype(np.float16): (np.dtype(np.int16), 0x7FFF)}


def magnitude_key(value: float, dtype) -> int:
    """The key of ``|value|`` rounded to the NumPy float ``dtype``: its bit pattern with the sign
    cleared, an integer that orders like the magnitude (docs/selection.md#order). Beyond the
    dtype's range it rounds to +Inf, as a cast does."""
    kd, mask = _KEY_OF[np.dtype(dtype)]
    with np.errstate(over="ignore"):
        return int(np.array(value, dtype=dtype).view(kd)) & mask
