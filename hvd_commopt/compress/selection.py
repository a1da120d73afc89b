"""Fast top-|x| selection, written once against TensorOps (docs/selection.md).

Three modes, chosen per compressor (``Compression.topk(density, selection=...)``, DGC too):

* ``"exact"`` — :class:`ExactTopK`: the same result as ``TensorOps.topk_abs`` bit for bit (k
  largest |x|, ties to the lower index, indices ascending; docs/wrapper.md#topk-ties) in about
  one pass plus work in k: a strided-jittered sample brackets the k-th value between
  ``lo <= v* < hi`` (Floyd-Rivest), one pass extracts the candidates ``|x| >= lo``, and the exact
  k-th value is found among the few candidates in ``[lo, hi)``. A wrong bracket is never a wrong
  answer, only a retry (docs/selection.md#exact).
* ``"threshold"`` — :class:`ReuseTopK`: Ok-Topk's threshold reuse (Li & Hoefler, PPoPP'22): the
  exact k-th value is recomputed every ``tau`` steps and reused in between; a step keeps every
  ``|x| >= thr`` while the count stays within ``[k(1-band), k(1+band)]``, else it recomputes
  (docs/selection.md#reuse). Approximate by the user's choice; the drift is in the stats.
* ``"sampled"`` — DGC's sampled threshold (:class:`~hvd_commopt.compress.dgc.DGCCompressor`).

:func:`select_with_memory` is the sparse reducers' prologue (compensate, select, update) with
error feedback fused into the selection where the memory allows it: the gradient is added into
the residual buffer during the candidate pass, the values gathered, and the sent positions
zeroed in place (docs/selection.md#fused-ef), bit-identical to the unfused three steps.

The order on magnitudes is ``+0 == -0 < ... < +Inf < NaN`` (hvd_commopt.select_kernels): on
NaN-free input every mode agrees with ``topk_abs``; NaNs rank largest here, deterministically.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import addend as addend_ops

__all__ = ["SELECTIONS", "ExactTopK", "ReuseTopK", "SelectResult", "Selection", "check_selection", "select_with_memory",
           "fused_with", "folds_finite", "sum_into"]

SELECTIONS = ("exact", "threshold", "sampled")
Tensor = Any


def check_selection(selection: Any, tau: Any = 16, band: Any = 0.2) -> tuple[str, int, float]:
    """Validated ``(selection, tau, band)``, or one ConfigError that names the fix."""
    if selection not in SELECTIONS:
        raise ConfigError(f"selection must be one of {SELECTIONS}, got {selection!r}: 'exact' (the exact top-k, "
                          f"fast), 'threshold' (Ok-Topk's threshold reuse) or 'sampled' (DGC's sampled threshold)")
    if isinstance(tau, bool) or not isinstance(tau, (int, np.integer)) or int(tau) < 1:
        raise ConfigError(f"tau must be an integer >= 1 (steps between exact threshold computations), got "
                          f"{tau!r}; use tau=1 to recompute the threshold every step")
    if isinstance(band, bool) or not isinstance(band, (int, float)) or not (0.0 < float(band) < 1.0):
        raise ConfigError(f"band must be in (0, 1) (the relative drift of the selected count allowed around k), "
                          f"got {band!r}; e.g. band=0.2 accepts 0.8k..1.2k entries")
    return str(selection), int(tau), float(band)


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
        if k == 0 or n <= self.small_n or k == n:
            if addend is not None:
                t = sum_into(ops, t, addend, out)
            if k == 0:
                idx = ops.arange(0, like=t)
                return SelectResult(ops.gather(t, idx), idx, math.inf, t, 0)
            if k == n:
                idx = ops.arange(n, like=t)
                return SelectResult(ops.gather(t, idx), idx, ops.kth_largest_abs(t, n), t, n)
            v = ops.kth_largest_abs(t, k)
            vals, idx = self._finish(ops, t, None, k, v)
            return SelectResult(vals, idx, v, t, k)

        # 1. the sample brackets the k-th value: lo <= v* < hi (w.h.p.)
        m, sidx = self._plan(ops, t, n, k)
        s = ops.gather(t, sidx)
        if addend is not None:
            s = ops.add(s, addend_ops.gather(ops, addend, sidx))  # the same sums as the full pass will make
        j_lo, j_hi = self._bracket_ranks(n, k, m)
        lo = ops.kth_largest_abs(s, j_lo) if j_lo <= m else 0.0
        hi = ops.kth_largest_abs(s, j_hi) if j_hi >= 1 else None

        # 2. the pass: candidates |x| >= lo, ascending; lower lo and retry while fewer than k
        retries = 0
        while True:
            if lo <= 0.0 and not math.isnan(lo):  # every element qualifies: no extraction
                if addend is not None:
                    t, addend = sum_into(ops, t, addend, out), None
                cand, c = None, n
                break
            if addend is not None:
                t, cand, vc = addend_ops.add_abs_where(ops, t, addend, "ge", lo, out)
                addend = None
            else:
                cand, vc = ops.abs_where(t, "ge", lo)
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
                lo = ops.kth_largest_abs(s, j_lo)
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
            v = ops.kth_largest_abs(vc, k)
        else:
            _, band = ops.abs_where(vc, "lt", hi)
            a = c - ops.numel(band)  # candidates >= hi
            if a < k:
                v = ops.kth_largest_abs(band, k - a)
            elif a == k:
                v = hi  # exactly k elements >= hi: they are the top-k
            else:
                _, above = ops.abs_where(vc, "gt", hi)
                if ops.numel(above) < k:
                    v = hi  # >= hi: more than k, > hi: fewer than k, so the k-th value is hi
                else:
                    st["above_fallbacks"] += 1
                    v = ops.kth_largest_abs(above, k)

        # 4. |x| >= v* with the tie rule
        vals, idx = self._finish(ops, vc, cand, k, v)
        return SelectResult(vals, idx, v, t, k, finite)

    def _finish(self, ops, vc, cand, k: int, v: float):
        """From candidate values ``vc`` (at positions ``cand``; None = identity) keep |x| > v and
        the lowest-index ties |x| == v, k in all; v is the exact k-th value."""
        sel, vals = ops.abs_where(vc, "ge", v)
        cs = ops.numel(sel)
        if cs > k:
            self.stats["ties"] += 1
            keep = self._ties(ops, vals, cs, k, v)
            sel, vals = ops.gather(sel, keep), ops.gather(vals, keep)
        elif cs < k:
            raise RuntimeError(f"internal: {cs} elements >= the k-th value {v!r} for k={k}")
        return vals, (sel if cand is None else ops.gather(cand, sel))

    @staticmethod
    def _ties(ops, s, cs: int, k: int, v: float):
        """``s``: the cs > k values with |x| >= v, in index order. Positions in s of those > v
        and of the first ties == v, k in all, ascending."""
        gt, _ = ops.abs_where(s, "gt", v)
        n_gt = ops.numel(gt)
        need = k - n_gt  # ties to take, >= 1; the need-th tie lies in s[:k]
        ties, _ = ops.abs_where(ops.slice(s, 0, min(cs, k)), "le", v)
        p = int(np.asarray(ops.to_numpy(ops.slice(ties, need - 1, need)))[0])
        # s[:p+1] holds `need` ties and p+1-need larger values; after p only the larger ones
        return ops.cat([ops.arange(p + 1, like=s), ops.slice(gt, p + 1 - need, n_gt)])


class _Reuse:
    """Per-bucket state and drift statistics of :class:`ReuseTopK`."""

    __slots__ = ("thr", "age", "steps", "exact", "reused", "high", "low", "sent", "k_sum", "drift_abs_sum",
                 "drift_min", "drift_max", "last_count", "last_action")

    def __init__(self):
        self.thr, self.age = None, 0
        self.steps = self.exact = self.reused = self.high = self.low = self.sent = self.k_sum = 0
        self.drift_abs_sum, self.drift_min, self.drift_max = 0.0, math.inf, -math.inf
        self.last_count, self.last_action = 0, ""

    def as_dict(self) -> dict:
        tried = self.reused + self.high + self.low
        nan = float("nan")
        return {"steps": self.steps, "exact_scheduled": self.exact, "reused": self.reused,
                "recompute_high": self.high, "recompute_low": self.low,
                "sent_over_k": self.sent / self.k_sum if self.k_sum else nan,
                "drift_abs_mean": self.drift_abs_sum / tried if tried else nan,
                "drift_min": self.drift_min if tried else nan, "drift_max": self.drift_max if tried else nan,
                "last_count": self.last_count, "last_action": self.last_action}


class ReuseTopK:
    """Ok-Topk threshold reuse: a reused step selects every ``|x| >= thr`` (ascending indices;
    the set is defined by the threshold alone, the same in every framework), ``k(1-band) <=
    count <= k(1+band)``. Above the band the exact top-k is taken inside the (superset)
    selection, below it the whole buffer is selected exactly; both reset the threshold.

    Args:
        tau: steps between exact recomputations (a bucket's first step is exact).
        band: accepted relative drift of the count, in (0, 1).
    """

    def __init__(self, tau: int = 16, band: float = 0.2, exact: ExactTopK | None = None):
        _, self.tau, self.band = check_selection("threshold", tau, band)
        self.exact = exact or ExactTopK()
        self._state: dict[str, _Reuse] = {}
        self._saved: dict[str, tuple[int, float | None, int]] = {}  # key -> (step, thr, age) before it

    def stats(self) -> dict[str, dict]:
        """{bucket: drift statistics}: counts of exact / reused / recomputed steps, sent/k, drift."""
        return {key: s.as_dict() for key, s in sorted(self._state.items())}

    def select(self, ops, t: Tensor, k: int, key: str = "", addend: Tensor | None = None,
               out: Tensor | None = None) -> SelectResult:
        st = self._state.setdefault(key, _Reuse())
        st.steps += 1
        n = ops.numel(t)
        k = min(int(k), n)
        st.k_sum += k
        action = "exact"
        if st.thr is not None and st.age < self.tau and 0 < k < n:
            if addend is not None:
                t, idx, vals = addend_ops.add_abs_where(ops, t, addend, "ge", st.thr, out)
                addend = None
            else:
                idx, vals = ops.abs_where(t, "ge", st.thr)
            c = ops.numel(idx)
            d = c / k - 1.0
            st.drift_abs_sum += abs(d)
            st.drift_min, st.drift_max = min(st.drift_min, d), max(st.drift_max, d)
            if k * (1.0 - self.band) <= c <= k * (1.0 + self.band):
                st.age += 1
                st.reused += 1
                st.sent += c
                st.last_count, st.last_action = c, "reuse"
                return SelectResult(vals, idx, st.thr, t, c)
            if c > k:  # a superset of the top-k: the exact top-k inside it, order kept
                st.high += 1
                action = "high"
                r = self.exact.select(ops, vals, k)
                res = SelectResult(r.values, ops.gather(idx, r.indices), r.threshold, t, k)
            else:
                st.low += 1
                action = "low"
                res = self.exact.select(ops, t, k)
        else:
            st.exact += 1
            res = self.exact.select(ops, t, k, addend=addend, out=out)
        st.thr, st.age = res.threshold, 0
        st.sent += res.count
        st.last_count, st.last_action = res.count, action
        return res

    def snapshot(self, key: str, step: int) -> None:
        """The threshold and its age before round ``step`` (restored by :meth:`rollback`)."""
        s = self._state.get(key)
        self._saved[key] = (step, None, 0) if s is None else (step, s.thr, s.age)

    def rollback(self, key: str, step: int) -> None:
        """A skipped (non-finite) round leaves the threshold as before it; the drift statistics
        keep counting it. Nothing when a later round was already selected (delayed schedules)."""
        saved = self._saved.get(key)
        if saved is not None and saved[0] == step and key in self._state:
            s = self._state[key]
            s.thr, s.age = saved[1], saved[2]

    def state_dict(self) -> dict:
        return {key: {"thr": s.thr, "age": s.age} for key, s in self._state.items() if s.thr is not None}

    def load_state_dict(self, state: dict) -> None:
        self._state.clear()
        for key, v in state.items():
            s = self._state[key] = _Reuse()
            s.thr, s.age = float(v["thr"]), int(v["age"])


def sum_into(ops, t: Tensor, addend: Tensor, out: Tensor | None) -> Tensor:
    """``t + addend`` into t, or into ``out`` with t intact (the paths without a candidate pass:
    small buffers, every element selected)."""
    return ops.add(t if out is None else ops.copy_into(out, 0, t), addend_ops.made(ops, addend))


def fused_with(compressor: Any, memory: Any) -> bool:
    """Whether :func:`select_with_memory` fuses the memory's add into the selection (the memory
    offers ``compensate_select``, the compressor ``select_acc``): ``flat`` then stays intact."""
    return (getattr(memory, "compensate_select", None) is not None and getattr(compressor, "select_acc", None)
            is not None and getattr(memory, "enabled", False))


def folds_finite(compressor: Any, memory: Any) -> bool:
    """Whether the selection can tell, from its candidate pass, that ``flat`` is finite
    (docs/selection.md#finite-sweep): fused, with a selection mode that keeps no state across
    steps (exact, sampled), so that selecting a non-finite step and rolling the memory back
    leaves nothing behind."""
    return fused_with(compressor, memory) and getattr(compressor, "folds_finite", False)


def select_with_memory(compressor: Any, memory: Any, ops: Any, bucket: Any, step: int, flat: Tensor,
                       finite: list | None = None):
    """The sparse reducers' prologue: ``(values, indices)`` of ``flat`` + what the memory holds,
    the memory updated. Fused (docs/selection.md#fused-ef) when the memory offers
    ``compensate_select`` and the compressor ``select_acc``; otherwise compensate, select, update.
    ``finite``: a list the fused selection appends its verdict on the sum's finiteness to (True,
    False, or None when its pass could not tell; docs/selection.md#finite-sweep)."""
    key = bucket.name if bucket is not None else ""
    if fused_with(compressor, memory):
        select_acc = compressor.select_acc
        return memory.compensate_select(
            ops, key, flat, lambda r, addend, out=None: select_acc(ops, r, bucket, step, addend, out, finite))
    acc = memory.compensate(ops, key, flat)
    vals, idx = compressor.select(ops, acc, bucket, step)
    memory.update(ops, key, acc, idx)
    return vals, idx


_CALL_STEPS_KEPT = 8  # rounds per bucket whose selections a rollback can still take back


class Selection:
    """A compressor's selection mode: ``select_acc(ops, r, k, bucket, step, addend, out, finite)``
    returns ``(values, indices, acc)`` with ``acc = r + addend`` (into r where allowed, or into
    ``out`` with r intact; addend None: acc is r) and appends to the list ``finite`` (when given)
    whether acc is finite (None: unknown). ``sampled`` is the compressor's own sampled-threshold
    selection ``(ops, r, bucket, step, addend, out, finite) -> (values, indices, acc)``, needed for
    ``"sampled"`` only."""

    def __init__(self, selection: str = "exact", tau: int = 16, band: float = 0.2, sampled: Any = None):
        self.mode, self.tau, self.band = check_selection(selection, tau, band)
        self.exact = ExactTopK()
        self.reuse = ReuseTopK(self.tau, self.band, self.exact) if self.mode == "threshold" else None
        self.sampled = sampled
        # bucket -> {step: exact selections made for it}, so that a rolled-back (non-finite)
        # round leaves no trace in the "calls" count (docs/wrapper.md#nonfinite); a few recent
        # steps per bucket, as delayed schedules select round s+1 before round s settles
        self._calls: dict[str, dict[int, int]] = {}

    @property
    def folds_finite(self) -> bool:
        """The mode keeps no state across steps, so a selection made of a non-finite step leaves
        nothing behind once the memory is rolled back (threshold reuse keeps its threshold)."""
        return self.mode in ("exact", "sampled")

    def select_acc(self, ops, r: Tensor, k: int, bucket: Any, step: int, addend: Tensor | None,
                   out: Tensor | None = None, finite: list | None = None):
        name = bucket.name if bucket is not None else ""
        if self.mode == "sampled":
            return self.sampled(ops, r, bucket, step, addend, out, finite)
        calls = self.exact.stats["calls"]
        if self.mode == "exact":
            res = self.exact.select(ops, r, k, addend=addend, out=out)
        else:
            res = self.reuse.select(ops, r, k, key=name, addend=addend, out=out)
        # threshold reuse calls the exact selector on its own steps only
        self.record_calls(name, step, self.exact.stats["calls"] - calls)
        if finite is not None:
            finite.append(res.finite)
        return res.values, res.indices, res.acc

    def record_calls(self, name: str, step: int, made: int) -> None:
        """``made`` exact selections of bucket ``name`` in round ``step``, which a rollback of
        that round takes back from the ``calls`` count."""
        if made:
            per_step = self._calls.setdefault(name, {})
            per_step[step] = per_step.get(step, 0) + made
            if len(per_step) > _CALL_STEPS_KEPT:
                del per_step[min(per_step)]

    def check_k(self, k_raw: float, n: int, name: str) -> None:
        """Threshold reuse needs a k that the density gives, not one rounded up from 0."""
        if self.mode == "threshold" and n > 0 and int(k_raw) < 1:
            raise ConfigError(f"density gives k = {k_raw:.3g} < 1 for bucket {name!r} of {n} elements; threshold "
                              f"reuse keeps a count around k, which needs k >= 1: raise the density to at least "
                              f"{1.0 / n:.3g} for this bucket (a per-layer density dict), or use selection='exact'")

    def config(self) -> dict:
        out: dict = {"selection": self.mode}
        if self.mode == "threshold":
            out.update(tau=self.tau, band=self.band)
        return out

    def stats(self) -> dict:
        """Threshold reuse's per-bucket drift statistics, the exact selector's counters."""
        out: dict = {"exact": dict(self.exact.stats)}
        if self.reuse is not None:
            out["threshold"] = self.reuse.stats()
        return out

    def state_dict(self) -> dict:
        return {"thresholds": self.reuse.state_dict()} if self.reuse is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.reuse is not None:
            self.reuse.load_state_dict(dict(state.get("thresholds", {})))

    def snapshot(self, key: str, step: int) -> None:
        self._calls.get(key, {}).pop(step, None)  # the round's count starts here
        if self.reuse is not None:
            self.reuse.snapshot(key, step)

    def rollback(self, key: str, step: int) -> None:
        """Round ``step`` of ``key`` was skipped: the exact selector's ``calls`` forgets its
        selections (once: a second rollback of the same round finds none), threshold reuse's
        threshold goes back to its snapshot. The work counters (retries, ties, ...) keep it: that
        work was done."""
        self.exact.stats["calls"] -= self._calls.get(key, {}).pop(step, 0)
        if self.reuse is not None:
            self.reuse.rollback(key, step)
