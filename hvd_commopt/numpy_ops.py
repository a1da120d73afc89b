"""TensorOps for NumPy arrays: the reference implementation, used by unit tests and host buffers."""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["NumpyOps", "numpy_dtype"]


def numpy_dtype(name: str):
    if name == "bfloat16":
        # NumPy has no bfloat16; host-side bf16 is carried as uint16 bit patterns (see cast()).
        return np.dtype(np.uint16)
    return np.dtype(name)


class NumpyOps:
    """TensorOps over 1-D NumPy arrays. In-place where NumPy allows."""

    name = "numpy"

    def numel(self, t): return int(t.size)
    def dtype_name(self, t): return str(t.dtype)
    def shape(self, t): return tuple(t.shape)
    def device_name(self, t): return "cpu"

    def empty(self, n, dtype, like=None): return np.empty(int(n), dtype=numpy_dtype(dtype))
    def zeros(self, n, dtype, like=None): return np.zeros(int(n), dtype=numpy_dtype(dtype))
    def flatten(self, t): return t.reshape(-1)
    def reshape(self, t, shape: Sequence[int]): return t.reshape(tuple(shape))
    def slice(self, t, start, stop): return t[start:stop]
    def cat(self, ts): return np.concatenate([np.asarray(x).reshape(-1) for x in ts])

    def copy_into(self, dst, offset, src):
        src = np.asarray(src).reshape(-1)
        dst[offset:offset + src.size] = src
        return dst

    def clone(self, t): return np.array(t, copy=True)

    def cast(self, t, dtype):
        if dtype == "bfloat16":  # round-to-nearest-even to the top 16 bits of float32
            u = np.asarray(t, dtype=np.float32).view(np.uint32)
            rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
            return ((u + rounding) >> 16).astype(np.uint16)
        if t.dtype == np.uint16 and dtype.startswith("float"):  # from bf16 bit patterns
            return (t.astype(np.uint32) << 16).view(np.float32).astype(dtype)
        return t.astype(numpy_dtype(dtype), copy=False)

    def scale(self, t, factor):
        t *= t.dtype.type(factor)
        return t

    def add(self, a, b):
        a += b
        return a

    def sub(self, a, b):
        a -= b
        return a

    def topk_abs(self, t, k):
        # A stable sort on -|t| keeps equal magnitudes in index order: ties go to the lower
        # index, the same on every rank (spec §11.8). Indices are returned ascending, the
        # canonical form every TensorOps uses.
        idx = np.sort(np.argsort(-np.abs(t), kind="stable")[:k]).astype(np.int64)
        return t[idx], idx

    def gather(self, t, idx): return t[idx]

    def scatter_add(self, dst, idx, vals):
        np.add.at(dst, idx, vals)
        return dst

    def index_fill(self, t, idx, value):
        t[idx] = value
        return t

    def arange(self, n, like=None): return np.arange(n, dtype=np.int64)

    def unique_sum(self, idx, vals):
        u, inv = np.unique(np.asarray(idx, dtype=np.int64), return_inverse=True)
        out = np.zeros(u.size, dtype=vals.dtype)
        np.add.at(out, inv.reshape(-1), vals)  # unbuffered: duplicates summed in input order
        return u, out

    def isin(self, elements, test, invert=False): return np.isin(elements, test, invert=invert)
    def nonzero(self, mask): return np.flatnonzero(mask).astype(np.int64, copy=False)
    def abs_ge(self, t, threshold): return np.abs(t) >= threshold

    def norm(self, t):
        acc = np.float64 if t.dtype == np.float64 else np.float32
        return float(np.sqrt(np.sum(np.square(t, dtype=acc), dtype=acc)))

    def to_numpy(self, t): return t
    def from_numpy(self, a, like=None): return a
