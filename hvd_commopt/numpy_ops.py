"""TensorOps for NumPy arrays: the reference implementation, used by unit tests and host buffers."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .dtypes import float32_to_half, half_to_float32, magnitude_key, numpy_dtype
from .host_memory import scale_add, stream_store

__all__ = ["NumpyOps", "numpy_dtype"]

_NP_CMP = {"ge": np.greater_equal, "gt": np.greater, "le": np.less_equal, "lt": np.less}
_KEY_DTYPES = {2: (np.int16, 0x7FFF), 4: (np.int32, 0x7FFFFFFF), 8: (np.int64, 0x7FFFFFFFFFFFFFFF)}
# float width -> (magnitude mask, key of +Inf) (docs/selection.md#order)
_MAG_INF = {2: (0x7FFF, 0x7C00), 4: (0x7FFFFFFF, 0x7F800000), 8: (0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}


class NumpyOps:
    """TensorOps over 1-D NumPy arrays. In-place where NumPy allows."""

    name = "numpy"
    slices_are_views = True  # slice() shares memory, so writes into a slice land in the buffer

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
        part = dst[offset:offset + src.size]
        if src.dtype != dst.dtype or not stream_store(part, src):  # docs/selection.md#streaming-stores
            part[...] = src
        return dst

    def clone(self, t): return np.array(t, copy=True)

    def exclusive(self, t):
        return False  # NumPy does not track views (a view holds a reference like any other)

    def zero_(self, t):
        if not stream_store(t):  # docs/selection.md#streaming-stores
            t.fill(0)
        return t

    def cast(self, t, dtype):
        # host-side bfloat16 is carried as uint16 bit patterns (hvd_commopt.dtypes)
        if dtype == "bfloat16":
            return float32_to_half(np.asarray(t, dtype=np.float32), np.uint16)
        if t.dtype == np.uint16 and dtype.startswith("float"):
            return half_to_float32(t).astype(dtype)
        return t.astype(numpy_dtype(dtype), copy=False)

    def as_bytes(self, t): return np.ascontiguousarray(t).reshape(-1).view(np.uint8)

    def from_bytes(self, b, dtype):
        # "bfloat16" (and the host name of its bits, "uint16") both view as uint16 bit patterns
        return np.ascontiguousarray(b).reshape(-1).view(numpy_dtype(dtype))

    def scale(self, t, factor):
        t *= t.dtype.type(factor)
        return t

    def scale_into(self, dst, t, factor):
        return np.multiply(t, t.dtype.type(factor), out=dst)

    def add(self, a, b):
        a += b
        return a

    def scale_add_into(self, dst, t, factor, g): return scale_add(dst, t, factor, g)

    def sub(self, a, b):
        a -= b
        return a

    def mul(self, a, b): return a * b

    def trunc_divide(self, t, d):
        q = np.abs(t) // t.dtype.type(d)
        t[...] = np.where(t < 0, -q, q)
        return t

    def copy_(self, dst, src):
        np.copyto(dst, src)
        return dst

    def cast_into(self, dst, src):  # bfloat16's uint16 bit patterns are converted, not copied as integers
        np.copyto(dst, self.cast(src, self.dtype_name(dst)))
        return dst

    def axpy_(self, y, alpha, x):
        y += x * y.dtype.type(alpha)
        return y

    def axpy_into(self, dst, y, alpha, x):
        return np.add(y, x * y.dtype.type(alpha), out=dst)

    def ternary(self, t, theta, dtype):
        th = t.dtype.type(theta)
        return (t >= th).astype(numpy_dtype(dtype)) - (t <= -th).astype(numpy_dtype(dtype))

    def topk_abs(self, t, k):
        # A stable sort on -|t| keeps equal magnitudes in index order: ties go to the lower
        # index, the same on every rank (docs/wrapper.md#topk-ties). Indices are returned ascending, the
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

    def index_copy(self, t, idx, vals):
        t[idx] = vals
        return t

    def arange(self, n, like=None): return np.arange(n, dtype=np.int64)
    def shift(self, idx, offset): return np.add(idx, int(offset), dtype=np.int64)

    def unique_sum(self, idx, vals):
        u, inv = np.unique(np.asarray(idx, dtype=np.int64), return_inverse=True)
        out = np.zeros(u.size, dtype=vals.dtype)
        np.add.at(out, inv.reshape(-1), vals)  # unbuffered: duplicates summed in input order
        return u, out

    def isin(self, elements, test, invert=False): return np.isin(elements, test, invert=invert)
    def nonzero(self, mask, sparse=False): return np.flatnonzero(mask).astype(np.int64, copy=False)
    def abs_ge(self, t, threshold): return np.abs(t) >= threshold

    def argsort(self, t, descending=False):
        t = np.asarray(t).reshape(-1)
        if not descending:
            return np.argsort(t, kind="stable").astype(np.int64, copy=False)
        # stable descending: the ascending stable order of the reversed array, reversed back
        return (t.size - 1 - np.argsort(t[::-1], kind="stable"))[::-1].astype(np.int64)

    def searchsorted(self, sorted_seq, values):
        return np.searchsorted(sorted_seq, values, side="left").astype(np.int64, copy=False)

    def equal(self, a, b): return np.equal(a, b)
    def cumsum(self, t): return np.cumsum(t, dtype=np.int64)

    # -- magnitude keys (docs/selection.md#order) ---------------------------------------------
    def abs_keys(self, t):
        kd, mask = _KEY_DTYPES[t.dtype.itemsize]
        return np.bitwise_and(t.view(kd), kd(mask))

    def abs_key(self, value, like): return magnitude_key(value, like.dtype)
    def compare(self, t, op, value): return _NP_CMP[op](t, t.dtype.type(value))

    def kth_smallest(self, t, k):
        t = np.asarray(t).reshape(-1)
        return int(np.partition(t, int(k) - 1)[int(k) - 1])

    def all_finite(self, t):
        # One summing pass: any NaN/Inf makes the sum non-finite; only then (or on an overflow of
        # finite values) the exact element check runs.
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(np.sum(t))) or bool(np.isfinite(t).all())

    # -- the device route (docs/selection.md#device-route): NumPy has no device, no sync to avoid
    def on_device(self, t): return False

    def topk_abs_index(self, t, k): return topk_index_np(np.asarray(t).reshape(-1), k)
    def threshold_reuse(self, t, k, lo_c, hi_c, tau, prev): return None  # the portable select/device.py one
    def add_topk_abs_index(self, t, addend, out, k): return None  # no fused kernel: add, then topk_abs_index
    def add_threshold_reuse(self, t, addend, out, k, lo_c, hi_c, tau, prev): return None

    def topk_abs_ranked(self, t, k): return topk_ranked_np(np.asarray(t).reshape(-1), k)
    def count_true(self, mask): return np.array([np.count_nonzero(mask)], dtype=np.int64)
    def sort(self, t): return np.sort(t)
    def finite_flag(self, t, how="all"):
        fin = np.isfinite(t)
        return np.bool_(fin.all() if how == "all" else fin.any())

    def where(self, flag, a, b): return np.where(flag, a, np.asarray(b, dtype=a.dtype))
    def read_flags(self, flags): return tuple(bool(f) for f in flags)

    def norm(self, t):
        acc = np.float64 if t.dtype == np.float64 else np.float32
        return float(np.sqrt(np.sum(np.square(t, dtype=acc), dtype=acc)))

    def clip_to_norm_(self, t, max_norm, eps):
        acc = np.float64 if t.dtype == np.float64 else np.float32
        coef = np.float64(max_norm) / (np.float64(np.sqrt(np.sum(np.square(t, dtype=acc), dtype=acc))) + eps)
        t *= t.dtype.type(coef if coef < 1 else 1.0)
        return t

    # low-bit quantisation: the reference kernels (docs/quantize.md#encoding)
    def quantize_blocks(self, t, bits, block):
        n, q = t.size, (1 << (bits - 1)) - 1
        nb = -(-n // block)
        flat = np.zeros(nb * block, np.float32)
        flat[:n] = t.reshape(-1)
        xp = flat.reshape(nb, block)
        scale = (np.abs(xp).max(axis=1) / np.float32(q)).astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1.0))
        codes = np.clip(np.rint(xp / safe[:, None]), -q, q)
        dec = (codes * scale[:, None]).astype(np.float32).reshape(-1)[:n]
        return scale, (codes.reshape(-1)[:n] + q).astype(np.uint8), dec

    def dequantize_blocks(self, scales, codes, bits, block):
        n, nb, q = codes.size, scales.size, (1 << (bits - 1)) - 1
        out = np.zeros(nb * block, np.float32)
        out[:n] = codes.astype(np.float32) - np.float32(q)
        return (out.reshape(nb, block) * scales[:, None]).reshape(-1)[:n]

    def pack_bits(self, codes, bits):
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

    def topk_abs_rows(self, t, width, k):
        comp = _row_keys(np.asarray(t).reshape(-1, width), width)
        if k >= width:
            part = np.broadcast_to(np.arange(width, dtype=np.int64), comp.shape)
        else:  # the k largest of each row (unique keys: no ties left), then ranked
            part = np.argpartition(-comp, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(comp, part, axis=1), axis=1)
        return np.take_along_axis(part, order, axis=1).astype(np.int64).reshape(-1)

    def unpack_bits(self, buf, n, bits):
        if bits == 8:
            return buf[:n]
        if 8 % bits == 0:
            per = 8 // bits
            shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :]
            return ((buf[:, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(-1)[:n]
        planes = np.unpackbits(buf, bitorder="little")[:n * bits].reshape(n, bits)
        return np.packbits(planes, axis=1, bitorder="little").reshape(-1)

    def host_view(self, t):
        """The array itself, flat, where it is contiguous (a view), else None."""
        return t.reshape(-1) if isinstance(t, np.ndarray) and t.flags.c_contiguous else None

    def to_numpy(self, t): return t
    def from_numpy(self, a, like=None): return a


def _magnitude_keys(a: np.ndarray) -> np.ndarray:
    """The canonical int64 magnitude key of every element of a contiguous host array (float16/32/64,
    or bfloat16 as its uint16 bit pattern): |x|'s bit pattern, every NaN one key above +Inf."""
    bits = a.view(np.uint16) if a.dtype == np.uint16 else a.view(_KEY_DTYPES[a.dtype.itemsize][0])
    mask, inf = (0x7FFF, 0x7F80) if a.dtype == np.uint16 else _MAG_INF[a.dtype.itemsize]
    return np.minimum(np.bitwise_and(bits.astype(np.int64), mask), inf + 1)


def topk_ranked_np(a: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``TensorOps.topk_abs_ranked`` of a host array: a stable sort of the canonical magnitude keys."""
    keys = _magnitude_keys(a)
    order = np.argsort(-keys, kind="stable")[:int(k)].astype(np.int64)
    return order, keys[order]


def _row_keys(rows: np.ndarray, width: int) -> np.ndarray:
    """Unique int64 keys of float32 rows: the canonical magnitude key times ``width`` plus
    ``width - 1 - column``, so a larger key is a larger magnitude or, at equal magnitudes, a lower
    column (``TensorOps.topk_abs_rows``)."""
    return _magnitude_keys(np.ascontiguousarray(rows)) * width + np.arange(width - 1, -1, -1, dtype=np.int64)


def topk_index_np(a: np.ndarray, k: int) -> np.ndarray:
    """``TensorOps.topk_abs_index`` of a host array (see :func:`topk_ranked_np`)."""
    if int(k) >= a.shape[0]:
        return np.arange(a.shape[0], dtype=np.int64)
    return np.sort(topk_ranked_np(a, k)[0])
