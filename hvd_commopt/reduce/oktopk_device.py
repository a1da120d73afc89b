"""Ok-Topk's exchange on the device route (docs/oktopk.md#device-route): the framework's tensors
throughout, no host decision.

The host route (:func:`~.oktopk.oktopk_exchange`) splits each rank's selection by region and
sends each part, whose size depends on the data, to the region's owner; its receiver must know
that size, a host read per bucket and step. Here every collective has a size known before the
data (docs/oktopk.md#device-route weighs the traffic):

1. **Region cuts** (kept for the rebalance schedule and the host route after a checkpoint): an
   allreduced index histogram built by ``scatter_add``, the host route's balanced cuts.
2. **Exchange at a fixed capacity**: every rank's k pairs (one byte message: indices, values)
   reach every rank by one equal-size allgather, so each rank holds what every region's owner
   receives, in rank order.
3. **Sums** in the host route's order: stably sorted by index, summed per index as
   ``((0 + a) + b) + ...`` (``unique_sum``'s additions) by P-1 shifted passes; the consumed
   duplicates become padding (key -1).
4. **Global top-k** on every rank alike: a stable descending sort of the magnitude keys (ties to
   the lower index), the k first, ascending: the host route's pairs, bit for bit (-0.0 and NaN
   payloads included), with no further collective.
"""
from __future__ import annotations

from typing import Any

from ..select.fixed import magnitude_keys
__all__ = ["oktopk_exchange_device", "TensorLink", "REBALANCE_BINS"]

REBALANCE_BINS = 64   # index-histogram bins per rank for the region cuts (both routes)

WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}


class TensorLink:
    """A link's blocking collectives on the framework's tensors: a native link takes them as they
    are; a host (NumPy) link gets them staged through host arrays (the transport's copy)."""

    def __init__(self, link: Any, ops: Any):
        self.link, self.ops = link, ops
        self.rank, self.size, self.host = link.rank, link.size, bool(link.host)

    def allgather_equal(self, t: Any) -> Any:
        """Every rank's ``t`` (each as many elements), concatenated in rank order."""
        if not self.host:
            return self.link.allgather_equal(t)[0]
        got = self.link.allgather_equal(self.ops.to_numpy(t).copy())[0]
        return self.ops.from_numpy(got.copy(), like=t)

    def allreduce(self, t: Any) -> Any:
        if not self.host:
            return self.link.allreduce_(t, "sum")
        return self.ops.from_numpy(self.link.allreduce_(self.ops.to_numpy(t).copy(), "sum"), like=t)


def _full(ops: Any, n: int, value: int, like: Any) -> Any:
    return ops.shift(ops.zeros(n, "int64", like=like), value)


def _pack(ops: Any, idx: Any, vals: Any, idt: str) -> Any:
    return ops.cat([ops.as_bytes(ops.cast(idx, idt)), ops.as_bytes(vals)])


def _unpack(ops: Any, buf: Any, idt: str, vdt: str) -> tuple[Any, Any]:
    c = ops.numel(buf) // (WIDTH[idt] + WIDTH[vdt])  # the message's size: metadata, not data
    ib = c * WIDTH[idt]
    if c == 0:
        return ops.zeros(0, "int64", like=buf), ops.zeros(0, vdt, like=buf)
    return ops.cast(ops.from_bytes(ops.slice(buf, 0, ib), idt), "int64"), ops.from_bytes(ops.slice(buf, ib, ops.numel(buf)), vdt)


def _bcast(ops: Any, s: Any, n: int) -> Any:
    """The one-element int64 tensor ``s`` repeated n times."""
    return ops.add(ops.zeros(n, "int64", like=s), s)


def balanced_bounds_device(tl: TensorLink, ops: Any, idx: Any, n: int) -> Any:
    """The host route's :func:`~.oktopk.balanced_bounds`, as an int64 tensor of P+1 cuts."""
    P = tl.size
    nb = min(REBALANCE_BINS * P, n)
    width = -(-n // nb)
    ones = _full(ops, ops.numel(idx), 1, idx)
    hist = tl.allreduce(ops.scatter_add(ops.zeros(nb, "int64", like=idx), ops.trunc_divide(ops.clone(idx), width), ones))
    cum = ops.cumsum(hist)
    total = _bcast(ops, ops.slice(cum, nb - 1, nb), P - 1)
    j = ops.slice(ops.arange(P, like=idx), 1, P)
    want = ops.trunc_divide(ops.shift(ops.mul(j, total), P - 1), P)  # ceil(j·total/P)
    cuts = ops.mul(ops.shift(ops.searchsorted(cum, want), 1), _full(ops, P - 1, width, idx))
    cuts = ops.where(ops.compare(cuts, "gt", n), _full(ops, P - 1, n, idx), cuts)
    even = ops.trunc_divide(ops.mul(j, _full(ops, P - 1, n, idx)), P)
    cuts = ops.where(ops.compare(total, "le", 0), even, cuts)  # non-decreasing by construction
    return ops.cat([_full(ops, 1, 0, idx), cuts, _full(ops, 1, n, idx)])


def _segment_sums(ops: Any, i: Any, v: Any, P: int, n: int) -> tuple[Any, Any, Any]:
    """(indices, sums, valid) of the concatenation in rank order, sorted by index: each index's
    first entry holds ``((0 + v_0) + v_1) + ...`` (unique_sum's order), its later entries are
    padding (index n, not valid)."""
    c = ops.numel(i)
    dt = ops.dtype_name(v)
    order = ops.argsort(i)  # stable: equal indices stay in rank order
    si, sv = ops.gather(i, order), ops.gather(v, order)
    first = ops.compare(ops.sub(ops.clone(si), ops.cat([_full(ops, 1, -1, si), ops.slice(si, 0, c - 1)])), "gt", 0)
    total = ops.add(ops.zeros(c, dt, like=sv), sv)
    zero = ops.zeros(c, dt, like=sv)
    for s in range(1, min(P, c)):  # the s-th later entry of the same index, where there is one
        same = ops.equal(ops.cat([ops.slice(si, s, c), _full(ops, s, -1, si)]), si)
        total = ops.add(total, ops.where(same, ops.cat([ops.slice(sv, s, c), ops.zeros(s, dt, like=sv)]), zero))
    return ops.where(first, si, _full(ops, c, n, si)), total, first


def oktopk_exchange_device(link: Any, ops: Any, idx: Any, vals: Any, n: int, k: int, bounds: Any | None,
                           index_dtype: str = "int32") -> tuple[Any, Any, Any, dict]:
    """:func:`~.oktopk.oktopk_exchange` on the device route (module docstring): (global indices
    ascending, their summed values, the region cuts, what this rank sent). No host decision: every
    rank's k pairs arrive by one equal-size allgather (a fixed capacity of k per rank), and every
    rank sums and selects all of them as the regions' owners would, the same bits."""
    tl = TensorLink(link, ops)
    P = tl.size
    vdt = ops.dtype_name(vals)
    rebalanced = bounds is None
    if rebalanced:  # kept for the host route (a checkpoint loaded there) and the rebalance schedule
        bounds = balanced_bounds_device(tl, ops, idx, n)
    m = k * (WIDTH[index_dtype] + WIDTH[vdt])  # one rank's message, in bytes
    got = tl.allgather_equal(_pack(ops, idx, vals, index_dtype))
    parts = [_unpack(ops, ops.slice(got, s * m, (s + 1) * m), index_dtype, vdt) for s in range(P)]
    U, S, valid = _segment_sums(ops, ops.cat([p[0] for p in parts]), ops.cat([p[1] for p in parts]), P, n)
    c = ops.numel(U)
    # the k largest |sum|, ties to the lower index: U ascends where valid, so a stable descending
    # sort of the keys (padding -1, below every magnitude) ranks them as the radix select does
    keys = ops.where(valid, magnitude_keys(ops, S), _full(ops, c, -1, U))
    top = ops.slice(ops.argsort(keys, descending=True), 0, min(k, c))
    ut = ops.gather(U, top)
    pos = ops.gather(top, ops.argsort(ut))  # ascending index; padding (n: fewer than k sums) last
    I = ops.gather(U, pos)
    real = ops.compare(I, "lt", n)  # a slot with no sum holds index 0 and +0.0, as the radix route's
    info = {"split_pairs": (P - 1) * k, "histograms": 0, "cut_rows": -1, "gathered_pairs": None,
            "rebalanced": rebalanced, "device": True}
    return ops.where(real, I, 0), ops.where(real, ops.gather(S, pos), 0.0), bounds, info
