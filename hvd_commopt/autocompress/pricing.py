"""Per-bucket costs of each candidate method: the calibrated link and the fitted selection cost.

Pure functions of a :class:`~hvd_commopt.fusion.cost_model.CostModel` (hvd_commopt.calibrate),
the measured selection/cast cost per kind (``(s, c0)`` of ``c0 + s·x·log2 x`` for x elements,
:func:`hvd_commopt.fusion.pricing.fit_select_cost`, timed on rank 0 with the adapter's tensor
ops) and the bucket's timeline (docs/auto-compression.md#model). The communication times are the
fusion planners' own (:mod:`hvd_commopt.fusion.pricing`): allreduce ``α + β·n`` for dense, of n/2
bytes for the 16-bit casts, the point-to-point rounds of gTop-k and Ok-Topk, an allreduce of the k
values for random-k. Top-k and DGC are priced as :class:`~hvd_commopt.reduce.sparse_allgather.SparseAllgather`
sends them (:func:`allgather_sparse_time`): ONE allgather of the k values and k int32 indices packed
as one message (docs/topk.md#one-message), after a size round only where the count varies by rank
(DGC's sampled threshold; the exact top-k skips it, docs/topk.md#equal-sizes). The fusion planners'
``CostModel.topk_time`` priced two allgathers until 2026-11-27, so every sparse bucket carried a
second ``α`` (docs/auto-compression.md#sparse-wire); it now prices the one packed message, and
this module calls it, adding DGC's size round.
The quantisers are priced as :class:`~hvd_commopt.reduce.quantized.QuantizedAllreduce` sends them
(:func:`quantised_time`): an all-to-all of the P quantised parts of the bucket, then an allgather of
each owner's re-quantised part, each part ``bits/8`` bytes an element plus one float32 scale per
block (docs/auto-compression.md#quantised).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ..errors import ConfigError
from ..fusion.cost_model import CostModel
from ..fusion.omgs import topk_select_time
from ..compress.quantize import DEFAULT_BLOCK, encoded_bytes
from ..fusion.pricing import dense_pricing, sparse_pricing
from .choose import BucketCosts
from .methods import MIN_K
from .options import Method

__all__ = ["SelectFit", "method_costs", "bucket_costs", "fit_kind", "compress_time", "allgather_sparse_time",
           "quantised_time", "INDEX_BYTES", "COUNT_BYTES"]

#: ``(s, c0)`` of ``c0 + s·x·log2 x`` seconds for x elements.
SelectFit = tuple[float, float]

_COMM_KIND = {"gtopk": "gtopk", "oktopk": "oktopk", "randomk": "randomk"}
#: Bytes of one index on the wire (int32 below 2^31 elements, ``index_dtype_for``) and of the size
#: round's per-rank count.
INDEX_BYTES = 4
COUNT_BYTES = 8


def allgather_sparse_time(method: Method, nbytes: int, cost: CostModel, min_k: int = 1) -> float:
    """Seconds to exchange Top-k's or DGC's selection of a bucket of ``nbytes`` fp32 bytes: one
    allgather of ``k·(4 + INDEX_BYTES)`` bytes per rank, plus a size round (an allgather of one
    count) for DGC, whose sampled threshold selects a count that varies by rank (module docstring).
    ``k = max(sparse_k, min_k)``, at most the bucket's elements."""
    if cost.ranks <= 1 or nbytes <= 0:
        return 0.0
    t = cost.topk_time(nbytes, method.density, index_bytes=INDEX_BYTES, min_k=min_k)  # the packed allgather
    if method.kind in ("dgc", "dgc_masked"):
        t += cost.allgather.time(COUNT_BYTES)
    return t


def quantised_time(method: Method, nbytes: int, cost: CostModel, block: int = DEFAULT_BLOCK) -> float:
    """Seconds to exchange a bucket of ``nbytes`` fp32 bytes with the ``method.bits``-bit quantiser:
    the all-to-all, where each rank sends its P-1 other parts and receives P-1 parts (the bytes of
    an allgather of one part), then the allgather of the owner's part quantised again; a part is
    ``ceil(n/P)`` elements, :func:`~hvd_commopt.compress.quantize.encoded_bytes` of them (the codes
    and one float32 scale per ``block``). Priced with the calibrated allgather for both phases
    (docs/auto-compression.md#quantised)."""
    if cost.ranks <= 1 or nbytes <= 0:
        return 0.0
    part = encoded_bytes(-(-(nbytes // 4) // cost.ranks), method.bits, block)
    return 2 * cost.allgather.time(part)


def fit_kind(method: Method) -> str:
    """Whose selection cost prices ``method``: gTop-k and Ok-Topk select locally by the exact
    top-k, as Top-k does; DGC samples its threshold, random-k draws indices, casts cast."""
    return {"gtopk": "topk", "oktopk": "topk", "dgc_masked": "dgc"}.get(method.kind, method.kind)


def compress_time(method: Method, nbytes: int, fits: Mapping[str, SelectFit]) -> float:
    """The compute ``method`` adds to a bucket over dense fp32: ``c0 + s·x`` for x elements with
    ``fits[method.key]`` (measured whole, :mod:`.local_cost`), or else OMGS's ``c0 + s·x·log2 x``
    with ``fits[kind]`` (the selection alone, as the fusion planners price it)."""
    if method.key in fits:
        s, c0 = fits[method.key]
        return c0 + s * (nbytes // 4)
    s, c0 = fits.get(fit_kind(method), (0.0, 0.0))
    return topk_select_time(s, c0=c0)(nbytes)


def method_costs(method: Method, nbytes: int, cost: CostModel, fits: Mapping[str, SelectFit]) -> tuple[float, float] | None:
    """``(compress_s, comm_s)`` of ``method`` on a bucket of ``nbytes`` fp32 bytes; None when the
    cost model cannot price it (gTop-k without a point-to-point fit)."""
    if method.kind == "none":
        return 0.0, dense_pricing(cost, 1.0, "dense").comm_time(nbytes)
    sel = compress_time(method, nbytes, fits)
    if method.quantised:
        return sel, quantised_time(method, nbytes, cost)
    if not method.sparse:
        return sel, dense_pricing(cost, 0.5, method.kind).comm_time(nbytes)
    if method.kind in ("topk", "dgc", "dgc_masked"):
        return sel, allgather_sparse_time(method, nbytes, cost, MIN_K)
    try:
        pr = sparse_pricing(cost, _COMM_KIND[method.kind], method.density)
    except ConfigError:
        return None
    return sel, pr.comm_time(nbytes)


def bucket_costs(name: str, nbytes: int, gap_s: float, candidates: Sequence[Method], cost: CostModel,
                 fits: Mapping[str, SelectFit], note: str = "") -> BucketCosts:
    """The :class:`BucketCosts` of one bucket over ``candidates`` (those the model can price)."""
    costs = {}
    for m in candidates:
        c = method_costs(m, nbytes, cost, fits)
        if c is not None:
            costs[m] = c
    return BucketCosts(name, int(nbytes), float(gap_s), costs, note)
