"""Layer-wise exact top-k of a CPU bucket in a few batched steps (docs/lags-omgs.md#lags-merged).

The per-member path runs :class:`~hvd_commopt.select.exact_topk.ExactTopK` once per tensor: about
ten framework calls each, so on a 256x256 layer (65k elements, one pass ~20 µs) the calls, not the
memory, set the cost (~0.25 ms per member, 12 ms for 48 layers). Here the steps that do not need the
bucket's memory run once for the whole bucket, on small host arrays:

1. one gather of every member's sample (the positions of ``ExactTopK``'s plan, bucket-relative),
   and the brackets ``lo_l`` of all members from it, by one ``np.partition`` per group of members
   with the same sample size and rank;
2. per member, the one fused sweep ``acc_l = r_l + g_l`` that extracts the candidates
   ``|acc_l| >= lo_l`` (``SelectionKernels.add_abs_where``, on a slice of the bucket);
3. on the candidates (host arrays; about ``14·k_l`` per member at ρ = 0.001 on 65k elements, from the
   small sample, see ``MIN_SAMPLE``): the exact k-th key of each member,
   ``|x| > v`` and the lowest-index ties ``|x| == v``, k in all, ascending; the finiteness verdict.

Same result as the per-member path bit for bit (the same order on keys, docs/selection.md#order;
the same tie rule). A member whose bracket was wrong (fewer than k candidates) is finished by the
per-member path on its sum, as a retry would be. Used for CPU tensors of float16/32/64 only, where
the candidates are host memory already (torch's ``numpy()`` is zero-copy); a device keeps the
per-member path, which stays on the device.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import addend as addend_ops
from .host_numpy import np_abs_keys, np_key_value
from .kernels import kernels_for

__all__ = ["HostLayerwise", "HOST_DTYPES"]

HOST_DTYPES = ("float16", "float32", "float64")
MIN_SAMPLE = 256  # per member: at 65k elements and k = 65, about 900 candidates (14 per selected element)


class _Plan:
    """A bucket's sampling plan: the sample positions of every member with a bracket, and the
    groups that share one partition."""

    __slots__ = ("sidx", "groups")

    def __init__(self, exact: Any, members: tuple, ops: Any, like: Any):
        pos: list[np.ndarray] = []
        starts: dict[tuple[int, int], list[tuple[int, int]]] = {}
        at = 0
        for j, (off, n, k) in enumerate(members):
            if 0 < k < n and n > exact.small_n:
                # a smaller floor than ExactTopK's: the candidates cost little here (host arrays),
                # the gather of the sample is random access into the whole bucket
                m = int(min(n, max(MIN_SAMPLE, round(exact.sample_scale * (k * float(n)) ** (1.0 / 3.0)))))
                stride = n // m
                rng = np.random.Generator(np.random.PCG64([exact.seed, n, m]))
                pos.append(np.arange(m, dtype=np.int64) * stride + rng.integers(0, stride, size=m) + off)
                j_lo, _ = exact._bracket_ranks(n, k, m)
                if j_lo <= m:
                    starts.setdefault((m, j_lo), []).append((j, at))
                at += m
        self.sidx = ops.from_numpy(np.concatenate(pos), like=like) if pos else None
        # (member numbers, row starts [G, 1] + arange(m) -> [G, m] positions in the sample, kth)
        self.groups = [(np.array([j for j, _ in rs]), np.array([a for _, a in rs])[:, None] + np.arange(m), m - j_lo)
                       for (m, j_lo), rs in starts.items()]


def _top(keys: np.ndarray, k: int) -> np.ndarray:
    """Positions (ascending) of the k largest keys, ties to the lower position."""
    c = keys.size
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    if k >= c:
        return np.arange(c, dtype=np.int64)
    kth = keys.dtype.type(np.partition(keys, c - k)[c - k])
    mask = keys > kth
    need = k - int(np.count_nonzero(mask))
    if need:
        mask[np.flatnonzero(keys == kth)[:need]] = True
    return np.flatnonzero(mask)


class HostLayerwise:
    """The batched layer-wise selection of one compressor (its :class:`ExactTopK` and stats)."""

    def __init__(self, exact: Any):
        self.exact = exact
        self._plans: dict[tuple, _Plan] = {}

    def select(self, ops: Any, members: tuple, key: tuple, r: Any, addend: Any, out: Any
               ) -> tuple[Any, Any, list, bool, int]:
        """(values, ascending bucket-relative indices, the members' sums, finite, exact selections
        made) of the members' top-k of ``acc = r + addend``, the sums written into ``out`` (r
        intact) or into r where the framework's slices are views."""
        ex, st = self.exact, self.exact.stats
        dtype = np.dtype(ops.dtype_name(r))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 256:
                self._plans.clear()
            plan = self._plans[key] = _Plan(ex, members, ops, r)
        target = r if out is None else out
        kern = kernels_for(ops, r)
        # 1. every member's bracket from one gather of the sample
        lo = {}
        if plan.sidx is not None:
            s = ops.gather(r, plan.sidx)
            if addend is not None:
                s = ops.add(s, addend_ops.gather(ops, addend, plan.sidx))  # the sums the sweep will make
            sk = np_abs_keys(np.ascontiguousarray(ops.to_numpy(s), dtype=dtype))
            for js, rows, kth in plan.groups:
                for j, kk in zip(js, np.partition(sk[rows], kth, axis=1)[:, kth]):
                    lo[int(j)] = np_key_value(kk, dtype)
        vals, idxs, sums, finite, made, parts = [], [], [], True, 0, []
        for j, (off, n, k) in enumerate(members):
            st["calls"] += 1
            made += 1
            part = ops.slice(target, off, off + n)
            src = part if out is None else ops.slice(r, off, off + n)
            thr = lo.get(j, 0.0) if 0 < k < n else -1.0
            if addend is not None:
                parts.append(addend_ops.slice_of(ops, addend, off, off + n))
                acc, cand, vc = addend_ops.add_abs_where(kern, src, parts[-1], "ge", thr,
                                                         None if out is None else part)
            else:
                acc = src
                cand, vc = kern.abs_where(src, "ge", thr)
            sums.append(acc)
            vc_np = np.asarray(ops.to_numpy(vc))
            c = vc_np.size
            st["candidates"] += c
            if c < k:  # the bracket missed (rare): the per-member path on the member's sum
                st["retries"] += 1
                res = ex.select(ops, acc, k)
                made += 1
                vals.append(np.asarray(ops.to_numpy(res.values)))
                idxs.append(np.asarray(ops.to_numpy(res.indices), dtype=np.int64) + off)
                finite = finite and ops.all_finite(acc)
                continue
            # every NaN/Inf is a candidate unless lo is NaN (docs/selection.md#finite-sweep)
            finite = finite and (False if thr != thr else bool(np.isfinite(vc_np).all()))
            keep = _top(np_abs_keys(vc_np), k)
            vals.append(vc_np[keep])
            cand_np = np.asarray(ops.to_numpy(cand), dtype=np.int64)
            idxs.append(cand_np[keep] + off)
        addend_ops.made_by_slices(ops, addend, parts)
        v = ops.from_numpy(np.concatenate(vals), like=r)
        i = ops.from_numpy(np.concatenate(idxs), like=r)
        return v, i, sums, finite, made
