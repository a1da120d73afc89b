"""What one bucket costs under a given reducer: the cost functions the planners and simulator take.

The planners are pure functions of sizes, times and a cost (bucket bytes -> seconds). At run time
the cost follows the reducer the engine uses (docs/cost-models.md#closed-form-costs, docs/lags-omgs.md#omgs): each reducer prices itself
(``Reducer.price``) with the helpers here, so this package knows no reducer:

=============================================  ==============================================
reducer (``DistributedOptimizer(compression=)``) bucket cost
=============================================  ==============================================
dense allreduce, ``Compression.none``           ``CostModel.allreduce``: ``α + β·n``
dense allreduce, ``fp16`` / ``bf16``            ``α + β·n/2`` (half the bytes on the wire)
``Compression.topk`` / ``dgc`` (allgather)      one allgather of k values and k indices packed,
                                                ``CostModel.comm_time_fn("topk", ρ)``, plus
                                                top-k selection on the compute stream (OMGS)
``Compression.randomk`` (same indices)          allreduce of the k values: ``α + β·4k``
``Compression.gtopk``                           ``CostModel.comm_time_fn("gtopk", ρ)`` (p2p fit)
                                                plus selection on the compute stream
=============================================  ==============================================

The selection cost is OMGS's model ``ts(x) = s·x·log2 x`` for x elements (docs/lags-omgs.md#omgs). Its
reference ``s`` was measured on a P102-100 GPU; :func:`fit_select_s` measures it with the
selection the reducer runs, on the engine's own tensor ops (least squares through the origin).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError
from .cost_model import AlphaBeta, CostModel, sparse_k
from .omgs import topk_select_time

__all__ = ["Pricing", "dense_pricing", "sparse_pricing", "fit_select_s", "fit_select_cost", "PER_LAYER_DENSITY"]

PER_LAYER_DENSITY = ("planned fusion (fusion='mgwfbp'/'optimal'/'auto') prices each bucket with one density; "
                     "per-layer densities (a dict or callable) need fusion='threshold' or fusion='none' "
                     "(one bucket per layer, LAGS-SGD)")


@dataclass(frozen=True)
class Pricing:
    """Cost functions for one reducer.

    Attributes:
        comm_time: bucket bytes -> seconds on the network (``simulate``'s ``comm_time``).
        select_time: bucket bytes -> seconds of compression on the compute stream, or None for
            dense communication (``simulate``'s ``compress_time``).
        alpha_beta: a linear model of ``comm_time`` for MG-WFBP's greedy (which needs α);
            exact for dense reducers, an approximation for random-k.
        exact_linear: True when ``comm_time`` is ``alpha_beta`` itself.
        description: one line for the report.
    """

    comm_time: Callable[[int], float]
    select_time: Callable[[int], float] | None
    alpha_beta: AlphaBeta | None
    exact_linear: bool
    description: str


def dense_pricing(cost: CostModel, bytes_ratio: float, what: str) -> Pricing:
    """A dense allreduce sending ``bytes_ratio`` of the bucket's bytes (0.5 for fp16/bf16)."""
    ar = cost.allreduce
    ab = ar if bytes_ratio == 1.0 else AlphaBeta(ar.alpha, ar.beta * bytes_ratio)
    return Pricing(ab, None, ab, True, f"{what}: alpha={ab.alpha:.3g} s, beta={ab.beta:.3g} s/B")


def sparse_pricing(cost: CostModel, kind: str, density: float | None, select_s: float | None = None,
                   select_c0: float = 0.0) -> Pricing:
    """A sparse bucket: ``kind`` "topk" (allgather of values and indices), "randomk" (allreduce
    of the k values, same indices everywhere) or "gtopk" (point-to-point rounds).

    Raises:
        ConfigError: per-layer densities (``density`` None: a merged bucket has no single
            density to price it with), or gTop-k without a point-to-point fit.
    """
    if density is None:
        raise ConfigError(PER_LAYER_DENSITY)
    ar = cost.allreduce
    ts = topk_select_time() if select_s is None else topk_select_time(select_s, c0=select_c0)
    s_text = f"select s={select_s if select_s is not None else 'P102 reference'}"
    if select_s is not None and select_c0:
        s_text += f" + {select_c0:.3g} s per selection"
    if kind == "randomk":
        ab = AlphaBeta(ar.alpha, ar.beta * density)
        return Pricing(lambda nb: ar.time(4 * sparse_k(nb, density)), None, ab, False,
                       f"random-k allreduce of k values, density {density}")
    if kind == "gtopk" and cost.p2p is None and cost.ranks > 1:
        raise ConfigError("gTop-k buckets are priced with the point-to-point fit: calibrate with p2p "
                          "(the default) or give a cost model with a 'p2p' entry")
    return Pricing(cost.comm_time_fn(kind, density=density), ts, None, False,
                   f"{ {'gtopk': 'gTop-k', 'oktopk': 'Ok-Topk'}.get(kind, 'top-k allgather')}, density {density}, "
                   f"{s_text}")


def _timed_selections(ops: Any, like: Any, density: float, max_numel: int, clock: Callable[[], float],
                      repeats: int, select: Callable[[Any, int], Any] | None) -> tuple[np.ndarray, np.ndarray]:
    """``(x·log2 x, fastest seconds)`` per size x in 2^12, 2^15, 2^18, 2^20 elements, capped at
    ``max_numel`` (at least one size): ``select(buf, k)`` (returning the values; default
    ``ops.topk_abs``) timed ``repeats`` times, its result read back to the host so asynchronous
    devices are timed to completion."""
    if select is None:
        select = lambda buf, k: ops.topk_abs(buf, k)[0]  # noqa: E731
    rng = np.random.default_rng(0)
    cap = max(int(max_numel), 1 << 12)
    fs, ts = [], []
    for n in (n for n in (1 << 12, 1 << 15, 1 << 18, 1 << 20) if n <= cap):
        buf = ops.from_numpy(rng.standard_normal(n).astype(np.float32), like)
        k = max(int(n * density), 1)
        best = math.inf
        for _ in range(repeats):
            t0 = clock()
            ops.to_numpy(select(buf, k))
            best = min(best, clock() - t0)
        fs.append(n * math.log2(n))
        ts.append(best)
    return np.asarray(fs, dtype=np.float64), np.asarray(ts, dtype=np.float64)


def fit_select_s(ops: Any, like: Any, density: float, max_numel: int,
                 clock: Callable[[], float] = time.perf_counter, repeats: int = 3,
                 select: Callable[[Any, int], Any] | None = None) -> float:
    """Fit OMGS's ``s`` in ``ts(x) = s·x·log2 x`` (least squares through the origin) by timing a
    top-k selection on this rank: ``select(buf, k)``, the selection the reducer runs; default
    ``ops.topk_abs``, the reference sort, 10-40x slower on a CPU than the package's exact
    selection, which made merged buckets look far too expensive (docs/lags-omgs.md#omgs-fit)."""
    return _through_origin(*_timed_selections(ops, like, density, max_numel, clock, repeats, select))


def _through_origin(f: np.ndarray, t: np.ndarray) -> float:
    """Least-squares ``s`` of ``t ≈ s·f``, at least 0."""
    den = float(f @ f)
    return max(0.0, float(f @ t) / den) if den else 0.0


def fit_select_cost(ops: Any, like: Any, density: float, max_numel: int,
                    clock: Callable[[], float] = time.perf_counter, repeats: int = 3,
                    select: Callable[[Any, int], Any] | None = None) -> tuple[float, float]:
    """``(s, c0)`` of ``ts(x) = c0 + s·x·log2 x``, timed as :func:`fit_select_s` does, fitted on
    relative error (weights 1/t²) so that the small sizes, which set ``c0``, count as much as the
    large ones. A CPU selection has a fixed cost per call (a chain of framework calls, about
    0.05-0.25 ms here) that the paper's GPU model omits; without it one bucket per layer looks
    as cheap to select as one merged bucket (docs/lags-omgs.md#omgs-fit). Falls back to the fit
    through the origin (``c0 = 0``) when the two-parameter fit is not non-negative."""
    f, t = _timed_selections(ops, like, density, max_numel, clock, repeats, select)
    if f.size >= 2 and np.all(t > 0):
        w = 1.0 / t ** 2
        a = np.array([[w.sum(), (w * f).sum()], [(w * f).sum(), (w * f * f).sum()]])
        b = np.array([(w * t).sum(), (w * f * t).sum()])
        try:
            c0, s = np.linalg.solve(a, b)
        except np.linalg.LinAlgError:
            c0, s = -1.0, -1.0
        if c0 >= 0 and s >= 0:
            return float(s), float(c0)
    return _through_origin(f, t), 0.0
