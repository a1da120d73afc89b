"""Ok-Topk: an O(k) sparse allreduce (Li & Hoefler, "Near-Optimal Sparse Allreduce for
Distributed Deep Learning", PPoPP'22), docs/oktopk.md.

Per bucket and step, after the sparse reducers' prologue (the local top-k with error feedback,
:class:`~hvd_commopt.reduce.sparse.SparseReducer`):

1. **Split and reduce.** The index space ``[0, n)`` is cut into P contiguous regions; rank j owns
   region j. Each rank sends the part of its selection that falls in region j to rank j (P-1
   pairwise rounds) and sums what it receives (``unique_sum`` in rank order: deterministic).
   **Load balancing**: the cuts are placed so every region receives about the same number of
   selected entries, from a histogram of all ranks' selected indices (an allreduce of 64·P
   counts) at a bucket's first step and every ``rebalance`` steps (docs/oktopk.md#balance).
2. **Global top-k.** The exact k largest |sums| of the union of the regions, ties to the lower
   index: allreduces of a histogram of the magnitudes' keys (1024 or 4096 bins), then of 256
   sub-bins, find the cell of the k-th value; each rank's first few entries of that cell are
   allgathered to place the cut exactly
   (docs/oktopk.md#global-topk). Every rank computes the same cut.
3. **Balanced allgatherv** of each region's selected (index, value) pairs: every rank ends with
   the same k pairs. With balanced regions each rank contributes about k/P.

Local values whose index did not make the global top-k go back to the residual
(``memory.restore``), as gTop-k does, so nothing is lost (docs/oktopk.md#residual).

Traffic per rank and step ≈ ``2k(P-1)/P`` (index, value) pairs plus a 4-16 KiB histogram
allreduce, against ``k(P-1)`` pairs for the Top-k allgather and ``2k·log2 P`` for gTop-k
(docs/oktopk.md#traffic). The exchange runs on the progress thread on host buffers: its work is
O(k), never O(n); on a framework-native backend (Gloo) the buffers cross as CPU tensors sharing
the arrays' memory (hvd_commopt/comm/host_link.py, docs/oktopk.md#backends).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..buckets import Bucket
from ..comm.host_link import host_link
from ..compress.selector import Density
from ..compress.topk import TopKSelector
from ..errors import ConfigError
from ..fusion.pricing import Pricing, sparse_pricing
from ..fusion.sparse_scaling import hist_bins
from ..memory.base import Memory
from ..memory.error_feedback import ErrorFeedback
from ..select.fixed import device_route, member_of_sorted
from ..tensor_ops import TensorOps
from .base import Pending, ReduceContext, RoundInfo
from .oktopk_device import REBALANCE_BINS, oktopk_exchange_device
from .sparse import PendingSelection, SparseReducer, index_dtype_for

__all__ = ["OkTopK", "oktopk_exchange", "balanced_bounds", "global_topk_mask", "REBALANCE_BINS"]



def _keys(v: np.ndarray) -> tuple[np.ndarray, int]:
    """|v| as sign-free integer keys (monotone in |v|, NaN largest) and the key's bit width."""
    if v.dtype == np.float64:
        return (v.view(np.int64) & np.int64(0x7FFFFFFFFFFFFFFF)), 63
    if v.dtype == np.float32:
        return (v.view(np.int32) & np.int32(0x7FFFFFFF)).astype(np.int64), 31
    return (v.view(np.int16) & np.int16(0x7FFF)).astype(np.int64), 15  # float16, bf16 bits (uint16)


def balanced_bounds(link: Any, idx: np.ndarray, n: int) -> np.ndarray:
    """P+1 region cuts over [0, n) with about equal numbers of all ranks' selected indices in
    each region (the same on every rank: computed from an allreduced histogram)."""
    P = link.size
    nb = min(REBALANCE_BINS * P, n)
    width = -(-n // nb)
    hist = np.bincount(idx // width, minlength=nb).astype(np.int64)
    hist = link.allreduce_(hist, "sum")
    cum = np.cumsum(hist)
    total = int(cum[-1]) if cum.size else 0
    bounds = np.empty(P + 1, np.int64)
    bounds[0], bounds[P] = 0, n
    for j in range(1, P):
        if total == 0:
            bounds[j] = j * n // P
        else:
            b = int(np.searchsorted(cum, -(-j * total // P), side="left"))
            bounds[j] = min((b + 1) * width, n)
    return np.maximum.accumulate(bounds)


def _cut_bin(link: Any, bins: np.ndarray, nb: int, k: int) -> tuple[int, int, int]:
    """Allreduce a histogram of ``bins`` (values in [0, nb)); the bin b holding the k-th largest
    entry, how many entries lie above it, and the total (the same on every rank)."""
    hist = link.allreduce_(np.bincount(bins, minlength=nb).astype(np.int32), "sum")
    above = np.cumsum(hist[::-1])[::-1].astype(np.int64)  # above[b] = entries in bins >= b
    if above[0] <= k:
        return -1, 0, int(above[0])
    b = int(np.nonzero(above >= k)[0][-1])
    return b, (int(above[b + 1]) if b + 1 < nb else 0), int(above[0])


def global_topk_mask(link: Any, U: np.ndarray, S: np.ndarray, k: int) -> tuple[np.ndarray, int, int]:
    """Which of this rank's region entries (indices U, sums S) are among the exact global k
    largest |sums| of all regions, ties to the lower index (the same cut on every rank); the
    number of histogram allreduces (1 or 2) and of (key, index) rows this rank allgathered to
    place the cut (-1: no allgather, the cut fell on a bin edge).

    Two histogram allreduces narrow the k-th value to a bin of the keys' top bits, then to a
    256th of it; each rank's first few entries of that sub-bin are allgathered to place the cut
    exactly (docs/oktopk.md#global-topk)."""
    keys, bits = _keys(S)
    nb = hist_bins(k)
    shift = bits - nb.bit_length() + 1
    bins = keys >> shift  # the keys' top log2(nb) bits
    b, above, total = _cut_bin(link, bins, nb, k)
    if b < 0:
        return np.ones(U.size, bool), 1, -1
    sub_shift = max(shift - 8, 0)
    mine = bins == b
    sub = (keys >> sub_shift) & ((1 << (shift - sub_shift)) - 1)  # the next (up to) 8 bits
    b2, above2, _ = _cut_bin(link, sub[mine], 1 << (shift - sub_shift), k - above)
    if b2 < 0:  # bin b holds exactly the k - above missing entries
        return bins >= b, 2, -1
    need = k - above - above2
    cell = mine & (sub == b2)
    cand = np.stack([keys[cell], U[cell]], axis=1).astype(np.int64)
    # only a rank's own first `need` entries of the cell can be among the global first `need`
    cand = cand[np.lexsort((cand[:, 1], -cand[:, 0]))[:need]]
    allp, _ = link.allgather(cand.reshape(-1))
    allp = allp.reshape(-1, 2)
    order = np.lexsort((allp[:, 1], -allp[:, 0]))          # by |v| descending, then index
    last_key, last_idx = allp[order[need - 1]]
    in_cell = (keys > last_key) | ((keys == last_key) & (U <= last_idx))
    return (bins > b) | (mine & (sub > b2)) | (cell & in_cell), 2, int(cand.shape[0])


def _pack(idx: np.ndarray, vals: np.ndarray, idt: np.dtype) -> np.ndarray:
    return np.concatenate([idx.astype(idt).view(np.uint8), np.ascontiguousarray(vals).view(np.uint8)])


def _unpack(buf: np.ndarray, idt: np.dtype, vdt: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    c = buf.size // (idt.itemsize + vdt.itemsize)
    ib = c * idt.itemsize
    return buf[:ib].view(idt).astype(np.int64), buf[ib:].view(vdt)


def _unique_sum(idx: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    u, inv = np.unique(idx, return_inverse=True)
    out = np.zeros(u.size, dtype=vals.dtype)
    np.add.at(out, inv.reshape(-1), vals)  # unbuffered: equal indices summed in order of appearance
    return u, out


def oktopk_exchange(link: Any, idx: np.ndarray, vals: np.ndarray, n: int, k: int, bounds: np.ndarray | None,
                    index_dtype: str = "int32") -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Split-and-reduce, global top-k, balanced allgatherv (module docstring); host arrays.

    Returns (global indices ascending, their summed values, the region cuts used, and what this
    rank sent: ``split_pairs``, ``cut_rows``, ``gathered_pairs``, ``rebalanced``)."""
    P, r = link.size, link.rank
    idt = np.dtype(index_dtype)
    rebalanced = bounds is None
    if rebalanced:
        bounds = balanced_bounds(link, idx, n)
    cuts = np.searchsorted(idx, bounds)  # idx ascending: region j is idx[cuts[j]:cuts[j+1]]
    parts: list = [None] * P
    parts[r] = (idx[cuts[r]:cuts[r + 1]], vals[cuts[r]:cuts[r + 1]])
    for s in range(1, P):  # pairwise rounds: send region dest's part, receive my region's from src
        dest, src = (r + s) % P, (r - s) % P
        got = link.sendrecv(_pack(idx[cuts[dest]:cuts[dest + 1]], vals[cuts[dest]:cuts[dest + 1]], idt), dest, src)
        parts[src] = _unpack(got, idt, vals.dtype)
    U, S = _unique_sum(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    keep, hists, cut_rows = global_topk_mask(link, U, S, k)
    allb, counts = link.allgather(_pack(U[keep], S[keep], idt))
    I, V, off = [], [], 0
    for c in counts:  # bytes per rank; region order = index order: the concatenation is ascending
        i, v = _unpack(allb[off:off + c], idt, vals.dtype)
        I.append(i)
        V.append(v)
        off += c
    info = {"split_pairs": int(idx.size - (cuts[r + 1] - cuts[r])), "histograms": hists, "cut_rows": cut_rows,
            "gathered_pairs": int(keep.sum()), "rebalanced": rebalanced}
    return np.concatenate(I), np.concatenate(V), bounds, info


class OkTopK(SparseReducer):
    """Ok-Topk sparse allreduce (see the module docstring).

    Args:
        density: fraction of each bucket sent (float, per-layer dict or callable).
        error_feedback: unsent and globally dropped values stay in a residual.
        index_dtype: "int32", "int64" or None (automatic).
        selection / tau / band: the local selection (docs/selection.md).
        rebalance: steps between recomputations of the region cuts (>= 1).
        memory: another memory instead of error feedback (momentum correction,
            docs/topk.md#momentum-correction).
        min_k: the fewest elements any bucket sends (docs/topk.md#density-floor).
        dense_1d: send 1-D tensors whole, in buckets of their own (docs/topk.md#dense-1d).
    """

    name = "oktopk"

    def __init__(self, density: Density = 0.001, error_feedback: bool = True, index_dtype: str | None = None,
                 selection: str = "exact", tau: int = 16, band: float = 0.2, rebalance: int = 16,
                 dense_when_full: bool = True, memory: Memory | None = None, min_k: int = 1,
                 dense_1d: bool = True):
        if isinstance(rebalance, bool) or not isinstance(rebalance, int) or rebalance < 1:
            raise ConfigError(f"rebalance must be an integer >= 1 (steps between region load balancing), got "
                              f"{rebalance!r}; use 1 to rebalance every step")
        super().__init__(TopKSelector(density, selection, tau, band, min_k=min_k, dense_1d=dense_1d),
                         memory if memory is not None else ErrorFeedback(error_feedback), index_dtype, dense_when_full)
        self.rebalance = rebalance
        self.last_info: dict[str, dict] = {}  # bucket -> what this rank sent in its last exchange
        self._bounds: dict[str, tuple[np.ndarray, int]] = {}  # bucket -> (cuts, age)

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm = ctx.ops, ctx.comm
        sel = self.select(bucket, rnd, flat, ctx)  # all k count as sent; finish() restores the dropped
        if isinstance(sel, Pending):
            return sel
        vals, idx, n = sel
        name = rnd.wire(bucket)
        if comm.size == 1:
            return Pending(name, PendingSelection(idx, vals, n, bucket.name, flat, local=True))
        k = ops.numel(idx)
        idt = index_dtype_for(n, self.index_dtype)
        if device_route(ops, vals):  # docs/oktopk.md#device-route
            return self._start_device(bucket, name, idx, vals, n, k, idt, flat, ctx, rnd.step)
        I = np.asarray(ops.to_numpy(idx), dtype=np.int64)
        V = np.asarray(ops.to_numpy(vals))
        cuts, age = self._bounds.get(bucket.name, (None, 0))
        if cuts is not None and (age >= self.rebalance or cuts[-1] != n or cuts.size != comm.size + 1):
            cuts = None
        self._bounds[bucket.name] = (cuts, 0 if cuts is None else age)

        def fn(link: Any, deadline: float):
            return oktopk_exchange(host_link(link, ops), I, V, n, k, cuts, idt)
        handle = comm.run_async(fn, name=f"{name}.oktopk", op="oktopk")
        return Pending(name, PendingSelection(idx, vals, n, bucket.name, flat, step=rnd.step), (handle,))

    def _start_device(self, bucket: Bucket, name: str, idx: Any, vals: Any, n: int, k: int, idt: str,
                      flat: Any, ctx: ReduceContext, step: int) -> Pending:
        """The device route's exchange (hvd_commopt/reduce/oktopk_device.py): the same result."""
        ops, comm = ctx.ops, ctx.comm
        cuts, age = self._bounds.get(bucket.name, (None, 0))
        if cuts is not None and (age >= self.rebalance or ops.numel(cuts) != comm.size + 1):
            cuts = None
        if isinstance(cuts, np.ndarray):  # loaded from a checkpoint
            cuts = ops.from_numpy(cuts.astype(np.int64), like=idx)
        self._bounds[bucket.name] = (cuts, 0 if cuts is None else age)

        def fn(link: Any, deadline: float):
            return oktopk_exchange_device(link, ops, idx, vals, n, k, cuts, idt)
        handle = comm.run_async(fn, name=f"{name}.oktopk", op="oktopk")
        return Pending(name, PendingSelection(idx, vals, n, bucket.name, flat, step=step), (handle,))

    def exchanged(self, pending: Pending, ctx: ReduceContext) -> tuple[Any, Any]:
        st, ops = pending.state, ctx.ops
        gi, gv, cuts, self.last_info[st.key] = ctx.comm.wait(pending.handles[0])
        prev, age = self._bounds.get(st.key, (None, 0))
        self._bounds[st.key] = (cuts, age + 1 if prev is not None else 1)
        if self.last_info[st.key].get("device"):
            # the device route: restore all k, +0.0 where the entry made the global top-k (the
            # memory zeroed it: +0 + +0 = +0), as gTop-k does (docs/gtopk.md#merge-fixed)
            self.restore_not_alive(ops, st, member_of_sorted(ops, st.idx, gi))
            return gi, gv
        li = np.asarray(ops.to_numpy(st.idx), dtype=np.int64)
        dropped = np.flatnonzero(~np.isin(li, gi, assume_unique=True))
        if dropped.size:
            self.restore_dropped(ops, st, ops.from_numpy(dropped, like=st.idx))
        return ops.from_numpy(gi, like=st.idx), ops.from_numpy(np.array(gv), like=st.vals)

    def config(self) -> dict:
        return {**super().config(), "rebalance": self.rebalance}

    def price(self, cost: Any, select_s: float | None = None, select_c0: float = 0.0) -> Pricing:
        return sparse_pricing(cost, "oktopk", self.density, select_s, select_c0)

    def relayout(self, ops: TensorOps, old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
        """The memory's state follows its tensors; the region cuts of the old buckets are dropped
        (the new buckets are balanced on their first step)."""
        super().relayout(ops, old, new)
        self._bounds.clear()

    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "bounds": {k: [int(x) for x in c] for k, (c, _) in self._bounds.items() if c is not None}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._bounds = {k: (np.asarray(v, np.int64), 0) for k, v in dict(state.get("bounds", {})).items()}

    def __repr__(self) -> str:
        return f"OkTopK(density={self.compressor.density!r}, {self.memory!r})"
