"""Ok-Topk's cost and the three sparse allreduces side by side up to P = 1024 (docs/oktopk.md#traffic).

* Top-k allgather, O(kP): :func:`~hvd_commopt.fusion.cost_model.topk_allgather_time`;
* gTop-k, O(k log P): :func:`~hvd_commopt.fusion.cost_model.gtopk_time`;
* Ok-Topk, O(k): :func:`~hvd_commopt.fusion.cost_model.oktopk_time` (beside the other two, so
  the cost model prices it without importing this module) — P-1 pairwise rounds of about k/P pairs (split and
  reduce), ring allreduces of the magnitude histogram (:func:`hist_bins`) and of 256 sub-bins (the exact global top-k cut;
  the allgather of the few entries in the cut's bin is neglected), and an allgatherv of about
  k/P pairs per rank. Load balancing keeps the parts at k/P (docs/oktopk.md#balance).
"""
from __future__ import annotations

from .cost_model import AlphaBeta, gtopk_time, hist_bins, oktopk_time, topk_allgather_time

__all__ = ["oktopk_time", "oktopk_bytes_per_rank", "compare_sparse", "hist_bins"]


def oktopk_bytes_per_rank(k: int, ranks: int, value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Bytes one rank sends per step, balanced regions: ``2k(P-1)/P`` pairs + the histogram's
    ring allreduces ``2(P-1)/P · 4·(hist_bins(k) + 256)``."""
    p = ranks
    if p == 1 or k == 0:
        return 0.0
    hist_bytes = 4 * (hist_bins(k) + 256)
    return 2 * k * (p - 1) / p * (value_bytes + index_bytes) + 2 * (p - 1) / p * hist_bytes


def compare_sparse(k: int, ranks: list[int], link: AlphaBeta, value_bytes: int = 4,
                   index_bytes: int = 4) -> list[dict]:
    """Per P: the three sparse allreduces' times (s) for k entries per rank."""
    out = []
    for p in ranks:
        out.append({"ranks": p,
                    "topk_allgather": topk_allgather_time(k, p, link, value_bytes, index_bytes, fused=True),
                    "gtopk": gtopk_time(k, p, link, value_bytes, index_bytes),
                    "oktopk": oktopk_time(k, p, link, value_bytes, index_bytes)})
    return out
