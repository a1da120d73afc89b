"""Fast top-|x| selection, written once against TensorOps and the selection kernels (docs/selection.md).

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
* ``"sampled"`` — DGC's sampled threshold (:class:`~hvd_commopt.compress.dgc.DGCSelector`).

:func:`select_with_memory` is the sparse reducers' prologue (compensate, select, update) with
error feedback fused into the selection where the memory allows it: the gradient is added into
the residual buffer during the candidate pass, the values gathered, and the sent positions
zeroed in place (docs/selection.md#fused-ef), bit-identical to the unfused three steps.

The order on magnitudes is ``+0 == -0 < ... < +Inf < NaN`` (docs/selection.md#order): on
NaN-free input every mode agrees with ``topk_abs``; NaNs rank largest here, deterministically.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError
from . import addend as addend_ops
from .exact_topk import ExactTopK, SelectResult, sum_into
from . import device
from .portable import key_value
from .kernels import kernels_for

__all__ = ["SELECTIONS", "ExactTopK", "ReuseTopK", "SelectResult", "SelectionStrategy", "check_selection", "select_with_memory",
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


class _Reuse:
    """Per-bucket state and drift statistics of :class:`ReuseTopK`."""

    __slots__ = ("thr", "age", "dev", "dev_of", "steps", "exact", "reused", "high", "low", "sent", "k_sum", "drift_abs_sum",
                 "drift_min", "drift_max", "last_count", "last_action")

    def __init__(self):
        self.thr, self.age = None, 0
        self.dev: Any = None  # the device route's (threshold key, age), device tensors (docs/selection.md#device-route)
        self.dev_of: Any = None  # (ops, dtype name) of those tensors
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
        self._saved: dict[str, tuple[int, float | None, int, Any]] = {}  # key -> (step, thr, age, dev) before it

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
        if 0 < k < n and kernels_for(ops, t).sync_free:
            return self._select_on_device(ops, st, t, k, addend, out)
        action = "exact"
        if st.thr is not None and st.age < self.tau and 0 < k < n:
            if addend is not None:
                t, idx, vals = addend_ops.add_abs_where(kernels_for(ops, t), t, addend, "ge", st.thr, out)
                addend = None
            else:
                idx, vals = kernels_for(ops, t).abs_where(t, "ge", st.thr)
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

    def _select_on_device(self, ops, st: _Reuse, t: Tensor, k: int, addend: Tensor | None,
                          out: Tensor | None) -> SelectResult:
        """:meth:`select` with no host decision (:func:`~.device.reuse_topk`): the same set as
        the host route, in a capacity of ``floor(k(1+band))`` entries; the threshold and its age
        stay on the device, so the drift statistics count steps only (docs/selection.md#device-route)."""
        if st.dev is None and st.thr is not None:  # loaded from a checkpoint, or left by the host route
            st.dev = (ops.from_numpy(np.array([ops.abs_key(st.thr, t)], np.int64), like=t),
                      ops.from_numpy(np.array([st.age], np.int64), like=t))
        lo_c, hi_c = math.ceil(k * (1.0 - self.band)), math.floor(k * (1.0 + self.band))
        vals, idx, st.dev, t = device.reuse_topk(ops, t, k, lo_c, hi_c, self.tau, st.dev,
                                                 None if addend is None else addend_ops.made(ops, addend), out)
        st.thr, st.dev_of = None, (ops, ops.dtype_name(t))  # the threshold lives on the device now
        st.last_action = "device"
        return SelectResult(vals, idx, math.nan, t, ops.numel(idx))

    def snapshot(self, key: str, step: int) -> None:
        """The threshold and its age before round ``step`` (restored by :meth:`rollback`)."""
        s = self._state.get(key)
        self._saved[key] = (step, None, 0, None) if s is None else (step, s.thr, s.age, s.dev)

    def rollback(self, key: str, step: int) -> None:
        """A skipped (non-finite) round leaves the threshold as before it; the drift statistics
        keep counting it. Nothing when a later round was already selected (delayed schedules)."""
        saved = self._saved.get(key)
        if saved is not None and saved[0] == step and key in self._state:
            s = self._state[key]
            s.thr, s.age, s.dev = saved[1], saved[2], saved[3]

    def state_dict(self) -> dict:
        out = {key: {"thr": s.thr, "age": s.age} for key, s in self._state.items() if s.thr is not None}
        for key, s in self._state.items():
            if s.thr is None and s.dev is not None:  # read from the device (a checkpoint, not a step)
                ops, dt = s.dev_of
                thr_key, age = (int(np.asarray(ops.to_numpy(x)).reshape(-1)[0]) for x in s.dev)
                out[key] = {"thr": key_value(thr_key, dt), "age": age}
        return out

    def load_state_dict(self, state: dict) -> None:
        self._state.clear()
        for key, v in state.items():
            s = self._state[key] = _Reuse()
            s.thr, s.age = float(v["thr"]), int(v["age"])


def fused_with(compressor: Any, memory: Any) -> bool:
    """Whether :func:`select_with_memory` fuses the memory's add into the selection (the memory
    declares ``fuses_selection``, the selector ``fuses_memory``): ``flat`` then stays intact."""
    return compressor.fuses_memory and memory.fuses_selection


def folds_finite(compressor: Any, memory: Any) -> bool:
    """Whether the selection can tell, from its candidate pass, that ``flat`` is finite
    (docs/selection.md#finite-sweep): fused, with a selection mode that keeps no state across
    steps (exact, sampled), so that selecting a non-finite step and rolling the memory back
    leaves nothing behind."""
    return fused_with(compressor, memory) and compressor.folds_finite


def select_with_memory(compressor: Any, memory: Any, ops: Any, bucket: Any, step: int, flat: Tensor,
                       finite: list | None = None):
    """The sparse reducers' prologue: ``(values, indices)`` of ``flat`` + what the memory holds,
    the memory updated. Fused (docs/selection.md#fused-ef) when both declare it (:func:`fused_with`):
    the memory's ``compensate_select`` calls the selector's ``select_acc``; otherwise compensate,
    select, update.
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


class SelectionStrategy:
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
