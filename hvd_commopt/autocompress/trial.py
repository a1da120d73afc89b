"""The trial after a decision of ``compression="auto"``: the fastest predicted uniform assignments
(at most ``decide.TRIALS``), where they differ from the decision, are measured next, and the
fastest measured of them and the decision is kept (docs/auto-compression.md#trial).

Why: the model prices each bucket apart, from a calibration of the idle link and a measurement of
each method alone; in the step, on two ranks sharing two cores, a dense send launched during
backward competes with it, and a selection runs on the real gradient. On the deep MLP on loopback
(2026-11-27) the decision kept the first 1 MiB bucket dense and sent the rest with DGC 1 %, while
Top-k 1 % on every bucket was 1.2x faster measured; Top-k and DGC 1 % measured alone came out in
either order from one process to the next. All are measured, as the revert guard measures a
decision (docs/auto-compression.md#revert), and the fastest stays; where it is not the decision, its measured step
then stands as the prediction the watch compares with, so a model that was wrong does not make
the watch re-decide. Not with a given cost model (``cost_model=``): that prices the user's link,
not the one measured here.

Before an alternative replaces the decision, the decision is measured once more (a *confirmation*,
docs/auto-compression.md#trial-confirm) and its faster measurement of the two is what the
alternative must beat by :data:`TRIAL_MARGIN`. Each assignment's window is a few contiguous steps,
so a machine that slows down during the decision's window (another process, a page-cache flush)
makes it look slower than an alternative measured after it: on the transformer at 10 Gbit/s
(2026-11-27 13:48 UTC, a quiet machine) the trial measured bf16 at 1024 ms and dense fp32 at 923 ms
and kept fp32, while the timed blocks that followed ran DDP's bf16 hook 4 % faster than fp32, and
a rerun a few minutes later measured bf16 at 772 ms and fp32 at 925 ms. Costs one more window,
only when the decision would be replaced.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

from .options import AutoOptions, Method

__all__ = ["TrialChecks", "TRIAL_MARGIN"]

#: An assignment measured after the fastest so far replaces it only when faster by more than this
#: fraction, so the decision (measured first) stands against a tie. Each assignment is measured once,
#: over ``measure_steps`` steps: on the transformer at 10 Gbit/s (2026-11-27 08:04 UTC, load 3.5) the
#: block medians of one variant ranged over +-10 %, and the trial replaced the decision, bf16 on both
#: buckets (12.3 ms a step shorter by the model; our bf16 0.98x DDP against S-SGD's 0.95x in the same
#: job), by dense fp32 measured faster in its 5 steps (docs/auto-compression.md#trial-margin). The
#: model errors the trial is there for were larger: 1.2x on the deep MLP (module docstring).
TRIAL_MARGIN = 0.05


class TrialChecks:
    """The trial's two steps, for :class:`~hvd_commopt.autocompress.policy.AutoPolicy`."""

    reducer: Any
    options: AutoOptions
    report: dict[str, Any] | None
    log: Callable[[str], None]
    phase: str
    _rank: int
    _recent: deque[float]
    _alternatives: list[dict[str, Method]]
    _trial: tuple[dict[str, Method], float] | None  # the fastest measured so far
    # the decision and its first measurement, until the trial ends; None while it is measured again
    _trial_decision: tuple[dict[str, Method], float] | None
    _confirming: bool

    def _assign(self, port: Any, methods: dict[str, Method]) -> None:
        raise NotImplementedError

    def _trial_step(self, port: Any, m: float) -> bool:
        """The assignment in use measured ``m`` (this rank's; rank 0's figure is broadcast, so that
        every rank compares alike): remember it if it is the fastest so far, then put the next
        alternative in place (True: measure it), or the fastest measured back (False)."""
        if port.comm.size > 1:
            m = float(port.comm.broadcast_object(m, root=0, name="autocompress.trial"))
        current = {b.name: self.reducer.method_of(b.name) for b in port.buckets}
        rep = self.report
        if self._trial is None:
            self._trial = self._trial_decision = (current, m)
            self._confirming = False
        elif self._confirming:  # the decision measured again: its faster showing is the bar
            decision, m_first = self._trial_decision
            m_decision = min(m_first, m)
            if rep is not None:
                rep.setdefault("trials", []).append(f"{_what(decision)} again: {m * 1e3:.4g} ms")
            if not self._trial[1] < m_decision * (1.0 - TRIAL_MARGIN):
                self._trial = (decision, m_decision)
            self._trial_decision = None
        else:
            if rep is not None:
                rep.setdefault("trials", []).append(f"{_what(current)}: {m * 1e3:.4g} ms")
            if m < self._trial[1] * (1.0 - TRIAL_MARGIN):
                self._trial = (current, m)
        while self._alternatives:
            alt = self._alternatives.pop(0)
            if any(alt.get(k, v) != v for k, v in current.items()):
                self._assign(port, alt)
                if rep is not None:
                    rep["trying"] = f"{_what(alt)}, against the fastest so far, {self._trial[1] * 1e3:.4g} ms"
                self.phase, self._recent = "settle", deque(maxlen=max(self.options.measure_steps, 1))
                return True
        best, m_best = self._trial
        if self._trial_decision is not None and best != self._trial_decision[0]:
            self._confirming = True  # measure the decision once more before it is replaced (module docstring)
            self._assign(port, self._trial_decision[0])
            if rep is not None:
                rep["trying"] = f"the decision again, against the fastest so far, {m_best * 1e3:.4g} ms"
            self.phase, self._recent = "settle", deque(maxlen=max(self.options.measure_steps, 1))
            return True
        self._trial = self._trial_decision = None
        self._confirming = False
        if rep is not None:
            rep.pop("trying", None)
            if "trials" in rep:
                rep["trial"] = f"kept {_what(best)} at {m_best * 1e3:.4g} ms (tried {'; '.join(rep.pop('trials'))})"
                rep["measured_s"] = m_best
                if best != {b["bucket"]: Method.parse(b["method"]) for b in rep["buckets"]}:
                    rep["predicted_s"] = m_best  # the measurement stands where the model was wrong
                for b in rep["buckets"]:
                    b["method"] = best.get(b["bucket"], Method.parse(b["method"])).key
        if best != current:
            self._assign(port, best)
        return False


def _what(methods: dict[str, Method]) -> str:
    """``"topk@0.01 x2, none"``: the methods of an assignment, with their bucket counts."""
    keys = [m.key for m in methods.values()]
    return ", ".join(f"{k} x{keys.count(k)}" if keys.count(k) > 1 else k for k in sorted(set(keys)))
