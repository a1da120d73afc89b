"""Per-tensor gradient-ready profile of real training steps: the simulator's inputs (docs/cost-models.md#fitted-allreduce-model, docs/mgwfbp.md#greedy).

Reference: MG-WFBP's ``profiling.py: benchmark`` hooks every parameter's gradient, synchronises
the GPU and times 5 warm-up + 50 measured iterations to get each layer's backward time ``tb``.
Here the engine calls :meth:`StepProfiler.arrived` from ``grad_ready`` (the adapters' backward
hooks) and :meth:`StepProfiler.boundary` when a step ends (``synchronize()`` returned); the clock
is injectable so tests can drive it.

Definitions, for one profiled step ``s`` (positions in the engine's backward order):

* ``t0`` = the end of the previous step. The time before a step's first gradient therefore holds
  the previous step's optimizer update, ``zero_grad``, data loading, forward and the first
  backward operations; it is reported as ``forward_s``. Splitting it further needs hooks the
  engine does not have, and the split does not matter: shifting every ready time by a constant
  shifts the whole DAG (docs/dag-model.md#task-graph), so the plan and the predicted period are unchanged.
* ``a[i]`` = when position ``i``'s gradient was handed in (the last ``grad_ready`` of the step, so
  with ``backward_passes_per_step > 1`` the pass that launches it). A tensor with no gradient in
  the step is packed by ``synchronize()``: it gets the step's last arrival.
* ``e[i] = max(a[0..i]) - t0``: the *effective* ready time. The engine launches buckets strictly
  in plan order, so a bucket can go when its last member *and everything before it* has arrived;
  with gradients that arrive out of backward order (ResNet shortcuts) ``e`` is what the
  simulator's ``ready = Σ tb`` must reproduce.
* ``period`` = end of this step - ``t0``: the measured iteration time (steady state).

Over the profiled steps: ``E[i] = median_s e_s[i]``, ``F = median_s (min_i a_s[i] - t0_s)``,
``tb[0] = E[0] - F``, ``tb[i] = E[i] - E[i-1]`` (medians preserve the per-step order, so all
``tb >= 0``), ``period = median_s period_s``. The simulator then predicts the period as
``simulate(plan, sizes, tb, comm, forward_time=F).iteration_time``.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["Profile", "StepProfiler"]


@dataclass(frozen=True)
class Profile:
    """The simulator's inputs measured on one rank (backward order throughout).

    Attributes:
        names, sizes_bytes: the tensors, in the engine's backward order.
        backward_times: ``tb`` per tensor (docs/mgwfbp.md#inputs) (module docstring).
        forward_s: median time from the end of the previous step to the first gradient.
        period_s: median measured iteration time (end of step to end of step).
        steps: how many steps the medians are over.
        out_of_order: tensors whose gradient arrived before an earlier position's (last step).
        missing: tensors with no gradient in at least one profiled step.
    """

    names: tuple[str, ...]
    sizes_bytes: tuple[int, ...]
    backward_times: tuple[float, ...]
    forward_s: float
    period_s: float
    steps: int
    out_of_order: int = 0
    missing: int = 0

    @property
    def backward_s(self) -> float:
        return float(sum(self.backward_times))

    def to_json(self) -> dict[str, Any]:
        """The ``profile.json`` format of ``python -m hvd_commopt.plan --model-profile``."""
        return {"tensors": [{"name": n, "bytes": int(b), "backward_s": float(t)}
                            for n, b, t in zip(self.names, self.sizes_bytes, self.backward_times)],
                "forward_s": self.forward_s, "update_s": 0.0, "period_s": self.period_s,
                "steps": self.steps}


class StepProfiler:
    """Records gradient arrivals and step boundaries; :meth:`profile` reduces them to medians.

    Args:
        names, sizes_bytes: the registered tensors in backward order.
        clock: seconds, monotonic (default ``time.perf_counter``).
    """

    def __init__(self, names: Sequence[str], sizes_bytes: Sequence[int],
                 clock: Callable[[], float] = time.perf_counter):
        if len(names) != len(sizes_bytes):
            raise ValueError("one size per tensor name")
        self.names = tuple(names)
        self.sizes = tuple(int(s) for s in sizes_bytes)
        self.clock = clock
        self._arrivals: dict[str, float] = {}
        self._t0: float | None = None
        self._e: list[list[float]] = []
        self._first: list[float] = []
        self._periods: list[float] = []
        self._out_of_order = 0
        self._missing: set[str] = set()

    def arrived(self, name: str) -> None:
        """A gradient was handed in now (called from the backward hooks; the last call wins)."""
        self._arrivals[name] = self.clock()

    def boundary(self, record: bool = True) -> float | None:
        """A step ended now. With ``record``, keep the step that ended (if its start is known).

        Returns the step's period (seconds since the previous boundary), or None for the first.
        """
        now = self.clock()
        t0, self._t0 = self._t0, now
        arrivals, self._arrivals = self._arrivals, {}
        if t0 is None:
            return None
        period = now - t0
        if record:
            self._record(t0, arrivals, period)
        return period

    def restart(self) -> None:
        """Forget the pending step's arrivals (keeps the recorded steps and the last boundary)."""
        self._arrivals = {}

    def _record(self, t0: float, arrivals: dict[str, float], period: float) -> None:
        got = [arrivals.get(n) for n in self.names]
        present = [a for a in got if a is not None]
        last = max(present) if present else t0
        first = min(present) if present else t0
        e, run, ooo = [], float("-inf"), 0
        for name, a in zip(self.names, got):
            if a is None:
                self._missing.add(name)
                a = last  # packed by synchronize(), after every hook of the step
            elif a < run:
                ooo += 1
            run = max(run, a)
            e.append(run - t0)
        self._e.append(e)
        self._first.append(first - t0)
        self._periods.append(period)
        self._out_of_order = ooo

    @property
    def recorded(self) -> int:
        return len(self._periods)

    @property
    def periods(self) -> list[float]:
        return list(self._periods)

    def profile(self) -> Profile:
        """Medians over the recorded steps (module docstring).

        Raises:
            ValueError: no step recorded yet.
        """
        if not self._periods:
            raise ValueError("no profiled step yet: call boundary() at the end of at least two steps")
        n = len(self.names)
        f = statistics.median(self._first)
        med = [statistics.median(e[i] for e in self._e) for i in range(n)]
        tb, prev = [], f
        for m in med:
            tb.append(max(0.0, m - prev))
            prev = max(prev, m)
        return Profile(self.names, self.sizes, tuple(tb), max(0.0, f), statistics.median(self._periods),
                       len(self._periods), self._out_of_order, len(self._missing))
