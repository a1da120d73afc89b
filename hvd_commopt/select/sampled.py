"""DGC's sampled-threshold selection, with the sample read off the sums (docs/dgc.md#sample-from-sums).

The selection (docs/dgc.md#update-rule): a strided sample of ``acc + addend`` gives the threshold
``thr`` (the smallest of the samples' top ``ceil(num_samples·ratio)``), a sweep selects
``|acc + addend| >= thr``, the adaptation loop lowers ``thr`` (a new sweep) or takes the exact top-k
among too many, and the result is truncated to k.

Made in that order, the sample gathers ``acc``, ``u`` and ``g`` (momentum correction's addend
``u*mu + g``) at every sampled position: three scattered reads of the bucket before the sweep.
When the bucket's threshold of the last step is known, the sweep runs first instead, at a lower
bound ``lo`` (``GUESS`` times that threshold): it makes the sums and keeps every ``|sum| >= lo``.
The sample is then gathered from the sums (one scattered read; the same values, since the sweep
makes the sums with the sample's roundings), and every sweep at a threshold ``>= lo`` (the first,
and the adaptation's) is a filter of those candidates, ascending as the sweep's, with their values.
A threshold below ``lo`` (the bucket changed a lot, or a NaN) sweeps the sums again, as before. So
the indices, values, sums and finiteness verdict are the ones of the order above, bit for bit; only
the work differs. The bound is per bucket and per rank, and affects nothing but the speed.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import addend as addend_ops
from . import device
from .exact_topk import sum_into
from .kernels import kernels_for

__all__ = ["sampled_select", "GUESS"]

GUESS = 0.9  # the next sweep's lower bound, as a fraction of the bucket's last threshold
_EXACT = {"float32": np.float32, "float64": np.float64}  # dtypes whose bound is kept exactly


def sampled_select(c: Any, ops: Any, acc: Any, bucket: Any, step: int, addend: Any = None, out: Any = None,
                   finite: list | None = None) -> tuple[Any, Any, Any]:
    """``DGCSelector`` (and Top-k's "sampled" mode) (``c`` the compressor; the module docstring)."""
    n = ops.numel(acc)
    ratio = c.ratio(bucket, n, step)
    k = c.k_for(n, bucket, step)
    name = bucket.name if bucket is not None else ""
    if k >= n:
        if addend is not None:
            acc = sum_into(ops, acc, addend, out)
        idx = ops.arange(n, like=acc)
        if finite is not None:
            finite.append(None)
        return ops.gather(acc, idx), idx, acc
    stride, num_samples, top_k_samples = c.sampling(n, ratio)
    kern = kernels_for(ops, acc)
    if kern.sync_free:  # docs/selection.md#device-route
        return _on_device(c, ops, acc, name, step, k, stride, num_samples, top_k_samples, addend, out, finite)
    fused = addend is not None and num_samples < n  # the sums are made in a sweep: it may run first
    lo = c.guesses.get(name) if fused else None
    cand = None  # (positions, values) of |sum| >= lo, when the sweep ran first
    if num_samples >= n:
        if addend is not None:
            acc, addend = sum_into(ops, acc, addend, out), None
        samples = acc
    else:
        sidx = c.sample_positions(ops, n, stride, num_samples, name, step, acc)
        if lo is not None:  # the sweep first, at the bound; the sample from its sums
            acc, cidx, cvals = addend_ops.add_abs_where(kern, acc, addend, "ge", lo, out)
            addend, cand = None, (cidx, cvals)
            samples = ops.gather(acc, sidx)
        else:
            samples = ops.gather(acc, sidx)
            if addend is not None:  # the same sums as the sweep will make
                samples = ops.add(samples, addend_ops.gather(ops, addend, sidx))
    thr = kern.kth_largest_abs(samples, top_k_samples)  # the smallest |x| of the samples' top-k

    def sweep(t: float) -> tuple[Any, Any]:
        """(positions, values) of ``|acc| >= t``: a filter of the candidates where they hold them."""
        if cand is not None and t >= lo:
            pos, vals = kern.abs_where(cand[1], "ge", t)
            return ops.gather(cand[0], pos), vals
        return kern.abs_where(acc, "ge", t)

    if addend is not None:
        acc, idx, swept = addend_ops.add_abs_where(kern, acc, addend, "ge", thr, out)
    else:
        idx, swept = sweep(thr)
    exact = _EXACT.get(ops.dtype_name(acc))
    if fused and exact is not None and math.isfinite(thr) and thr > 0:
        c.guesses[name] = float(exact(thr * GUESS))  # a value of the dtype: compared exactly above
    if finite is not None:  # every NaN/Inf is in the sweep unless thr is NaN (then acc has one)
        finite.append(False if math.isnan(thr) else ops.all_finite(swept))
    count = ops.numel(idx)
    if n > num_samples:  # adaptation (the reference's loop, from GRACE's DGC)
        for _ in range(c.max_adaptation_iters):
            if count > k:
                if count > k * c.upper:
                    if c.resample:  # exact top-k among the selected
                        _, pos = ops.topk_abs(ops.gather(acc, idx), k)
                        idx = ops.gather(idx, pos)
                        count = k
                        break
                    thr *= c.upper
                else:
                    break
            elif count < c.lower * k:
                thr *= c.lower
            else:
                break
            idx, _ = sweep(thr)
            count = ops.numel(idx)
    if count > k:
        idx = ops.slice(idx, 0, k)
    return ops.gather(acc, idx), idx, acc


def _on_device(c: Any, ops: Any, acc: Any, name: str, step: int, k: int, stride: int, num_samples: int,
               top_k_samples: int, addend: Any, out: Any, finite: list | None) -> tuple[Any, Any, Any]:
    """:func:`sampled_select` with no host decision (:func:`~.device.sampled_topk`): the sum made
    first, the sample's positions made on the device as the host route makes them (strided from the
    host's offset, or uniform by a counter-based hash); no finiteness verdict (the reducer keeps a device flag) and no next-sweep guess (speed only)."""
    n = ops.numel(acc)
    if addend is not None:
        acc = sum_into(ops, acc, addend, out)
    sidx = None
    if num_samples < n:  # the host route's positions, made on the device (docs/dgc.md#uniform-samples)
        sidx = c.sample_positions(ops, n, stride, num_samples, name, step, acc)
    vals, idx = device.sampled_topk(c, ops, acc, k, sidx, top_k_samples)
    if finite is not None:
        finite.append(None)
    return vals, idx, acc
