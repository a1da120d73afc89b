"""Optimal contiguous bucketing under the simulator's model (docs/mgwfbp.md#exact-dp, docs/lags-omgs.md#omgs-exact-dp).

Same model as MG-WFBP's greedy (docs/mgwfbp.md#timeline-model, :mod:`hvd_commopt.fusion.simulator`), solved
exactly. Number the tensors by backward position; a bucket is a run ``i..j``.

**Dense (no compression), docs/mgwfbp.md#exact-dp.** A bucket's comm end ``max(E_prev, ready(j)) + tc(S(i..j))`` is
non-decreasing in ``E_prev``, so the best end time of a prefix has optimal substructure::

    E[0] = 0
    E[j] = min_{1<=i<=j} max(E[i-1], ready(j)) + tc(Σ_{q=i..j} size(q))

O(L²) time with prefix sums of the sizes. Because IEEE rounding is monotone too and the DP
performs exactly the simulator's operations (``ready`` from :func:`ready_times`, integer byte
sums), its optimum equals the brute-force minimum of :func:`simulate` *bit for bit*.

**With compression on the compute stream, docs/lags-omgs.md#omgs-exact-dp.** After a prefix the state is the pair
``(g, n)`` = (compute-stream end, network end); both only delay later buckets, so keeping the
Pareto front of pairs per prefix is exact::

    front[j] = Pareto-min over i <= j, (g, n) in front[i-1] of
               (g + B(i..j) + ts(S(i..j)),  max(n, g + B(i..j) + ts(S(i..j))) + tcs(S(i..j)))

``B(i..j)`` is taken from prefix sums, so this variant agrees with the simulator up to
floating-point reassociation (~1e-15 relative), not bit for bit. States that cannot beat a known
plan (a lower bound from the remaining backward and the cheapest possible last bucket) are
pruned; ``resolution_s`` optionally trades a bounded loss for speed on large models.

Ties go to the largest last bucket (the smallest ``i``), i.e. fewer messages.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np

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


def _pareto_pass(sizes_bytes: Sequence[int], backward_times: Sequence[float], comm_time: CommTime,
                 compress_time: CommTime, ub: float, eps: float) -> tuple[list[list[int]], float]:
    """One Pareto DP pass, vectorised over each front with NumPy.

    States whose lower bound on the final time exceeds ``ub`` are dropped: ``net`` plus the
    cheapest possible last message, or ``g`` plus the remaining backward plus the cheapest possible
    last compression and message. With ``eps > 0`` a state is also dropped when a kept state has
    a smaller ``g`` and a network end at most ``eps`` later; since the final time is 1-Lipschitz in
    both coordinates, each such drop costs at most ``eps``, so the result is within
    ``(number of buckets) * eps`` of the optimum.
    """
    n = len(sizes_bytes)
    pre = _prefix(sizes_bytes)
    bpre = [0.0]
    for t in backward_times:
        bpre.append(bpre[-1] + float(t))
    # Lower bound on what any completion of prefix j adds: its last bucket i..n-1 is still to be
    # compressed and sent (valid for any non-negative cost functions).
    min_c, min_sc = [0.0] * (n + 1), [0.0] * (n + 1)
    if n:
        last = [(float(compress_time(pre[n] - pre[i])), float(comm_time(pre[n] - pre[i]))) for i in range(n)]
        for j in range(n - 1, -1, -1):
            tsl, tcl = last[j]
            min_c[j] = tcl if j == n - 1 else min(min_c[j + 1], tcl)
            min_sc[j] = tsl + tcl if j == n - 1 else min(min_sc[j + 1], tsl + tcl)
        min_c[n] = min_sc[n] = 0.0
    # front[j] = (g, net, i, k) arrays, sorted by g ascending and net strictly descending: the
    # last bucket starts at position i and its parent state is front[i][k].
    empty_i = np.zeros(0, dtype=np.int64)
    front: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = [
        (np.zeros(1), np.zeros(1), np.full(1, -1), np.full(1, -1))]
    for j in range(1, n + 1):
        rest = bpre[n] - bpre[j]
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for i in range(1, j + 1):
            nbytes = pre[j] - pre[i - 1]
            ts, tcs = float(compress_time(nbytes)), float(comm_time(nbytes))
            g, net = front[i - 1][0], front[i - 1][1]
            g2 = g + (bpre[j] - bpre[i - 1]) + ts
            n2 = np.maximum(net, g2) + tcs
            # once net <= g2, later states (larger g) all have net <= g2: dominated by that one
            idle = np.flatnonzero(net <= g2)
            m = int(idle[0]) + 1 if idle.size else g.size
            ok = np.flatnonzero(np.maximum(n2[:m] + min_c[j], g2[:m] + (rest + min_sc[j])) <= ub)
            if ok.size:
                parts.append((g2[ok], n2[ok], np.full(ok.size, i - 1), ok))
        if not parts:  # no good plan has a bucket boundary after position j-1
            front.append((np.zeros(0), np.zeros(0), empty_i, empty_i))
            continue
        cg, cn, ci, ck = (np.concatenate([p[q] for p in parts]) for q in range(4))
        order = np.lexsort((ci, cn, cg))
        cg, cn, ci, ck = cg[order], cn[order], ci[order], ck[order]
        prev_min = np.minimum.accumulate(np.concatenate(([np.inf], cn[:-1])))
        keep = np.flatnonzero(cn < prev_min)          # exact Pareto front
        if eps > 0:
            thin, prev_n = [], float("inf")
            for q in keep.tolist():
                if cn[q] < prev_n - eps:
                    thin.append(q)
                    prev_n = float(cn[q])
            keep = np.asarray(thin, dtype=np.int64) if thin else empty_i
        front.append((cg[keep], cn[keep], ci[keep], ck[keep]))
    # best final state: min network end; ties -> smallest first position of the last bucket
    _, fn, fi, _ = front[n]
    if fn.size == 0:  # ub was below the optimum: a caller's bug, never the user's
        raise RuntimeError("internal: the Pareto DP pruned every plan; please report this instance")
    k = int(np.lexsort((fi, fn))[0])
    end = float(fn[k])
    plan: list[list[int]] = []
    j = n
    while j > 0:
        i, parent = int(front[j][2][k]), int(front[j][3][k])
        plan.append(list(range(i, j)))
        j, k = i, parent
    plan.reverse()
    return plan, end


def _pareto_dp(sizes_bytes: Sequence[int], backward_times: Sequence[float], comm_time: CommTime,
               compress_time: CommTime, resolution_s: float) -> tuple[list[list[int]], float]:
    n = len(sizes_bytes)

    def sim(plan: list[list[int]]) -> float:
        return simulate(plan, sizes_bytes, backward_times, comm_time, compress_time=compress_time).iteration_time

    # Seed the bound with the trivial plans, tighten it with a coarse pass, then solve exactly.
    # The 1e-9 margin covers reassociation differences between the DP's sums and the simulator's;
    # the optimum's lower bound never exceeds its own time, so it is never pruned.
    ub = min(sim([[i] for i in range(n)]), sim([list(range(n))]))
    coarse, _ = _pareto_pass(sizes_bytes, backward_times, comm_time, compress_time, ub * (1 + 1e-9), 1e-4 * ub)
    ub = min(ub, sim(coarse))
    return _pareto_pass(sizes_bytes, backward_times, comm_time, compress_time, ub * (1 + 1e-9), resolution_s)


def _check_resolution(resolution_s: float) -> None:
    if not (resolution_s >= 0 and resolution_s != float("inf")):
        raise ValueError(f"resolution_s must be a finite number of seconds >= 0, got {resolution_s!r} "
                         f"(0 = exact)")


def optimal_with_time(sizes_bytes: Sequence[int], backward_times: Sequence[float],
                      cost: CommTime, *, compress_time: CommTime | None = None,
                      resolution_s: float = 0.0) -> tuple[list[list[int]], float]:
    """:func:`plan_optimal` and the optimum's end of the last communication (seconds after backward
    starts; add forward and update time for an iteration)."""
    check_profile(sizes_bytes, backward_times)
    _check_resolution(resolution_s)
    if len(sizes_bytes) == 0:
        return [], 0.0
    if compress_time is None:
        return _dense_dp(sizes_bytes, backward_times, cost)
    return _pareto_dp(sizes_bytes, backward_times, cost, compress_time, resolution_s)


def plan_optimal(sizes_bytes: Sequence[int], backward_times: Sequence[float], cost: CommTime, *,
                 compress_time: CommTime | None = None, resolution_s: float = 0.0) -> list[list[int]]:
    """Contiguous bucketing (backward order) minimising the simulated iteration time.

    Args:
        sizes_bytes: bytes per tensor in backward order.
        backward_times: ``tb`` per tensor (docs/mgwfbp.md#inputs) in backward order (seconds since the previous
            gradient became ready; see :mod:`hvd_commopt.fusion.simulator`).
        cost: bucket bytes -> communication seconds; an :class:`AlphaBeta` (MG-WFBP's model) or
            any ``CostModel.comm_time_fn(...)``. Must be >= 0; it need not be linear.
        compress_time: per-bucket compression seconds on the compute stream (e.g. top-k
            selection, docs/lags-omgs.md#omgs). ``None``: dense, solved by the docs/mgwfbp.md#exact-dp; otherwise the docs/lags-omgs.md#omgs-exact-dp.
        resolution_s: Pareto DP only. 0 solves exactly; ``r > 0`` merges states whose network
            ends differ by less than ``r``, which bounds the loss by ``r`` per bucket and is much
            faster on large models (1e-6 s is far below any measured cost).

    Returns:
        The optimal plan. The dense DP is O(L²) cost evaluations and takes milliseconds for
        hundreds of tensors. The Pareto DP is O(L² · F) for front size F; fronts can reach the
        hundreds when compression and communication costs are comparable, so an exact solve of
        ~200 tensors can take seconds (it is pruned by a bound from a coarse first pass and
        vectorised with NumPy). Pass ``resolution_s`` for large models.
    """
    return optimal_with_time(sizes_bytes, backward_times, cost, compress_time=compress_time,
                             resolution_s=resolution_s)[0]


def brute_force_plan(sizes_bytes: Sequence[int], backward_times: Sequence[float], cost: CommTime,
                     *, compress_time: CommTime | None = None, max_tensors: int = 16
                     ) -> tuple[list[list[int]], float]:
    """Try all ``2^(L-1)`` contiguous bucketings with :func:`simulate` (test oracle, docs/mgwfbp.md#t-mg-4).

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
