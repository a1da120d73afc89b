"""The host selection kernels: NumPy and the C extension on the memory of host tensors.

:class:`HostKernels` implements :class:`~.kernels.SelectionKernels` for any adapter through one
primitive, ``TensorOps.host_view(t)``: a NumPy array over a contiguous CPU tensor's memory, or
None (docs/selection.md#primitives). The adapter's view encodes when its memory may be read here
(device, layout, dtype, autograd); where a tensor has no view, the call goes to the portable
kernels, whose bits these are. Results go back as the adapter's tensors (``ops.from_numpy``,
zero-copy where the framework allows).

Adapters whose tensors are immutable (``ops.slices_are_views`` false: TensorFlow) have read-only
views: the reads (``abs_where``, ``kth_largest_abs``) run here, the sums are the framework's own
``add``, and the in-place passes (the fused momentum sweep, the native top-k, the sparse result's
build) say "no such pass".
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import host_native
from .grad_parts import GradParts
from .host_numpy import (ALL, NONE, NP_KEYS, np_add_momentum_abs_where, np_all_none, np_fused_topk, np_kth_largest_abs,
                         np_sweep, threshold_plan)

__all__ = ["HostKernels"]

_F16 = np.dtype(np.float16)


class HostKernels:
    """:class:`~.kernels.SelectionKernels` on ``ops.host_view`` arrays (the module docstring)."""

    sync_free = False  # host memory: nothing to synchronise with

    def __init__(self, ops: Any, portable: Any):
        """``portable``: the kernels that take a call whose tensors have no host view."""
        self.ops, self._portable = ops, portable
        self._writes = bool(ops.slices_are_views)  # mutable tensors: views written in place

    @property
    def reads_grad_parts(self) -> bool:
        return self._writes and host_native.native_sweep()

    def _parts(self, parts: GradParts, dtype) -> tuple | None:
        """Unpacked gradients as ``(start, array)`` of ``dtype``, or None (docs/selection.md#grad-parts)."""
        if parts.is_packed:
            return None
        out = []
        for off, p in parts.parts:  # a loop, not two generators: once per bucket and step
            a = self.ops.host_view(p)
            if a is None or a.dtype != dtype:
                return None
            out.append((off, a))
        return tuple(out)

    def _views(self, first: Any, *others: Any) -> list | None:
        """Host views of ``first`` and of every one of ``others`` (None stays None), all of one
        dtype; None where one has no view."""
        view = self.ops.host_view
        x = view(first)
        if x is None:
            return None
        out = [x]
        for t in others:
            if t is None:
                out.append(None)
                continue
            a = view(t)
            if a is None or a.dtype != x.dtype:
                return None
            out.append(a)
        return out

    def _plan(self, x: np.ndarray, t: Any, op: str, thr: float):
        """The comparison in the key domain, the threshold rounded by the adapter (as its tensors are)."""
        if x.dtype not in NP_KEYS:
            raise TypeError(f"abs_where: a floating tensor is needed, got {x.dtype}")
        return threshold_plan(op, thr, lambda v: self.ops.abs_key(v, t), NP_KEYS[x.dtype][2])

    def abs_where(self, t, op, thr):
        x = self.ops.host_view(t)
        if x is None:
            return self._portable.abs_where(t, op, thr)
        plan = self._plan(x, t, op, thr)
        idx, vals = np_all_none(x, plan) if plan in (ALL, NONE) else np_sweep(x, plan)
        return self.ops.from_numpy(idx, like=t), self.ops.from_numpy(vals, like=t)

    def add_abs_where(self, acc, g, op, thr, out=None):
        if not self._writes:  # immutable tensors: the framework's sum, then the host sweep
            acc = self.ops.add(self.ops.flatten(acc), self.ops.flatten(g))
            return (acc, *self.abs_where(acc, op, thr))
        v = self._views(acc, g, out)
        if v is None:
            return self._portable.add_abs_where(acc, g, op, thr, out)
        x, y = v[0], (v[0] if out is None else v[2])
        plan = self._plan(x, acc, op, thr)
        if plan in (ALL, NONE):
            np.add(x, v[1], out=y)
            idx, vals = np_all_none(y, plan)
        else:
            idx, vals = np_sweep(x, plan, v[1], y)
        return acc if out is None else out, self.ops.from_numpy(idx, like=acc), self.ops.from_numpy(vals, like=acc)

    def add_momentum_abs_where(self, acc, u, mu, g, u_out, op, thr, out=None):
        if not self._writes:
            return None  # no fused pass: the core makes u' and calls add_abs_where (select/addend.py)
        parts = g if isinstance(g, GradParts) else None  # unpacked: read where they are, or packed here
        host = None
        if parts is not None:
            a = self.ops.host_view(acc) if self.reads_grad_parts else None
            host = None if a is None else self._parts(parts, a.dtype)
            g = parts.buf if host is not None else parts.pack()
        v = self._views(acc, u, g, u_out, out)
        if v is None or v[0].dtype == _F16:
            return None  # the core makes u' and calls add_abs_where (select/addend.py)
        _, _, idx, vals = np_add_momentum_abs_where(v[0], v[1], mu, v[2] if host is None else host, v[3], op, thr,
                                                    v[4])
        return (acc if out is None else out), u_out, self.ops.from_numpy(idx, like=acc), \
            self.ops.from_numpy(vals, like=acc)

    def scatter_sum(self, buf, idx, vals, scale):
        if not (self._writes and host_native.native_sweep()):
            return None  # no native pass: the caller's plain path, nothing allocated here
        view = self.ops.host_view
        b, i, v = view(buf), view(idx), view(vals)
        if (b is None or i is None or v is None or b.dtype not in host_native.NATIVE_DTYPES or v.dtype != b.dtype
                or i.dtype != np.int64):
            return None
        sums = self.ops.empty(i.size, self.ops.dtype_name(vals), like=vals)
        finite = host_native.np_scatter_sum(b, i, v, scale, view(sums))
        return None if finite is None else (buf, sums, finite)

    def fused_topk(self, t, k, sidx, j_lo, j_hi, max_retries, g, u, mu, u_out, out):
        if not (self._writes and host_native.native_sweep()):
            return None  # ExactTopK's own steps (select/exact_topk.py)
        out = out if g is not None else None  # no addend: the sum is t itself, out is not written
        parts = g if isinstance(g, GradParts) else None
        v = self._views(t, g if parts is None else parts.buf, u, u_out, out)
        if v is None or v[0].dtype == _F16:
            return None
        s = None
        if sidx is not None:
            s = self.ops.host_view(sidx)
            if s is None or s.dtype != np.int64:
                return None
        gh = v[1]
        if parts is not None and not parts.is_packed:  # read where they are (docs/selection.md#grad-parts)
            gh = self._parts(parts, v[0].dtype)
            if gh is None:
                return None
        r = np_fused_topk(v[0], k, s, j_lo, j_hi, max_retries, gh, v[2], mu, v[3], v[4])
        if r is None:
            return None
        return (t if out is None else out, self.ops.from_numpy(r[1], like=t), self.ops.from_numpy(r[2], like=t),
                *r[3:])

    def kth_largest_abs(self, t, k):
        x = self.ops.host_view(t)
        if x is None:
            return self._portable.kth_largest_abs(t, k)
        return np_kth_largest_abs(x, k)

