"""Ok-Topk's cost and the three sparse allreduces side by side up to P = 1024 (docs/oktopk.md#traffic).

* Top-k allgather, O(kP): :func:`~hvd_commopt.fusion.cost_model.topk_allgather_time`;
* gTop-k, O(k log P): :func:`~hvd_commopt.fusion.cost_model.gtopk_time`;
* Ok-Topk, O(k): :func:`oktopk_time` — P-1 pairwise rounds of about k/P pairs (split and
  reduce), ring allreduces of the magnitude histogram (:func:`hist_bins`) and of 256 sub-bins (the exact global top-k cut;
  the allgather of the few entries in the cut's bin is neglected), and an allgatherv of about
  k/P pairs per rank. Load balancing keeps the parts at k/P (docs/oktopk.md#balance).
"""
from __future__ import annotations

from .cost_model import AlphaBeta, allgather_time, gtopk_time, ring_allreduce_time, topk_allgather_time

__all__ = ["oktopk_time", "oktopk_bytes_per_rank", "compare_sparse", "hist_bins"]


def hist_bins(k: int) -> int:
    """Bins of Ok-Topk's magnitude histogram (int32 counts over the keys' top bits): 1024 (the
    exponent and 2 mantissa bits) below k = 2048, else 4096, so it stays small beside 2k pairs."""
    return 1024 if k < 2048 else 4096


def oktopk_bytes_per_rank(k: int, ranks: int, value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Bytes one rank sends per step, balanced regions: ``2k(P-1)/P`` pairs + the histogram's
    ring allreduces ``2(P-1)/P · 4·(hist_bins(k) + 256)``."""
    p = ranks
    if p == 1 or k == 0:
        return 0.0
    hist_bytes = 4 * (hist_bins(k) + 256)
    return 2 * k * (p - 1) / p * (value_bytes + index_bytes) + 2 * (p - 1) / p * hist_bytes


def oktopk_time(k: int, ranks: int, link: AlphaBeta, value_bytes: int = 4, index_bytes: int = 4) -> float:
    """Seconds of one Ok-Topk allreduce over a link model (see the module docstring)."""
    p = ranks
    if p == 1 or k == 0:
        return 0.0
    part = k / p * (value_bytes + index_bytes)
    return ((p - 1) * link.time(part) + ring_allreduce_time(4 * hist_bins(k), p, link)
            + ring_allreduce_time(4 * 256, p, link)
            + allgather_time(part, p, link))


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
