"""``fusion="auto"``: build the candidate plans and keep the one the simulator predicts fastest.

Every candidate is scored by the same :func:`~hvd_commopt.fusion.simulator.simulate` call, so the
comparison is only as good as the profile (``backward_times``) and the cost model; the point is
to pick between planners whose own objectives differ (a threshold knows nothing about timing,
MG-WFBP's greedy is not optimal, docs/mgwfbp.md#t-mg-4) with one consistent yardstick, and to log every
candidate's prediction (docs/mgwfbp.md#exact-dp "log both predicted times").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from .cost_model import AlphaBeta
from .exact import plan_optimal
from .mgwfbp import plan_mgwfbp
from .omgs import plan_omgs
from .simulator import SimResult, simulate
from .threshold import plan_per_tensor, plan_single, plan_threshold

__all__ = ["PlanChoice", "choose_plan", "candidate_plans"]


@dataclass(frozen=True)
class PlanChoice:
    """The winning strategy and every candidate's prediction.

    Attributes:
        name: the chosen strategy's name (a key of the strategies given).
        plan: its plan.
        result: its simulation.
        results: every strategy's simulation, in the order given.
    """

    name: str
    plan: list[list[int]]
    result: SimResult
    results: dict[str, SimResult] = field(default_factory=dict)


def choose_plan(strategies: Mapping[str, Sequence[Sequence[int]]], sizes_bytes: Sequence[int],
                backward_times: Sequence[float], comm_time: Callable[[int], float], *,
                compress_time: Callable[[int], float] | None = None, forward_time: float = 0.0,
                update_time: float = 0.0) -> PlanChoice:
    """Simulate every plan in ``strategies`` and return the fastest.

    Ties go to the strategy listed first, so list the simpler ones first (as
    :func:`candidate_plans` does). Arguments after ``strategies`` are those of
    :func:`~hvd_commopt.fusion.simulator.simulate`.

    Raises:
        ValueError: no strategies, or an invalid plan (named).
    """
    if not strategies:
        raise ValueError("choose_plan needs at least one strategy, e.g. candidate_plans(...)")
    results: dict[str, SimResult] = {}
    for name, plan in strategies.items():
        try:
            results[name] = simulate(plan, sizes_bytes, backward_times, comm_time,
                                     compress_time=compress_time, forward_time=forward_time,
                                     update_time=update_time)
        except ValueError as e:
            raise ValueError(f"strategy {name!r}: {e}") from e
    best = min(results, key=lambda k: results[k].iteration_time)  # min keeps the first of equals
    return PlanChoice(best, [list(g) for g in strategies[best]], results[best], results)


def candidate_plans(sizes_bytes: Sequence[int], backward_times: Sequence[float],
                    cost: AlphaBeta | Callable[[int], float], *, threshold_bytes: int | None = None,
                    select_time: Callable[[int], float] | None = None,
                    resolution_s: float = 0.0) -> dict[str, list[list[int]]]:
    """The standard strategies, simplest first.

    Dense (``select_time is None``): ``per_tensor`` (WFBP), ``single``, ``threshold`` (if
    ``threshold_bytes`` is given), ``mgwfbp`` (if ``cost`` is an :class:`AlphaBeta`: the greedy
    needs α), ``optimal`` (docs/mgwfbp.md#exact-dp).
    Sparse (``select_time`` given; ``cost`` is the sparse exchange time): the same with ``omgs``
    (docs/lags-omgs.md#omgs) instead of ``mgwfbp`` and the Pareto DP (docs/lags-omgs.md#omgs-exact-dp) as ``optimal`` (``resolution_s`` is
    passed to it: see :func:`~hvd_commopt.fusion.exact.plan_optimal`).
    """
    n = len(sizes_bytes)
    out: dict[str, list[list[int]]] = {"per_tensor": plan_per_tensor(n), "single": plan_single(n)}
    if threshold_bytes is not None:
        out["threshold"] = plan_threshold(sizes_bytes, threshold_bytes)
    if select_time is None:
        if isinstance(cost, AlphaBeta):
            out["mgwfbp"] = plan_mgwfbp(sizes_bytes, backward_times, cost)
        out["optimal"] = plan_optimal(sizes_bytes, backward_times, cost)
    else:
        out["omgs"] = plan_omgs(sizes_bytes, backward_times, cost, select_time)
        out["optimal"] = plan_optimal(sizes_bytes, backward_times, cost, compress_time=select_time,
                                      resolution_s=resolution_s)
    return out
