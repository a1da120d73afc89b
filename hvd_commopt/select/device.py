"""The device route: selection with no host synchronisation (docs/selection.md#device-route).

On device memory (CUDA) every ``nonzero``, ``.item()`` or boolean index stalls the stream until the
host has read the data. :class:`DeviceKernels` marks the route (``sync_free``); on it the selection
algorithms run the functions below instead of their data-dependent steps:

* ``ExactTopK``'s device step (select/exact_topk.py): the exact top-k (ties to the lower index, ascending, the host route's set and
  bits) as one fixed-size ``TensorOps.topk_abs_index`` of the accumulated buffer: k is known
  before the step, so no count, no candidate pass and no threshold ever reaches the host;
* :func:`reuse_topk`: threshold reuse with a capacity fixed per bucket (``floor(k(1+band))``),
  the threshold and its age kept as device tensors, the unused slots padded (:func:`padded`);
* :func:`local_verdict` and :func:`marked`: the NaN/Inf rule of docs/wrapper.md#nonfinite without
  a host decision: the flag stays a device tensor and the marker replaces the selection by a
  ``where``, so the reduced bucket is non-finite on every rank exactly where the host route's is;
  the one host read is the reducer's ``settle`` (``TensorOps.read_flags``).

The route is taken for tensors on a device, and for every tensor when the host kernels are off
(:data:`~.kernels.HOST_KERNELS`; tests force it on CPU tensors that way). Everything else of
:class:`~.portable.PortableKernels` is inherited for the paths that keep their host steps.
"""
from __future__ import annotations

import math
from typing import Any

from .portable import PortableKernels

__all__ = ["DeviceKernels", "local_verdict", "marked", "padded", "reuse_topk"]


class DeviceKernels(PortableKernels):
    """:class:`~.portable.PortableKernels` that declare the device route (``sync_free``)."""

    sync_free = True


def local_verdict(ops: Any, flat: Any, vals: Any, idx: Any, flat_is_acc: bool) -> Any:
    """A device flag: this rank's contribution ``flat`` is finite (docs/selection.md#device-route).

    ``flat_is_acc`` (an unfused memory added into flat): one ``finite_flag`` pass of it. Else
    ``vals`` are the selected entries of ``acc = flat + memory`` and flat is intact: a NaN/Inf of
    flat is one of acc (the memory is finite), and NaN/Inf rank above every finite value, so
    while some selected value is finite every NaN/Inf of acc was selected and flat is finite
    exactly where ``flat[idx]`` is; with all k selected values non-finite the contribution counts
    as non-finite (the marker is sent; the reduced bucket is non-finite either way)."""
    if flat_is_acc:
        return ops.finite_flag(flat)
    sel_ok = ops.finite_flag(ops.gather(flat, idx))
    return ops.where(ops.finite_flag(vals, "any"), sel_ok, False)


def marked(ops: Any, ok: Any, vals: Any, idx: Any, k: int) -> tuple[Any, Any]:
    """The selection where the device flag ``ok``, else the marker (+Inf at positions 0..k-1,
    compress/nonfinite.py), chosen on the device: the same sizes either way. A selection of a
    fixed capacity above k fills the marker's rest with +0 at position 0 (a no-op in the
    result's scatter-add into zeros)."""
    cap = ops.numel(idx)
    pos = ops.arange(cap, like=idx)
    if cap == k:
        return ops.where(ok, vals, math.inf), ops.where(ok, idx, pos)
    in_k = ops.compare(pos, "lt", k)
    keep = ops.where(ok, ops.compare(pos, "ge", 0), in_k)  # ok, or a marker entry
    return ops.where(keep, ops.where(ok, vals, math.inf), 0.0), ops.where(ok, idx, ops.where(in_k, pos, 0))


def padded(ops: Any, t: Any, top: Any, valid: Any) -> tuple[Any, Any]:
    """(values, ascending indices) of a fixed-capacity selection: the positions ``top`` where the
    bool ``valid``; the unused slots repeat the first selected index with the value +0, so the
    memory's ``index_fill`` zeroes nothing more and the result's scatter-add into zeros adds +0
    (bit for bit a no-op). Needs one valid entry (every capacity selection has k >= 1)."""
    n = ops.numel(t)
    idx = ops.sort(ops.where(valid, top, n))
    used = ops.compare(idx, "lt", n)
    idx = ops.where(used, idx, ops.slice(idx, 0, 1))
    return ops.where(used, ops.gather(t, idx), 0.0), idx


def reuse_topk(ops: Any, t: Any, k: int, lo_c: int, hi_c: int, tau: int, prev: Any) -> tuple[Any, Any, Any]:
    """Ok-Topk's threshold reuse (select/strategies.py ReuseTopK) on the device: ``(values,
    indices, (threshold key, age))`` with a capacity of ``hi_c = floor(k(1+band))`` entries.

    The ``hi_c + 1`` largest (ranked, ``topk_abs_ranked``) decide it all: the count of ``|x| >=
    thr`` among them is the true count up to hi_c, and one more tells "above the band". Accepted
    (a previous threshold, age < tau, ``lo_c <= count <= hi_c``): the entries >= thr; else the
    first k, the exact top-k, which is also the host route's top-k inside the superset ("high")
    and its exact selection ("low"). The new threshold (the k-th key, or the kept one) and age are
    device tensors; ``prev`` is the last ones, or None (the first step: exact)."""
    n = ops.numel(t)
    cap = min(hi_c, n)
    top, keys = ops.topk_abs_ranked(t, min(hi_c + 1, n))
    first_k = ops.compare(ops.arange(cap, like=top), "lt", k)
    kth = ops.slice(keys, k - 1, k)
    if prev is None:
        vals, idx = padded(ops, t, ops.slice(top, 0, cap), first_k)
        return vals, idx, (kth, ops.zeros(1, "int64", like=top))
    thr, age = prev
    above = ops.compare(keys, "ge", thr)
    cnt = ops.count_true(above)
    accept = ops.where(ops.compare(age, "lt", tau),
                       ops.where(ops.compare(cnt, "ge", lo_c), ops.compare(cnt, "le", hi_c), False), False)
    vals, idx = padded(ops, t, ops.slice(top, 0, cap), ops.where(accept, ops.slice(above, 0, cap), first_k))
    return vals, idx, (ops.where(accept, thr, kth), ops.where(accept, ops.shift(age, 1), 0))
