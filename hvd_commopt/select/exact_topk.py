"""Exact, deterministic top-|x| selection (docs/selection.md#exact).

:class:`ExactTopK` gives ``TensorOps.topk_abs``'s result bit for bit (k largest |x|, ties to the
lower index, indices ascending; docs/wrapper.md#topk-ties) in about one pass plus work in k: a
strided-jittered sample brackets the k-th value between ``lo <= v* < hi`` (Floyd-Rivest), one pass
extracts the candidates ``|x| >= lo``, and the exact k-th value is found among the few candidates.
A wrong bracket is never a wrong answer, only a retry.

Two routes, one result:

* where the kernels offer ``SelectionKernels.fused_topk`` (host memory of float32/float64 with the
  native kernels built) the four steps run in one native call (docs/selection.md#native-topk):
  with one bucket per layer, the ten-odd framework calls of the other route, not the memory,
  set the cost of a 65k-element layer;
* elsewhere (a device, float16, bfloat16, TF, the native kernels off) the steps are
  calls of the selection kernels (:mod:`.kernels`) and ``TensorOps``, as written below.

The native call mirrors this file step for step (the same sample, bracket ranks, retries and
choice of threshold), so the values, the indices, the reported threshold and the counters agree
(tests/unit/test_native_topk.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import addend as addend_ops
from .kernels import SelectionKernels, kernels_for

__all__ = ["ExactTopK", "SelectResult", "sum_into"]

Tensor = Any


@dataclass
class SelectResult:
    values: Tensor        # acc[indices]
    indices: Tensor       # int64, ascending
    threshold: float      # every selected |x| >= threshold
    acc: Tensor = None    # the accumulated buffer (t, or t + addend)
    count: int = 0        # entries selected (k for the exact selector)
    finite: bool | None = None  # acc holds no NaN/Inf, when the candidate pass decided it (None: unknown)


class ExactTopK:
    """Exact, deterministic top-|x| (the algorithm is in the module docstring).

    Args:
        z: margin of the sampled bracket in binomial standard deviations.
        sample_scale / min_sample: sample size ``max(min_sample, sample_scale·(k·n)^(1/3))``,
            balancing the sample's cost against the exact step on the bracket.
        small_n: buffers up to this size skip the sample (exact k-th on the whole buffer).
        max_retries: candidate passes with a lowered threshold before taking every element.
        seed: seeds the sample offsets (speed only, never the result).
    """

    def __init__(self, z: float = 3.0, sample_scale: float = 2.0, min_sample: int = 2048,
                 small_n: int = 1 << 15, max_retries: int = 2, seed: int = 0x5EED):
        self.z, self.sample_scale = float(z), float(sample_scale)
        self.min_sample, self.small_n = int(min_sample), int(small_n)
        self.max_retries, self.seed = int(max_retries), int(seed)
        self.stats = {"calls": 0, "retries": 0, "full_fallbacks": 0, "above_fallbacks": 0, "ties": 0,
                      "candidates": 0}
        self._plans: dict[tuple, tuple[int, Tensor]] = {}

    def sample_size(self, n: int, k: int) -> int:
        return int(min(n, max(self.min_sample, round(self.sample_scale * (k * float(n)) ** (1.0 / 3.0)))))

    def _plan(self, ops, t, n: int, k: int) -> tuple[int, Tensor]:
        """One position per stride-s block at a pseudo-random offset (no alignment with periodic
        layouts such as conv kernels), ascending; cached per (device, n, m)."""
        m = self.sample_size(n, k)
        key = (ops.name, ops.device_name(t), n, m)
        plan = self._plans.get(key)
        if plan is None:
            s = n // m
            rng = np.random.Generator(np.random.PCG64([self.seed, n, m]))
            sidx = np.arange(m, dtype=np.int64) * s + rng.integers(0, s, size=m, dtype=np.int64)
            plan = (m, ops.from_numpy(sidx, like=t))
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _bracket_ranks(self, n: int, k: int, m: int) -> tuple[int, int]:
        ks = k * m / n
        sd = math.sqrt(ks)
        j_lo = max(int(math.ceil(ks + self.z * sd)) + 1, 1)   # sample rank <= v* w.h.p.
        j_hi = int(math.floor(ks - self.z * sd)) - 1           # sample rank >  v* w.h.p.
        return j_lo, min(j_hi, j_lo - 1)

    def select(self, ops, t: Tensor, k: int, addend: Tensor | None = None, out: Tensor | None = None) -> SelectResult:
        """Top-k of |t|, or of |t + addend| (t is then the accumulator, updated in place where the
        framework allows, or written into ``out`` with t left intact, and returned as
        ``result.acc``)."""
        st = self.stats
        st["calls"] += 1
        n = ops.numel(t)
        if int(k) < 0:
            raise ConfigError(f"k must be >= 0, got {k}")
        k = min(int(k), n)
        kern = kernels_for(ops, t)
        if kern.sync_free and k > 0:
            return self._device(ops, t, k, addend, out)
        if 0 < k < n:
            res = self._native(kern, t, n, k, addend, out)
            if res is not None:
                return res
        if k == 0 or n <= self.small_n or k == n:
            if addend is not None:
                t = sum_into(ops, t, addend, out)
            if k == 0:
                idx = ops.arange(0, like=t)
                return SelectResult(ops.gather(t, idx), idx, math.inf, t, 0)
            if k == n:
                idx = ops.arange(n, like=t)
                return SelectResult(ops.gather(t, idx), idx, kern.kth_largest_abs(t, n), t, n)
            v = kern.kth_largest_abs(t, k)
            vals, idx = self._finish(kern, t, None, k, v)
            return SelectResult(vals, idx, v, t, k)

        # 1. the sample brackets the k-th value: lo <= v* < hi (w.h.p.)
        m, sidx = self._plan(ops, t, n, k)
        s = ops.gather(t, sidx)
        if addend is not None:
            s = ops.add(s, addend_ops.gather(ops, addend, sidx))  # the same sums as the full pass will make
        j_lo, j_hi = self._bracket_ranks(n, k, m)
        lo = kern.kth_largest_abs(s, j_lo) if j_lo <= m else 0.0
        hi = kern.kth_largest_abs(s, j_hi) if j_hi >= 1 else None

        # 2. the pass: candidates |x| >= lo, ascending; lower lo and retry while fewer than k
        retries = 0
        while True:
            if lo <= 0.0 and not math.isnan(lo):  # every element qualifies: no extraction
                if addend is not None:
                    t, addend = sum_into(ops, t, addend, out), None
                cand, c = None, n
                break
            if addend is not None:
                t, cand, vc = addend_ops.add_abs_where(kern, t, addend, "ge", lo, out)
                addend = None
            else:
                cand, vc = kern.abs_where(t, "ge", lo)
            c = ops.numel(cand)
            if c >= k:
                break
            retries += 1
            st["retries"] += 1
            j_lo = 4 * j_lo + 16
            if retries > self.max_retries or j_lo > m:
                st["full_fallbacks"] += 1
                lo = 0.0
            else:
                lo = kern.kth_largest_abs(s, j_lo)
        # every NaN/Inf of acc is a candidate when lo is not NaN (NaN ranks above +Inf), so the
        # candidates tell whether acc is finite at no extra pass (docs/selection.md#finite-sweep)
        finite = None
        if cand is not None and c < n:
            finite = False if math.isnan(lo) else ops.all_finite(vc)
        if cand is None or c == n:
            cand, vc = None, t
        st["candidates"] += c

        # 3. the exact k-th value v* among the candidates
        if hi is None:
            v = kern.kth_largest_abs(vc, k)
        else:
            _, band = kern.abs_where(vc, "lt", hi)
            a = c - ops.numel(band)  # candidates >= hi
            if a < k:
                v = kern.kth_largest_abs(band, k - a)
            elif a == k:
                v = hi  # exactly k elements >= hi: they are the top-k
            else:
                _, above = kern.abs_where(vc, "gt", hi)
                if ops.numel(above) < k:
                    v = hi  # >= hi: more than k, > hi: fewer than k, so the k-th value is hi
                else:
                    st["above_fallbacks"] += 1
                    v = kern.kth_largest_abs(above, k)

        # 4. |x| >= v* with the tie rule
        vals, idx = self._finish(kern, vc, cand, k, v)
        return SelectResult(vals, idx, v, t, k, finite)

    @staticmethod
    def _device(ops: Any, t: Tensor, k: int, addend: Any, out: Tensor | None) -> SelectResult:
        """:meth:`select` on the device route (docs/selection.md#device-route): ``acc = t + addend``
        (a momentum addend made first: the same two roundings as the fused pass), then one
        fixed-size ``topk_abs_index``: the same set and bits, no count, threshold or verdict read
        on the host (threshold nan, finiteness None: the reducer keeps a device flag). Where the
        adapter has a kernel for it (``add_topk_abs_index``), the add is made in the selection's
        first read (docs/selection.md#triton-fused-ef)."""
        if addend is not None:
            fused = ops.add_topk_abs_index(t, addend_ops.made(ops, addend), out, k)
            if fused is not None:
                acc, idx = fused
                return SelectResult(ops.gather(acc, idx), idx, math.nan, acc, k, None)
            t = sum_into(ops, t, addend, out)
        idx = ops.topk_abs_index(t, k)
        return SelectResult(ops.gather(t, idx), idx, math.nan, t, k, None)

    def _native(self, kern: SelectionKernels, t: Tensor, n: int, k: int, addend: Any,
                out: Tensor | None) -> SelectResult | None:
        """:meth:`select` in one native call (docs/selection.md#native-topk), or None where the
        kernels cannot take these tensors (nothing done: the step-by-step route follows)."""
        ops = kern.ops
        sidx, j_lo, j_hi = None, 1, 0  # a small buffer: no sample, every element a candidate
        if n > self.small_n:
            m, sidx = self._plan(ops, t, n, k)
            j_lo, j_hi = self._bracket_ranks(n, k, m)
        g, u, mu, u_out = addend_ops.fused_parts(kern, addend)
        r = kern.fused_topk(t, k, sidx, j_lo, j_hi, self.max_retries, g, u, mu, u_out, out)
        if r is None:
            return None
        acc, vals, idx, v, c, retries, full, above, ties, finite = r
        addend_ops.made_in_pass(addend)
        st = self.stats
        st["retries"] += retries
        st["full_fallbacks"] += full
        st["above_fallbacks"] += above
        st["ties"] += ties
        if sidx is not None:  # the small route sorts the buffer and counts no candidates
            st["candidates"] += c
        return SelectResult(vals, idx, v, acc, k, finite)

    def _finish(self, kern: SelectionKernels, vc, cand, k: int, v: float):
        """From candidate values ``vc`` (at positions ``cand``; None = identity) keep |x| > v and
        the lowest-index ties |x| == v, k in all; v is the exact k-th value."""
        ops = kern.ops
        sel, vals = kern.abs_where(vc, "ge", v)
        cs = ops.numel(sel)
        if cs > k:
            self.stats["ties"] += 1
            keep = self._ties(kern, vals, cs, k, v)
            sel, vals = ops.gather(sel, keep), ops.gather(vals, keep)
        elif cs < k:
            raise RuntimeError(f"internal: {cs} elements >= the k-th value {v!r} for k={k}")
        return vals, (sel if cand is None else ops.gather(cand, sel))

    @staticmethod
    def _ties(kern: SelectionKernels, s, cs: int, k: int, v: float):
        """``s``: the cs > k values with |x| >= v, in index order. Positions in s of those > v
        and of the first ties == v, k in all, ascending."""
        ops = kern.ops
        gt, _ = kern.abs_where(s, "gt", v)
        n_gt = ops.numel(gt)
        need = k - n_gt  # ties to take, >= 1; the need-th tie lies in s[:k]
        ties, _ = kern.abs_where(ops.slice(s, 0, min(cs, k)), "le", v)
        p = int(np.asarray(ops.to_numpy(ops.slice(ties, need - 1, need)))[0])
        # s[:p+1] holds `need` ties and p+1-need larger values; after p only the larger ones
        return ops.cat([ops.arange(p + 1, like=s), ops.slice(gt, p + 1 - need, n_gt)])


def sum_into(ops, t: Tensor, addend: Tensor, out: Tensor | None) -> Tensor:
    """``t + addend`` into t, or into ``out`` with t intact (the paths without a candidate pass:
    small buffers, every element selected)."""
    return ops.add(t if out is None else ops.copy_into(out, 0, t), addend_ops.made(ops, addend))
