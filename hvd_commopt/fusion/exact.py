"""Optimal contiguous bucketing under the simulator's model (spec §7.6, §9.4 "exact alternative").

Same model as MG-WFBP's greedy (spec §7.5 timeline, :mod:`hvd_commopt.fusion.simulator`), solved
exactly. Number the tensors by backward position; a bucket is a run ``i..j``.

**Dense (no compression), §7.6.** A bucket's comm end ``max(E_prev, ready(j)) + tc(S(i..j))`` is
non-decreasing in ``E_prev``, so the best end time of a prefix has optimal substructure::

    E[0] = 0
    E[j] = min_{1<=i<=j} max(E[i-1], ready(j)) + tc(Σ_{q=i..j} size(q))

O(L²) time with prefix sums of the sizes. Because IEEE rounding is monotone too and the DP
performs exactly the simulator's operations (``ready`` from :func:`ready_times`, integer byte
sums), its optimum equals the brute-force minimum of :func:`simulate` *bit for bit*.

**With compression on the compute stream, §9.4.** After a prefix the state is the pair
``(g, n)`` = (compute-stream end, network end); both only delay later buckets, so keeping the
Pareto front of pairs per prefix is exact::

    front[j] = Pareto-min over i <= j, (g, n) in front[i-1] of
               (g + B(i..j) + ts(S(i..j)),  max(n, g + B(i..j) + ts(S(i..j))) + tcs(S(i..j)))

``B(i..j)`` is taken from prefix sums, so this variant agrees with the simulator up to
floating-point reassociation (~1e-15 relative), not bit for bit.

Ties go to the largest last bucket (the smallest ``i``), i.e. fewer messages.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from .simulator import check_profile, ready_times, simulate

__all__ = ["plan_optimal", "optimal_with_time", "brute_force_plan"]

CommTime = Callable[[int], float]


def _prefix(sizes_bytes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes_bytes:
        out.append(out[-1] + int(s))
    return out


def _dense_dp(sizes_bytes: Sequence[int], backward_times: Sequence[float],
              comm_time: CommTime) -> tuple[list[list[int]], float]:
    n = len(sizes_bytes)
    ready = ready_times(backward_times)
    pre = _prefix(sizes_bytes)
    best = [0.0] + [float("inf")] * n        # best[j] = E[j], prefix of length j
    arg = [0] * (n + 1)                      # first position (0-based) of the last bucket
    for j in range(1, n + 1):
        r = ready[j - 1]
        for i in range(1, j + 1):            # bucket = positions i-1 .. j-1
            e = max(best[i - 1], r) + comm_time(pre[j] - pre[i - 1])
            if e < best[j]:
                best[j], arg[j] = e, i - 1
    return _unwind(arg, n), best[n]


def _unwind(arg: Sequence[int], n: int) -> list[list[int]]:
    plan: list[list[int]] = []
    j = n
    while j > 0:
        i = arg[j]
        plan.append(list(range(i, j)))
        j = i
    plan.reverse()
    return plan


def _pareto_dp(sizes_bytes: Sequence[int], backward_times: Sequence[float], comm_time: CommTime,
               compress_time: CommTime) -> tuple[list[list[int]], float]:
    n = len(sizes_bytes)
    pre = _prefix(sizes_bytes)
    bpre = [0.0]
    for t in backward_times:
        bpre.append(bpre[-1] + float(t))
    # front[j]: list of (g, net, i, k): last bucket starts at position i, parent = front[i][k].
    front: list[list[tuple[float, float, int, int]]] = [[(0.0, 0.0, -1, -1)]]
    for j in range(1, n + 1):
        cands: list[tuple[float, float, int, int]] = []
        for i in range(1, j + 1):
            nbytes = pre[j] - pre[i - 1]
            ts, tcs = float(compress_time(nbytes)), float(comm_time(nbytes))
            bsum = bpre[j] - bpre[i - 1]
            for k, (g, net, _, _) in enumerate(front[i - 1]):
                g2 = g + bsum + ts
                cands.append((g2, max(net, g2) + tcs, i - 1, k))
        cands.sort(key=lambda c: (c[0], c[1], c[2]))
        kept: list[tuple[float, float, int, int]] = []
        for c in cands:                      # keep strictly improving network ends
            if not kept or c[1] < kept[-1][1]:
                kept.append(c)
        front.append(kept)
    # best final state: min network end; ties -> smallest first position of the last bucket
    k = min(range(len(front[n])), key=lambda q: (front[n][q][1], front[n][q][2]))
    end = front[n][k][1]
    plan: list[list[int]] = []
    j = n
    while j > 0:
        _, _, i, parent = front[j][k]
        plan.append(list(range(i, j)))
        j, k = i, parent
    plan.reverse()
    return plan, end


def optimal_with_time(sizes_bytes: Sequence[int], backward_times: Sequence[float],
                      cost: CommTime, *, compress_time: CommTime | None = None
                      ) -> tuple[list[list[int]], float]:
    """:func:`plan_optimal` and the optimum's end of the last communication (seconds after backward
    starts; add forward and update time for an iteration)."""
    check_profile(sizes_bytes, backward_times)
    if len(sizes_bytes) == 0:
        return [], 0.0
    if compress_time is None:
        return _dense_dp(sizes_bytes, backward_times, cost)
    return _pareto_dp(sizes_bytes, backward_times, cost, compress_time)


def plan_optimal(sizes_bytes: Sequence[int], backward_times: Sequence[float], cost: CommTime, *,
                 compress_time: CommTime | None = None) -> list[list[int]]:
    """Contiguous bucketing (backward order) minimising the simulated iteration time.

    Args:
        sizes_bytes: bytes per tensor in backward order.
        backward_times: the spec's ``tb`` per tensor in backward order (seconds since the previous
            gradient became ready; see :mod:`hvd_commopt.fusion.simulator`).
        cost: bucket bytes -> communication seconds; an :class:`AlphaBeta` (MG-WFBP's model) or
            any ``CostModel.comm_time_fn(...)``. Must be >= 0; it need not be linear.
        compress_time: per-bucket compression seconds on the compute stream (e.g. top-k
            selection, §9.2). ``None``: dense, solved by the §7.6 DP; otherwise the §9.4 Pareto DP.

    Returns:
        The optimal plan. The dense DP is O(L²) cost evaluations; the Pareto DP is O(L² · F) for
        front size F (small in practice, at most L).
    """
    return optimal_with_time(sizes_bytes, backward_times, cost, compress_time=compress_time)[0]


def brute_force_plan(sizes_bytes: Sequence[int], backward_times: Sequence[float], cost: CommTime,
                     *, compress_time: CommTime | None = None, max_tensors: int = 16
                     ) -> tuple[list[list[int]], float]:
    """Try all ``2^(L-1)`` contiguous bucketings with :func:`simulate` (test oracle, spec §7.5 T-MG-4).

    Returns:
        ``(plan, iteration_time)`` of the first best plan in enumeration order (forward and
        update time 0, so the time is the last communication's end).

    Raises:
        ValueError: more than ``max_tensors`` tensors (the enumeration is exponential).
    """
    check_profile(sizes_bytes, backward_times)
    n = len(sizes_bytes)
    if n > max_tensors:
        raise ValueError(f"brute force over {n} tensors means 2^{n - 1} plans; use plan_optimal, "
                         f"or raise max_tensors (now {max_tensors}) if you really mean it")
    if n == 0:
        return [], 0.0
    best_plan: list[list[int]] = []
    best = float("inf")
    for cuts in itertools.product((False, True), repeat=n - 1):
        plan, cur = [], [0]
        for pos, cut in enumerate(cuts, start=1):
            if cut:
                plan.append(cur)
                cur = []
            cur.append(pos)
        plan.append(cur)
        t = simulate(plan, sizes_bytes, backward_times, cost, compress_time=compress_time).iteration_time
        if t < best:
            best, best_plan = t, plan
    return best_plan, best
