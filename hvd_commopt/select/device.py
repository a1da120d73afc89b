"""The device route: selection with no host synchronisation (docs/selection.md#device-route).

On device memory (CUDA) every ``nonzero``, ``.item()`` or boolean index stalls the stream until the
host has read the data. :class:`DeviceKernels` marks the route (``sync_free``); on it the selection
algorithms run the functions below instead of their data-dependent steps:

* ``ExactTopK``'s device step (select/exact_topk.py): the exact top-k (ties to the lower index, ascending, the host route's set and
  bits) as one fixed-size ``TensorOps.topk_abs_index`` of the accumulated buffer: k is known
  before the step, so no count, no candidate pass and no threshold ever reaches the host;
* :func:`reuse_topk`: threshold reuse with a capacity fixed per bucket (``floor(k(1+band))``),
  the threshold and its age kept as device tensors, the unused slots padded (:func:`padded`);
* :func:`sampled_topk`: DGC's sampled threshold and its adaptation loop as device arithmetic, in a
  capacity of k;
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

from .portable import INF_KEYS, PortableKernels

__all__ = ["DeviceKernels", "is_empty", "local_verdict", "marked", "padded", "reuse_candidates", "reuse_topk",
           "sampled_topk",
           "zero_sent"]


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
    memory's zeroing zeroes nothing more and the result's scatter-add into zeros adds +0 (bit for
    bit a no-op). With no entry at all (DGC's adaptation can push its threshold above every value;
    the host route then sends nothing) the slots are the empty marker (:func:`is_empty`): indices
    ``1, 0, 0, ...`` with the value -0.0 (adding it changes no bit of anything), which the
    memories' zeroing (:func:`zero_sent`) skips (docs/selection.md#empty-selection). Needs a
    capacity of at least 2 (and 2 elements)."""
    n, cap = ops.numel(t), ops.numel(top)
    idx = ops.sort(ops.where(valid, top, n))
    used = ops.compare(idx, "lt", n)
    first = ops.slice(idx, 0, 1)
    some = ops.compare(first, "lt", n)
    marker = ops.where(ops.compare(ops.arange(cap, like=idx), "lt", 1), ops.shift(ops.zeros(cap, "int64", like=idx), 1), 0)
    idx = ops.where(used, idx, ops.where(some, first, marker))
    return ops.where(some, ops.where(used, ops.gather(t, idx), 0.0), -0.0), idx


def is_empty(ops: Any, idx: Any) -> Any:
    """A device flag: ``idx`` is :func:`padded`'s empty marker (``idx[0] > idx[-1]``, which no
    selection has: its indices ascend and its unused slots repeat the first)."""
    cap = ops.numel(idx)
    return ops.compare(ops.slice(idx, 0, 1), "gt", ops.slice(idx, cap - 1, cap))


def zero_sent(ops: Any, acc: Any, idx: Any) -> Any:
    """``acc`` zeroed at the sent indices ``idx`` (the memories' ``index_fill(acc, idx, 0.0)``),
    where a device-route selection may be :func:`padded`'s empty marker: then nothing is zeroed,
    as the host route sends nothing (docs/selection.md#empty-selection). O(k): a gather and an
    ``index_copy`` of the values the positions keep (+0.0 where sent, as ``index_fill`` writes)."""
    if ops.numel(idx) < 2:
        return ops.index_fill(acc, idx, 0.0)
    return ops.index_copy(acc, idx, ops.where(is_empty(ops, idx), ops.gather(acc, idx), 0.0))


def reuse_topk(ops: Any, t: Any, k: int, lo_c: int, hi_c: int, tau: int, prev: Any, addend: Any = None,
               out: Any = None) -> tuple[Any, Any, Any, Any]:
    """Ok-Topk's threshold reuse (select/strategies.py ReuseTopK) on the device: ``(values,
    indices, (threshold key, age), acc)`` with a capacity of ``hi_c = floor(k(1+band))`` entries
    (at least 2, at most n): the candidates of ``TensorOps.threshold_reuse`` (the torch adapter's
    one-read Triton kernel on CUDA, docs/selection.md#triton-reuse), or where it has none
    (None) :func:`reuse_candidates` on the primitives, padded (:func:`padded`). ``addend``: of
    ``acc = t + addend`` (into ``out``, or t when None), made in that one read where the adapter
    can (``TensorOps.add_threshold_reuse``, docs/selection.md#triton-fused-ef), else first."""
    native = None
    if addend is not None:
        fused = ops.add_threshold_reuse(t, addend, out, k, lo_c, hi_c, tau, prev) if prev is not None else None
        if fused is None:
            t = ops.add(t if out is None else ops.copy_into(out, 0, t), addend)  # exact_topk.sum_into's add
        else:
            t, native = fused
    if native is None:
        native = ops.threshold_reuse(t, k, lo_c, hi_c, tau, prev)
    top, valid, state = native if native is not None else reuse_candidates(ops, t, k, lo_c, hi_c, tau, prev)
    vals, idx = padded(ops, t, top, valid)
    return vals, idx, state, t


def reuse_candidates(ops: Any, t: Any, k: int, lo_c: int, hi_c: int, tau: int, prev: Any) -> tuple[Any, Any, Any]:
    """``TensorOps.threshold_reuse`` on TensorOps primitives: ``(positions, valid, (threshold
    key, age))``, ``cap = min(max(hi_c, 2), n)`` positions (any order) of which the ``valid`` ones
    are the selected set.

    The ``hi_c + 1`` largest (ranked, ``topk_abs_ranked``) decide it all: the count of ``|x| >=
    thr`` among them is the true count up to hi_c, and one more tells "above the band". Accepted
    (a previous threshold, age < tau, ``lo_c <= count <= hi_c``): the entries >= thr; else the
    first k, the exact top-k, which is also the host route's top-k inside the superset ("high")
    and its exact selection ("low"). The new threshold (the k-th key, or the kept one) and age are
    device tensors; ``prev`` is the last ones, or None (the first step: exact)."""
    n = ops.numel(t)
    cap = min(max(hi_c, 2), n)  # padded's empty marker needs two slots
    top, keys = ops.topk_abs_ranked(t, min(hi_c + 1, n))
    first_k = ops.compare(ops.arange(cap, like=top), "lt", k)
    kth = ops.slice(keys, k - 1, k)
    if prev is None:
        return ops.slice(top, 0, cap), first_k, (kth, ops.zeros(1, "int64", like=top))
    thr, age = prev
    above = ops.compare(keys, "ge", thr)
    cnt = ops.count_true(above)
    accept = ops.where(ops.compare(age, "lt", tau),
                       ops.where(ops.compare(cnt, "ge", lo_c), ops.compare(cnt, "le", hi_c), False), False)
    valid = ops.where(accept, ops.slice(above, 0, cap), first_k)
    return ops.slice(top, 0, cap), valid, (ops.where(accept, thr, kth), ops.where(accept, ops.shift(age, 1), 0))


def _key_value64(ops: Any, key: Any, dtype: str) -> Any:
    """The magnitudes of int64 keys of ``dtype`` as float64 (a bit reinterpretation, exact)."""
    width = {"float16": "int16", "bfloat16": "int16", "float32": "int32", "float64": "int64"}[dtype]
    return ops.cast(ops.from_bytes(ops.as_bytes(ops.cast(key, width)), dtype), "float64")


def _key_of(ops: Any, thr64: Any, dtype: str) -> Any:
    """The int64 key of the float64 threshold rounded to ``dtype``, as ``TensorOps.abs_key`` rounds;
    a NaN threshold is the NaN class (one key above +Inf: every NaN passes ``>=``)."""
    key = ops.cast(ops.abs_keys(ops.cast(thr64, dtype)), "int64")
    return ops.where(ops.compare(key, "le", INF_KEYS[dtype] + 1), key, INF_KEYS[dtype] + 1)


def sampled_topk(c: Any, ops: Any, acc: Any, k: int, sidx: Any, top_k_samples: int) -> tuple[Any, Any]:
    """DGC's sampled threshold (select/sampled.py) on the device: ``(values, ascending indices)``
    in a capacity of ``max(k, 2)``. ``sidx``: the sample positions (None: every element). The adaptation loop
    runs its ``max_adaptation_iters`` rounds as device arithmetic: the threshold a float64 tensor
    multiplied as the host's Python float is (by 1.0 once settled: exact), each count a pass, the
    branch taken a flag; then the exact top-k (``resample``) or the first k of ``|x| >= thr`` in
    index order, padded (:func:`padded`)."""
    n, dt = ops.numel(acc), ops.dtype_name(acc)
    samples = acc if sidx is None else ops.gather(acc, sidx)
    _, skeys = ops.topk_abs_ranked(samples, top_k_samples)
    thr = _key_value64(ops, ops.slice(skeys, top_k_samples - 1, top_k_samples), dt)
    keys = ops.abs_keys(acc)

    def count(t64: Any) -> tuple[Any, Any]:
        mask = ops.compare(keys, "ge", ops.cast(_key_of(ops, t64, dt), ops.dtype_name(keys)))
        return mask, ops.count_true(mask)

    mask, cnt = count(thr)
    resampled = ops.compare(cnt, "lt", 0)  # False
    if sidx is not None:  # adaptation (the reference's loop, from GRACE's DGC)
        active = ops.compare(cnt, "ge", 0)  # True
        over_at, under_at = math.floor(k * c.upper), math.ceil(c.lower * k)
        for _ in range(c.max_adaptation_iters):
            gt_k, over, under = ops.compare(cnt, "gt", k), ops.compare(cnt, "gt", over_at), ops.compare(cnt, "lt", under_at)
            up = ops.where(active, ops.where(gt_k, over, False), False)
            down = ops.where(active, ops.where(gt_k, False, under), False)
            if c.resample:
                resampled = ops.where(up, up, resampled)
                active = down
            else:
                active = ops.where(up, up, down)
            # thr *= upper / lower as the host's Python float (float64), unchanged where settled
            lowered = ops.where(down, ops.scale(ops.clone(thr), c.lower), thr)
            thr = lowered if c.resample else ops.where(up, ops.scale(ops.clone(thr), c.upper), lowered)
            mask2, cnt2 = count(thr)
            mask, cnt = ops.where(active, mask2, mask), ops.where(active, cnt2, cnt)
    pos = ops.arange(n, like=keys)
    cap = max(k, 2)  # padded's empty marker needs two slots (n > k >= 1 here)
    first = ops.slice(ops.sort(ops.where(mask, pos, n)), 0, cap)  # the first k of |x| >= thr, padded with n
    if c.resample:
        top = ops.topk_abs_index(acc, k)
        if cap > k:
            top = ops.cat([top, ops.shift(ops.zeros(cap - k, "int64", like=top), n)])
        first = ops.where(resampled, top, first)
    valid = ops.compare(first, "lt", n)
    if cap > k:
        valid = ops.where(ops.compare(ops.arange(cap, like=first), "lt", k), valid, False)
    return padded(ops, acc, first, valid)
