"""The portable selection kernels: the :class:`~.kernels.SelectionKernels` contracts written on the
adapter's TensorOps primitives (docs/selection.md#primitives).

They run wherever the host kernels cannot (device tensors, bfloat16, an adapter without host
views, the host kernels switched off), with the framework's own ops: the magnitude order is the
integer order of ``|x|``'s bit pattern (``TensorOps.abs_keys``; docs/selection.md#order), a
comparison of the keys makes the selection's mask, ``TensorOps.nonzero`` its positions, and
``TensorOps.kth_smallest`` of the keys the exact k-th magnitude. No fused passes: the calls that
would fuse several steps say "no such pass" and the algorithms make the steps themselves, with the
same bits. A device implementation with fused kernels stands beside this one (:mod:`.kernels`).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .host_numpy import ALL, NONE, np_key_value, threshold_plan

__all__ = ["PortableKernels", "INF_KEYS", "key_value"]

# float dtype -> the key of +Inf (every NaN's key is above it)
INF_KEYS = {"float32": 0x7F800000, "float64": 0x7FF0000000000000, "float16": 0x7C00, "bfloat16": 0x7F80}


def key_value(key: int, dtype: str) -> float:
    """The magnitude a key of ``dtype`` stands for, as a Python float (nan for a NaN key)."""
    if dtype == "bfloat16":  # the upper half of a float32: exact, and NumPy has no bfloat16
        if key > INF_KEYS[dtype]:
            return math.nan
        return float(np.array([int(key) << 16], dtype=np.uint32).view(np.float32)[0])
    return np_key_value(key, np.dtype(dtype))


class PortableKernels:
    """:class:`~.kernels.SelectionKernels` on TensorOps primitives (the module docstring)."""

    reads_grad_parts = False
    sync_free = False  # counts and thresholds are read on the host (docs/selection.md#device-route)

    def __init__(self, ops: Any):
        self.ops = ops

    def _plan(self, t: Any, op: str, thr: float):
        dt = self.ops.dtype_name(t)
        if dt not in INF_KEYS:
            raise TypeError(f"abs_where: a floating tensor is needed, got {dt}")
        return threshold_plan(op, thr, lambda v: self.ops.abs_key(v, t), INF_KEYS[dt])

    def abs_where(self, t, op, thr):
        ops = self.ops
        t = ops.flatten(t)
        plan = self._plan(t, op, thr)
        n = ops.numel(t)
        if plan == ALL:
            idx = ops.arange(n, like=t)
        elif plan == NONE:
            idx = ops.arange(0, like=t)
        else:
            cmp, key = plan
            # the selections' candidates (ge/gt of a long tensor) are a sparse mask
            idx = ops.nonzero(ops.compare(ops.abs_keys(t), cmp, key), sparse=n >= 64 and cmp in ("ge", "gt"))
        return idx, ops.gather(t, idx)

    def add_abs_where(self, acc, g, op, thr, out=None):
        ops = self.ops
        flat, g = ops.flatten(acc), ops.flatten(g)
        dst = acc if out is None else out
        if out is None:
            s = ops.add(flat, g)
        else:  # y + 1*x: the add's bits, into out (acc intact)
            s = ops.axpy_into(ops.flatten(out), flat, 1.0, g)
        # a 1-D buffer of a framework with views was written in place (flatten is a view of it):
        # hand back the buffer itself, else the sum
        res = dst if ops.slices_are_views and len(ops.shape(dst)) == 1 else s
        return (res, *self.abs_where(s, op, thr))

    def add_momentum_abs_where(self, acc, u, mu, g, u_out, op, thr, out=None):
        return None  # no fused pass: the core makes u' and calls add_abs_where (select/addend.py)

    def scatter_sum(self, buf, idx, vals, scale):
        return None  # the core's zeros + scatter_add path (reduce/sparse.py)

    def fused_topk(self, t, k, sidx, j_lo, j_hi, max_retries, g, u, mu, u_out, out):
        return None  # ExactTopK's own steps (select/exact_topk.py)

    def kth_largest_abs(self, t, k):
        ops = self.ops
        t = ops.flatten(t)
        n, k = ops.numel(t), int(k)
        if not 1 <= k <= n:
            raise ValueError(f"kth_largest_abs: k={k} outside [1, {n}]")
        dt = ops.dtype_name(t)
        if dt not in INF_KEYS:
            raise TypeError(f"kth_largest_abs: a floating tensor is needed, got {dt}")
        return key_value(ops.kth_smallest(ops.abs_keys(t), n - k + 1), dt)
