"""Ok-Topk's exchange on the device route (docs/oktopk.md#device-route): the framework's tensors
throughout, one host decision per bucket and step.

The host route (:func:`~.oktopk.oktopk_exchange`) runs on host arrays; on the device route every
step but one stays a tensor op whose sizes are known before the data:

1. **Split and reduce.** The region cuts (a device tensor; balanced, as the host route's, from
   an allreduced index histogram built by ``scatter_add``) give, by ``searchsorted``, where each
   region starts in this rank's ascending selection. **The one host decision**: those P+1
   positions are read on the host, because the paper's split-and-reduce sends each region's part,
   whose size depends on the data, to its owner (a fixed capacity would cost k per destination,
   the Top-k allgather's traffic). Each part travels as one byte message (indices, values).
   The received parts are summed per index in rank order, ``((0 + a) + b) + ...`` as the host
   route's ``unique_sum`` adds them, by P-1 shifted passes over the index-sorted concatenation;
   the consumed duplicates become padding (key -1).
2. **Global top-k** without a host decision: an exact radix select of the k-th largest
   (magnitude key, then lower index) over every rank's region sums, 8 bits per round, each round
   one allreduce of a 256-bin histogram on the device (docs/oktopk.md#device-route).
3. **Gather** without counts: every rank's offset is the allreduced count of the ranks before it
   (regions are in index order), each rank writes its kept pairs' bytes into k slots at those
   offsets and one allreduce (sum of bytes, one writer per byte) hands every rank the k pairs,
   bit for bit (-0.0 and NaN payloads included). Its traffic is an allreduce of k pairs instead of
   the host route's allgatherv.
"""
from __future__ import annotations

from typing import Any

from ..select.fixed import magnitude_keys
__all__ = ["oktopk_exchange_device", "TensorLink", "REBALANCE_BINS"]

REBALANCE_BINS = 64   # index-histogram bins per rank for the region cuts (both routes)

WIDTH = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}
KEY_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


class TensorLink:
    """A link's blocking collectives on the framework's tensors: a native link takes them as they
    are; a host (NumPy) link gets them staged through host arrays (the transport's copy)."""

    def __init__(self, link: Any, ops: Any):
        self.link, self.ops = link, ops
        self.rank, self.size, self.host = link.rank, link.size, bool(link.host)

    def sendrecv(self, t: Any, dest: int, source: int) -> Any:
        if not self.host:
            return self.link.sendrecv(t, dest, source)
        got = self.link.sendrecv(self.ops.to_numpy(t), dest, source)
        return None if got is None else self.ops.from_numpy(got.copy(), like=t)

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


def _count(ops: Any, mask: Any) -> Any:
    """A one-element int64 tensor: how many of ``mask`` are True (stays a tensor)."""
    c = ops.numel(mask)
    return ops.slice(ops.cumsum(ops.cast(mask, "int64")), c - 1, c) if c else ops.zeros(1, "int64", like=mask)


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


def _radix_keep(tl: TensorLink, ops: Any, keys: list[tuple[Any, int]], valid: Any, k: int) -> Any:
    """bool mask of this rank's entries among the global k largest by ``keys`` (most significant
    first; each an int64 tensor >= 0 and its bit width) over every rank's valid entries, exact (the
    last key is unique). One allreduce of 256 counts per 8 bits; no host decision."""
    c = ops.numel(valid)
    no = ops.compare(ops.zeros(c, "int64", like=valid), "gt", 0)
    cand, keep, rem = valid, no, _full(ops, 1, k, valid)
    for key, bits in keys:
        for shift in range(((bits + 7) // 8 - 1) * 8, -1, -8):
            q = ops.trunc_divide(ops.clone(key), 1 << shift)
            digit = ops.sub(q, ops.mul(ops.trunc_divide(ops.clone(q), 256), _full(ops, c, 256, q)))
            hist = tl.allreduce(ops.scatter_add(ops.zeros(256, "int64", like=valid), digit, ops.cast(cand, "int64")))
            cum = ops.cumsum(hist)
            above = ops.sub(ops.add(_bcast(ops, ops.slice(cum, 255, 256), 256), hist), cum)  # digit >= b
            b = ops.shift(_count(ops, ops.compare(ops.sub(ops.clone(above), _bcast(ops, rem, 256)), "ge", 0)), -1)
            rem = ops.sub(rem, ops.gather(ops.cat([above, ops.zeros(1, "int64", like=above)]), ops.shift(b, 1)))
            bb = _bcast(ops, b, c)
            same = ops.equal(digit, bb)
            keep = ops.where(cand, ops.compare(ops.sub(digit, bb), "gt", 0), keep)  # cand above the cut's digit
            cand = ops.where(same, cand, no)
    return ops.where(cand, cand, keep)  # cand: the k-th entry itself, where there are more than k


def oktopk_exchange_device(link: Any, ops: Any, idx: Any, vals: Any, n: int, k: int, bounds: Any | None,
                           index_dtype: str = "int32") -> tuple[Any, Any, Any, dict]:
    """:func:`~.oktopk.oktopk_exchange` on the device route (module docstring): (global indices
    ascending, their summed values, the region cuts used, what this rank sent)."""
    tl = TensorLink(link, ops)
    P, r = tl.size, tl.rank
    vdt = ops.dtype_name(vals)
    rebalanced = bounds is None
    if rebalanced:
        bounds = balanced_bounds_device(tl, ops, idx, n)
    pos = [int(x) for x in ops.to_numpy(ops.searchsorted(idx, bounds))]  # the host decision (docstring)
    parts: list = [None] * P
    parts[r] = (ops.slice(idx, pos[r], pos[r + 1]), ops.slice(vals, pos[r], pos[r + 1]))
    for s in range(1, P):  # pairwise rounds: region dest's part to dest, my region's from src
        dest, src = (r + s) % P, (r - s) % P
        got = tl.sendrecv(_pack(ops, ops.slice(idx, pos[dest], pos[dest + 1]),
                                ops.slice(vals, pos[dest], pos[dest + 1]), index_dtype), dest, src)
        parts[src] = _unpack(ops, got, index_dtype, vdt)
    U, S, valid = _segment_sums(ops, ops.cat([p[0] for p in parts]), ops.cat([p[1] for p in parts]), P, n)
    keys = [(magnitude_keys(ops, S), KEY_BITS[vdt]),
            (ops.sub(_full(ops, ops.numel(U), n, U), U), max(n.bit_length(), 1))]  # then the lower index
    keep = _radix_keep(tl, ops, keys, valid, k)
    # gather: k slots, rank r's kept pairs from the allreduced count of the ranks before it
    mine = _count(ops, keep)
    counts = tl.allreduce(ops.index_copy(ops.zeros(P, "int64", like=U), _full(ops, 1, r, U), mine))
    offset = ops.slice(ops.sub(ops.cumsum(counts), counts), r, r + 1)
    slot = ops.add(ops.sub(ops.cumsum(ops.cast(keep, "int64")), _full(ops, ops.numel(U), 1, U)),
                   _bcast(ops, offset, ops.numel(U)))
    slot = ops.where(keep, slot, _full(ops, ops.numel(U), k, U))  # not kept: the spare slot k
    iw, vw = WIDTH["int64"], WIDTH[vdt]
    ib = ops.as_bytes(ops.index_copy(ops.zeros(k + 1, "int64", like=U), slot, ops.where(keep, U, ops.zeros(ops.numel(U), "int64", like=U))))
    zv = ops.zeros(ops.numel(S), vdt, like=S)
    vb = ops.as_bytes(ops.index_copy(ops.zeros(k + 1, vdt, like=S), slot, ops.where(keep, S, zv)))
    both = tl.allreduce(ops.cat([ops.slice(ib, 0, k * iw), ops.slice(vb, 0, k * vw)]))  # one writer per byte
    I = ops.from_bytes(ops.slice(both, 0, k * iw), "int64")
    V = ops.from_bytes(ops.slice(both, k * iw, k * (iw + vw)), vdt)
    info = {"split_pairs": ops.numel(idx) - (pos[r + 1] - pos[r]), "histograms": sum((b + 7) // 8 for _, b in keys),
            "cut_rows": -1, "gathered_pairs": None, "rebalanced": rebalanced, "device": True}
    return I, V, bounds, info
