"""The trial after a decision of ``compression="auto"``: the model's best uniform assignment,
where it differs from the decision, is measured next, and the faster of the two is kept
(docs/auto-compression.md#trial).

Why: the model prices each bucket apart, from a calibration of the idle link and a measurement of
each method alone; in the step, on two ranks sharing two cores, a dense send launched during
backward competes with it, and a selection runs on the real gradient. On the deep MLP on loopback
(2026-11-27) the decision kept the first 1 MiB bucket dense and sent the rest with DGC 1 %, while
Top-k 1 % on every bucket was 1.2x faster measured. Both are measured, as the revert guard
measures a decision (docs/auto-compression.md#revert), and the faster stays; its measured step
then stands as the prediction the watch compares with, so a model that was wrong does not make
the watch re-decide. Not with a given cost model (``cost_model=``): that prices the user's link,
not the one measured here.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

from .options import AutoOptions, Method
from .report import format_report

__all__ = ["TrialChecks"]


class TrialChecks:
    """The trial's two steps, for :class:`~hvd_commopt.autocompress.policy.AutoPolicy`."""

    reducer: Any
    options: AutoOptions
    report: dict[str, Any] | None
    log: Callable[[str], None]
    phase: str
    _rank: int
    _recent: deque[float]
    _alternative: dict[str, Method] | None
    _trial: tuple[dict[str, Method], float] | None

    def _assign(self, port: Any, methods: dict[str, Method]) -> None:
        raise NotImplementedError

    def _try_alternative(self, port: Any, m: float) -> None:
        """The decision measured ``m``; the model's best uniform assignment, where it differs, is
        measured next, and the faster of the two kept (docs/auto-compression.md#trial)."""
        alt, self._alternative = self._alternative, None
        current = {b.name: self.reducer.method_of(b.name) for b in port.buckets}
        if alt is None or all(alt.get(k, v) == v for k, v in current.items()):
            return
        self._trial = (current, m)
        self._assign(port, alt)
        if self.report is not None:
            what = "/".join(sorted({v.key for v in alt.values()}))
            self.report["trying"] = f"the best uniform assignment ({what}), against the decision's {m * 1e3:.4g} ms"
        self.phase, self._recent = "settle", deque(maxlen=max(self.options.measure_steps, 1))

    def _check_trial(self, port: Any, m: float) -> None:
        """The alternative measured ``m``: kept when faster than the decision (rank 0's verdict,
        broadcast), its measured step then standing as the prediction the watch compares with."""
        decision, m_decision = self._trial
        self._trial = None
        keep = m < m_decision
        if port.comm.size > 1:
            keep = bool(port.comm.broadcast_object(keep, root=0, name="autocompress.trial"))
        rep = self.report
        if rep is not None:
            alt = rep.pop("trying", "")
            rep["trial"] = (f"{alt.split(', against')[0]} measured {m * 1e3:.4g} ms against the decision's {m_decision * 1e3:.4g} ms: "
                            + ("kept" if keep else "the decision stays"))
            if keep:
                for b in rep["buckets"]:
                    b["method"] = self.reducer.method_of(b["bucket"]).key
                rep["predicted_s"], rep["measured_s"] = m, m
            else:
                rep["measured_s"] = m_decision
        if not keep:
            self._assign(port, decision)
        if self.options.verbose and self._rank == 0 and rep is not None:
            self.log(format_report(rep))

