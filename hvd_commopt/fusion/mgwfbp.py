"""MG-WFBP merge decision (Shi, Chu, Li, INFOCOM 2019 / TPDS 2021): the reference greedy.

Exact transcription of ``_generate_groups_mgwfbp`` from ``HKBU-HPML/MG-WFBP``
``distributed_optimizer.py`` as written in docs/mgwfbp.md#greedy, mapped onto this package's conventions
(see :mod:`hvd_commopt.fusion.simulator`):

=====================================  ==============================================
docs/mgwfbp.md#greedy (1-based, forward layers)    here (0-based backward positions)
=====================================  ==============================================
layer ``l``, backward visits L..1      position ``i = L - l``, visited 0..L-1
``p[l]`` elements × ``nbytes``         ``sizes_bytes[i]`` (bytes directly)
``tb[l]``                              ``backward_times[i]``
``taub[l] + tb[l]`` (ready of l)       ``ready[i] = Σ_{q<=i} backward_times[q]``
``taoc[l]`` (allreduce start of l)     ``taoc[i]``
``tc(x) = 0 if x = 0 else α + βx``     ``cost.time(x)`` (:class:`AlphaBeta`, bytes)
loop ``l = L .. 2``, merge l into l-1  loop ``i = 0 .. L-2``, merge i into i+1
=====================================  ==============================================

Decision for tensor ``i`` given ``r = ready[i+1]``: merge iff ``r < taoc[i] + c[i]`` (``i``'s
allreduce would not have finished before ``i+1`` is ready) and either ``taoc[i] > r`` (it could
not even start: merging is free) or ``r - taoc[i] < α`` (the extra wait is shorter than the
startup latency saved). After a merge, ``i``'s bytes move to ``i+1`` and ``taoc`` is recomputed,
so the loop is O(L²) (docs/mgwfbp.md#complexity).

This greedy is **not optimal** under its own model (docs/mgwfbp.md#t-mg-4: strictly worse than brute
force in 557/3000 random instances; the counterexample is in the tests). Use
:func:`hvd_commopt.fusion.exact.plan_optimal` for the optimum of the same model (docs/mgwfbp.md#exact-dp).
"""
from __future__ import annotations

from typing import Sequence

from .cost_model import AlphaBeta
from .simulator import check_profile, ready_times

__all__ = ["plan_mgwfbp", "mgwfbp_with_prediction"]


def _comm_start(ready: Sequence[float], c: Sequence[float]) -> list[float]:
    """``comm_start()`` of docs/mgwfbp.md#greedy-algorithm: ``taoc[0] = ready[0]``; ``taoc[i] = max(taoc[i-1] + c[i-1], ready[i])``."""
    taoc = [ready[0]]
    for i in range(1, len(ready)):
        taoc.append(max(taoc[i - 1] + c[i - 1], ready[i]))
    return taoc


def mgwfbp_with_prediction(sizes_bytes: Sequence[int], backward_times: Sequence[float],
                           cost: AlphaBeta) -> tuple[list[list[int]], float]:
    """:func:`plan_mgwfbp` plus the greedy's own prediction of the non-overlapped communication.

    Returns:
        ``(plan, taoc[L-1] + c[L-1] - ready[L-1])``: the "predicted non-overlapped comm" of docs/mgwfbp.md#greedy-algorithm.
        It equals ``simulate(plan, ...).non_overlapped_comm`` for the same ``cost``.
    """
    check_profile(sizes_bytes, backward_times)
    n = len(sizes_bytes)
    if n == 0:
        return [], 0.0
    p = [int(s) for s in sizes_bytes]           # mutated by merges, as in the reference
    ready = ready_times(backward_times)
    c = [cost.time(x) for x in p]
    taoc = _comm_start(ready, c)
    plan: list[list[int]] = []
    cur: list[int] = []
    for i in range(n - 1):
        cur.append(i)
        r = ready[i + 1]                        # instant when tensor i+1's gradient is ready
        merge = False
        if r < taoc[i] + c[i]:                  # i's allreduce would not finish before i+1 is ready
            if taoc[i] > r:
                merge = True                    # i's allreduce could not even start: merging is free
            elif r - taoc[i] < cost.alpha:
                merge = True                    # extra wait for i < one startup latency saved
        if merge:
            p[i + 1] += p[i]
            p[i] = 0
            c[i] = 0.0
            c[i + 1] = cost.time(p[i + 1])
            taoc = _comm_start(ready, c)
        else:
            plan.append(cur)
            cur = []
    cur.append(n - 1)
    plan.append(cur)
    return plan, taoc[n - 1] + c[n - 1] - ready[n - 1]


def plan_mgwfbp(sizes_bytes: Sequence[int], backward_times: Sequence[float],
                cost: AlphaBeta) -> list[list[int]]:
    """MG-WFBP buckets: the reference greedy of docs/mgwfbp.md#greedy, positions in backward order.

    Args:
        sizes_bytes: bytes per tensor in backward order (position 0 = first gradient ready).
        backward_times: ``tb`` per tensor (docs/mgwfbp.md#inputs) in backward order: seconds from the
            previous gradient-ready event (or backward start) to this tensor's.
        cost: the fitted allreduce model ``t(x) = α + βx`` (docs/cost-models.md#fitted-allreduce-model), e.g.
            ``CostModel.allreduce``. The greedy needs ``α`` by itself, hence an :class:`AlphaBeta`
            rather than any callable.

    Returns:
        Contiguous groups of positions, in communication order.

    Example::

        >>> plan_mgwfbp([4, 4, 4], [1.0, 0.1, 0.1], AlphaBeta(0.5, 0.0))
        [[0, 1, 2]]
    """
    return mgwfbp_with_prediction(sizes_bytes, backward_times, cost)[0]
