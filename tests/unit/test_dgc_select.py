"""DGC's sampled selection with the sweep first and the sample read off its sums
(docs/dgc.md#sample-from-sums) equals the sample-first order bit for bit: values, indices, sums,
``u'`` and the finiteness verdict, over steps where the bound holds, where the threshold falls
below it (the sums swept again), NaNs, ties (resample), a lowered threshold, float32 and float64.
"""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from hvd_commopt import NumpyOps
from hvd_commopt.buckets import Bucket
from hvd_commopt.compress import DGCSelector
from hvd_commopt.select import addend as addend_ops
from hvd_commopt.select.addend import MomentumAddend
from hvd_commopt.select.host import HostKernels
from hvd_commopt.select.kernels import kernels_for
from hvd_commopt.select.strategies import sum_into
from hvd_commopt.engine import TensorSpec

N = 150_000


def _sample_first(c, ops, acc, bucket, step, addend=None, out=None, finite=None):
    """``sampled_select`` as it was: the sample from ``acc`` and the addend, then the sweeps."""
    n = ops.numel(acc)
    ratio, k, name = c.ratio(bucket, n, step), c.k_for(n, bucket, step), bucket.name
    stride, num_samples, top_k_samples = c.sampling(n, ratio)
    kern = kernels_for(ops, acc)
    if num_samples >= n:
        if addend is not None:
            acc, addend = sum_into(ops, acc, addend, out), None
        samples = acc
    else:
        rng = np.random.Generator(np.random.PCG64([c.seed & 0xFFFFFFFF, zlib.crc32(name.encode()), int(step)]))
        sidx = np.arange(int(rng.integers(0, stride)), n, stride, dtype=np.int64)
        samples = ops.gather(acc, sidx)
        if addend is not None:
            samples = ops.add(samples, addend_ops.gather(ops, addend, sidx))
    thr = kern.kth_largest_abs(samples, top_k_samples)
    if addend is not None:
        acc, idx, swept = addend_ops.add_abs_where(kern, acc, addend, "ge", thr, out)
    else:
        idx, swept = kern.abs_where(acc, "ge", thr)
    if finite is not None:
        finite.append(False if math.isnan(thr) else ops.all_finite(swept))
    count = ops.numel(idx)
    if n > num_samples:
        for _ in range(c.max_adaptation_iters):
            if count > k:
                if count > k * c.upper:  # resample (on by default): the exact top-k among them
                    _, pos = ops.topk_abs(ops.gather(acc, idx), k)
                    idx, count = ops.gather(idx, pos), k
                break
            elif count < c.lower * k:
                thr *= c.lower
            else:
                break
            idx, _ = kern.abs_where(acc, "ge", thr)
            count = ops.numel(idx)
    if count > k:
        idx = ops.slice(idx, 0, k)
    return ops.gather(acc, idx), idx, acc


class _Counting(NumpyOps):
    """Counts sweeps of the whole bucket (``abs_where`` of n elements, by its kernels: see
    :func:`_count_sweeps`), filters of candidates and resamples."""

    def __init__(self, hits):
        self.hits = hits

    def topk_abs(self, t, k):
        self.hits["resample"] += 1
        return super().topk_abs(t, k)


def _step_data(case, step, dtype):
    rng = np.random.default_rng(step)
    x = rng.standard_normal(N).astype(dtype)
    g = (rng.standard_normal(N) * 0.3).astype(dtype)
    u = rng.standard_normal(N).astype(dtype)
    if case == "jump" and step % 2:  # the bucket shrinks 10x: the threshold falls below the bound
        x, g, u = x * 0.1, g * 0.1, u * 0.1
    elif case == "cauchy":
        x = rng.standard_cauchy(N).astype(dtype)
    elif case == "ties":
        x = np.where(rng.random(N) < 0.05, 3.0, rng.random(N)).astype(dtype)
    elif case == "nan" and step == 2:
        x[rng.integers(0, N, 3)] = np.nan
    return x, g, u


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["steady", "jump", "cauchy", "ties", "nan"])
@pytest.mark.parametrize("addend", ["momentum", "plain", "none"])
def test_sweep_first_equals_sample_first(dtype, case, addend, monkeypatch):
    where = HostKernels.abs_where

    def counted(self, t, op, thr):
        if isinstance(self.ops, _Counting):
            self.ops.hits["sweeps" if t.size == N else "filters"] += 1
        return where(self, t, op, thr)

    monkeypatch.setattr(HostKernels, "abs_where", counted)
    bucket = Bucket.of(0, [TensorSpec("w", (N,), np.dtype(dtype).name)])
    hits = {"sweeps": 0, "filters": 0, "resample": 0}
    new, ref = DGCSelector(0.01), DGCSelector(0.01)
    for step in range(6):
        x, g, u = _step_data(case, step, dtype)
        got = []
        for ops, route in ((_Counting(hits), new.sampled_select), (NumpyOps(), lambda *a: _sample_first(ref, *a))):
            xx, uu, out = x.copy(), u.copy(), np.full_like(x, 7.0)
            add = {"momentum": MomentumAddend(uu, 0.9, g, np.full_like(u, 5.0)), "plain": g.copy(),
                   "none": None}[addend]
            verdict: list = []
            with np.errstate(invalid="ignore", over="ignore"):
                vals, idx, acc = route(ops, xx, bucket, step, add, out if add is not None else None, verdict)
            made = add.made if addend == "momentum" else None
            got.append([vals.tobytes(), idx.tobytes(), np.asarray(acc).tobytes(), xx.tobytes(),
                        None if made is None else made.tobytes(), verdict])
        assert got[0] == got[1], (case, step)
    if addend != "none":  # the bound was set, and the sweeps at thresholds above it were filters
        assert new.guesses and hits["filters"] >= 2
        if case == "jump":  # a threshold below the bound: the sums swept again
            assert hits["sweeps"] >= 3
    else:
        assert not new.guesses and hits["filters"] == 0
    if case == "ties" and addend != "plain":
        assert hits["resample"] >= 1
