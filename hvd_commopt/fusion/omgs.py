"""OMGS-SGD merge decision for sparse buckets (Shi et al., INFOCOM 2020; docs/lags-omgs.md#omgs).

Transcription of ``_generate_groups_mgs`` (``HKBU-HPML/OMGS-SGD`` ``hv_distributed_optimizer.py``)
as written in docs/lags-omgs.md#omgs, mapped to backward positions ``i = L - l`` like
:mod:`hvd_commopt.fusion.mgwfbp`. The compute stream runs backward and then, once a bucket is
complete, its top-k selection ``ts``; the network runs the sparse exchange ``tcs`` concurrently::

    taub[i] = backward start, taus[i] = taub[i] + tb[i] (backward end), top-k of i ends at taus[i] + ts(p[i])
    taoc[0] = taus[0] + ts(p[0]);  taoc[i] = max(taoc[i-1] + tcs(p[i-1]), taus[i] + ts(p[i]))
    t_w    = tb[i+1] + ts(p[i]+p[i+1]) - ts(p[i]) - ts(p[i+1]) - (taoc[i] - (taus[i] + ts(p[i])))
    t_save = tcs(p[i]) + tcs(p[i+1]) - tcs(p[i]+p[i+1])
    merge i into i+1 iff t_w < t_save; then tb[i+1] += tb[i], tb[i] = 0, p[i+1] += p[i], p[i] = 0,
    and the timeline of positions > i is re-run from taub[i] + tb[i].

Deviations (docs/lags-omgs.md#our-implementation):

* **No L/L−1 quirk** (docs/lags-omgs.md#omgs-quirk): the reference pre-places layer L in the first bucket
  and starts deciding at L−1, so the first two tensors in backward order always share a bucket
  without any timing update. We start at position 0, as MG-WFBP does. ``reference_quirk=True``
  restores the reference behaviour (for comparisons only).
* ``tcs(0) = 0``: a tensor merged away sends nothing. (The reference formula ``2(a + b·ρx·P·4)``
  would charge ``2a`` for an empty message; the reference's ``comm()`` evaluates it on zeroed
  sizes, which we do not reproduce.)

Use :func:`hvd_commopt.fusion.exact.plan_optimal` with ``compress_time=`` for the exact optimum
of the same timeline (docs/lags-omgs.md#omgs-exact-dp).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from .simulator import check_profile

__all__ = ["plan_omgs", "omgs_with_prediction", "topk_select_time", "OMGS_TOPK_S"]

# ``ts(x) = s · x · log2 x`` seconds for x elements, measured on a P102-100 GPU (docs/lags-omgs.md#omgs).
OMGS_TOPK_S = 2.18896957e-10


def topk_select_time(s: float = OMGS_TOPK_S, elem_bytes: int = 4, c0: float = 0.0) -> Callable[[int], float]:
    """The OMGS top-k selection model ``ts(x) = s·x·log2 x`` for x = bytes / elem_bytes elements,
    plus ``c0`` per selection (0 in the paper; the fixed cost of one call on a CPU,
    docs/lags-omgs.md#omgs-fit).

    Returns a function of bucket bytes, 0 for buckets of at most one element. Re-fit ``s`` for
    your GPU; the default is the reference's.
    """
    if not (s >= 0 and math.isfinite(s)):
        raise ValueError(f"selection cost s must be finite and >= 0, got {s!r}")
    if not (c0 >= 0 and math.isfinite(c0)):
        raise ValueError(f"selection cost c0 must be finite and >= 0, got {c0!r}")
    if elem_bytes <= 0:
        raise ValueError(f"elem_bytes must be > 0, got {elem_bytes}")

    def ts(nbytes: int) -> float:
        x = nbytes / elem_bytes
        return 0.0 if x <= 1 else c0 + s * x * math.log2(x)

    return ts


def omgs_with_prediction(sizes_bytes: Sequence[int], backward_times: Sequence[float],
                         comm_time: Callable[[int], float], select_time: Callable[[int], float], *,
                         reference_quirk: bool = False) -> tuple[list[list[int]], float]:
    """:func:`plan_omgs` plus the greedy's predicted end of the last communication
    (``taoc[L-1] + tcs(p[L-1])``, seconds after backward starts)."""
    check_profile(sizes_bytes, backward_times)
    n = len(sizes_bytes)
    if n == 0:
        return [], 0.0
    p = [int(x) for x in sizes_bytes]
    tb = [float(x) for x in backward_times]
    ts, tcs = select_time, comm_time
    taub = [0.0] * n
    taus = [0.0] * n

    def timeline(start: float, first: int) -> None:
        taub[first] = start
        taus[first] = taub[first] + tb[first]
        for i in range(first + 1, n):
            taub[i] = taus[i - 1] + ts(p[i - 1])
            taus[i] = taub[i] + tb[i]

    def comm() -> list[float]:
        taoc = [taus[0] + ts(p[0])]
        for i in range(1, n):
            taoc.append(max(taoc[i - 1] + tcs(p[i - 1]), taus[i] + ts(p[i])))
        return taoc

    timeline(0.0, 0)
    taoc = comm()
    plan: list[list[int]] = []
    cur: list[int] = [0] if (reference_quirk and n > 1) else []
    for i in range(1 if cur else 0, n - 1):
        cur.append(i)
        queued = taoc[i] - (taus[i] + ts(p[i]))          # time i would wait for the network anyway
        t_w = tb[i + 1] + ts(p[i] + p[i + 1]) - ts(p[i]) - ts(p[i + 1]) - queued
        t_save = tcs(p[i]) + tcs(p[i + 1]) - tcs(p[i] + p[i + 1])
        if t_w < t_save:
            tb[i + 1] += tb[i]
            tb[i] = 0.0
            p[i + 1] += p[i]
            p[i] = 0
            timeline(taub[i] + tb[i], i + 1)
            taoc = comm()
        else:
            plan.append(cur)
            cur = []
    cur.append(n - 1)
    plan.append(cur)
    return plan, taoc[n - 1] + tcs(p[n - 1])


def plan_omgs(sizes_bytes: Sequence[int], backward_times: Sequence[float],
              comm_time: Callable[[int], float], select_time: Callable[[int], float], *,
              reference_quirk: bool = False) -> list[list[int]]:
    """OMGS buckets for sparse communication (docs/lags-omgs.md#omgs-greedy), positions in backward order.

    Args:
        sizes_bytes: dense bytes per tensor, backward order.
        backward_times: ``tb`` per tensor, backward order (see
            :mod:`hvd_commopt.fusion.simulator`).
        comm_time: sparse exchange time of a bucket of the given dense bytes, ``tcs`` of docs/lags-omgs.md#omgs-inputs,
            e.g. ``CostModel.comm_time_fn("topk", density=0.001)``. Must give 0 for 0 bytes.
        select_time: top-k selection time of a bucket, ``ts`` of docs/lags-omgs.md#omgs-inputs, e.g.
            :func:`topk_select_time`.
        reference_quirk: reproduce the reference's unconditional merge of the first two tensors.

    Returns:
        Contiguous groups of positions, in communication order.
    """
    return omgs_with_prediction(sizes_bytes, backward_times, comm_time, select_time,
                                reference_quirk=reference_quirk)[0]
