"""gTop-k S-SGD: global top-k by recursive doubling, O(k log P) traffic, any number of ranks.

Paper: Shi, Wang, Chu, Li, "A Distributed Synchronous SGD Algorithm with Global Top-k
Sparsification for Low Bandwidth Networks", ICDCS 2019 (arXiv:1901.04359); convergence: IJCAI
2019. Reference code: shyhuai/gtopkssgd ``allreducer.py: gtopk_sparse_recursive_allreduce``
(recursive doubling, "gtopkr"). docs/gtopk.md#gtopk.

Algorithm (per bucket and step)::

    acc = prescale·flat + residual;  (I, V) = TopK_k(acc);  residual = acc zeroed at I
    fold (docs/gtopk.md#non-power-of-two, P not a power of two, m = 2^floor(log2 P), r = P - m):
        rank m+j sends (I, V) to rank j < r, which merges M(own, received), own first
    recursive doubling among ranks 0..m-1, round d = 1, 2, 4, ... < m:
        exchange (I, V) with rank XOR d; (I, V) = M(lower rank's, higher rank's)
    unfold: rank j sends the final (I, V) and rank m+j's k-byte survival mask to m+j
    result = scatter(I, V)·postscale on every rank (identical (I, V) everywhere, T-GT-1)
    residual[I_local not surviving] += V_local   (the survival mask, docs/gtopk.md#recursive-doubling, docs/gtopk.md#t-gt-5)
    momentum correction with masking: u[I_local not surviving] = the momentum masking zeroed
        (masking is for what the merge applied, docs/gtopk.md#masking-delivered)

Merge operator M: the robust form (docs/gtopk.md#merge-robust): union of the two index sets with values
summed at common indices (``TensorOps.unique_sum``), then the top-k by magnitude with ties to
the smaller index (``topk_abs`` on the index-sorted union). Every input list has exactly k
distinct indices, so the union has at least k and no padding is ever needed; indices stay
unique (T-GT-2), unlike the reference's concatenation, which can select a zeroed duplicate.
Both partners compute M with the same operand order, so their results are bit-identical.

Survival: each rank tracks which of its own k contributions are still in the merged set after
every merge; once dropped, always dropped (an index that re-enters from another subtree carries
only that subtree's values). Rank j < r also tracks rank m+j's contributions and sends their
mask back in the unfold. The dropped local values return to the residual, so
``Σ_i acc_i == R + Σ_i residual_i'`` (conservation; exact in exact arithmetic). The reference
tree variant's "index membership" rule (docs/gtopk.md#tree-variant) would lose mass; we do not use it.

Choices:

* The rounds run on the communicator's progress thread (:meth:`Communicator.run_async`): a
  bucket's log P dependent exchanges do not block the backward pass that launched it.
* On host (NumPy) backends a round is one message: indices (int32 below 2^31 elements), values
  and, for the unfold, the mask, packed into one byte buffer. Traffic per round is
  k·(index + value bytes) = 2k words for fp32/int32, as in the paper; a rank does
  ceil(log2 P) rounds (m's log2 rounds plus the fold, for ranks j < r) and the unfold adds
  k·(index + value) + k bytes. Native (torch.distributed) backends send the parts separately.
* The local selection and the residual update run in ``start`` (the caller's thread); only the
  restore of dropped values waits for ``finish``. Density 1 (k == n) is a dense allreduce,
  with one rank nothing is sent.
* ``algorithm="allgather"`` is the oracle/fallback (docs/gtopk.md#allgather-oracle): allgather all P leaf lists
  (O(kP)) and simulate the same merge tree locally, bit-identical to recursive doubling.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..buckets import Bucket
from ..comm.communicator import CountingLink
from ..compress.selector import Density
from ..compress.topk import TopKSelector
from ..errors import ConfigError
from ..fusion.pricing import Pricing, sparse_pricing
from ..memory.base import Memory
from ..memory.error_feedback import ErrorFeedback
from ..select.fixed import device_route, member_of_sorted, merge_fixed
from ..tensor_ops import TensorOps
from .base import Pending, ReduceContext, RoundInfo
from .sparse import PendingSelection, SparseReducer, index_dtype_for

__all__ = ["GTopK", "merge", "gtopk_exchange", "gtopk_simulate"]

ALGORITHMS = ("recursive_doubling", "allgather")


def merge(ops: TensorOps, first: tuple[Any, Any], second: tuple[Any, Any], k: int,
          n: int | None = None) -> tuple[Any, Any]:
    """M(first, second): union with summed values, then top-k (ties to the smaller index). With
    ``n`` (the bucket's size): the device route's fixed-capacity merge, the same bits
    (docs/gtopk.md#merge-fixed)."""
    if n is not None:
        return merge_fixed(ops, first, second, k, n)
    u, s = ops.unique_sum(ops.cat([first[0], second[0]]), ops.cat([first[1], second[1]]))
    if ops.numel(u) <= k:
        return u, s
    _, pos = ops.topk_abs(s, k)  # u is ascending, so lower position = smaller index
    return ops.gather(u, pos), ops.gather(s, pos)


def _survive(ops: TensorOps, tracked: list[list[Any]], merged_idx: Any, fixed: bool = False) -> None:
    """Keep, for each tracked (orig indices, alive positions), the positions still in the set;
    ``fixed`` (the device route): alive is a bool mask of the k entries, ANDed with membership."""
    for t in tracked:
        orig, alive = t
        if fixed:
            t[1] = ops.where(alive, member_of_sorted(ops, orig, merged_idx), alive)
        elif ops.numel(alive):  # merged_idx is ascending: a binary search, not a sort-based isin
            t[1] = ops.gather(alive, ops.nonzero(member_of_sorted(ops, ops.gather(orig, alive), merged_idx)))


def _all_alive(ops: TensorOps, k: int, like: Any, fixed: bool) -> Any:
    """Every one of k entries alive: positions 0..k-1, or (fixed) a mask of k True."""
    all_k = ops.arange(k, like=like)
    return ops.compare(all_k, "ge", 0) if fixed else all_k


def _layout(size: int) -> tuple[int, int]:
    m = 1 << (size.bit_length() - 1)  # largest power of two <= size
    return m, size - m


class _Wire:
    """(indices, values[, mask]) messages between two ranks over a :class:`CountingLink`."""

    def __init__(self, link: CountingLink, ops: TensorOps, idx: Any, vals: Any, k: int, index_dtype: str):
        self.link, self.ops, self.k, self.idt = link, ops, k, index_dtype
        self.like_i, self.like_v = idx, vals
        self.host = link.host  # host buffers: one packed message per round instead of three
        if self.host:
            self.np_idt = np.dtype(index_dtype)
            self.np_vdt = np.asarray(ops.to_numpy(vals)).dtype  # bf16 travels as uint16 bits

    def _pack(self, parts: Sequence[Any]) -> Any:
        ops = self.ops
        arrays = [np.ascontiguousarray(ops.to_numpy(ops.cast(parts[0], self.idt))),
                  np.ascontiguousarray(ops.to_numpy(parts[1]))]
        if len(parts) > 2:
            arrays.append(np.ascontiguousarray(ops.to_numpy(parts[2])))
        return np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])

    def _unpack(self, buf: np.ndarray, with_mask: bool) -> tuple[Any, ...]:
        ops, k = self.ops, self.k
        ib, vb = k * self.np_idt.itemsize, k * self.np_vdt.itemsize
        idx = ops.cast(ops.from_numpy(buf[:ib].view(self.np_idt).copy(), like=self.like_i), "int64")
        vals = ops.from_numpy(buf[ib:ib + vb].view(self.np_vdt).copy(), like=self.like_v)
        if not with_mask:
            return idx, vals
        return idx, vals, ops.from_numpy(buf[ib + vb:ib + vb + k].copy(), like=self.like_i)

    def exchange(self, send: Sequence[Any] | None, dest: int, source: int, with_mask: bool = False):
        """Send ``send`` to dest and/or receive from source (-1 = none); the received parts."""
        ops, link = self.ops, self.link
        if self.host:
            out = link.sendrecv(self._pack(send) if send is not None else np.empty(0, np.uint8), dest, source)
            return None if source < 0 else self._unpack(out, with_mask)
        likes = [ops.empty(0, self.idt, like=self.like_i), ops.empty(0, ops.dtype_name(self.like_v), like=self.like_v)]
        parts = None if send is None else [ops.cast(send[0], self.idt), send[1]]
        if with_mask:
            likes.append(ops.empty(0, "uint8", like=self.like_i))
            parts = None if send is None else parts + [send[2]]
        # every message holds k entries: the receiver knows its size (no size message, no read of it)
        got = [link.sendrecv_sized(parts[i] if parts is not None else likes[i], dest, source, self.k)
               for i in range(len(likes))]
        if source < 0:
            return None
        got[0] = ops.cast(got[0], "int64")
        return tuple(got)


def gtopk_exchange(link: CountingLink, ops: TensorOps, idx: Any, vals: Any, k: int,
                   index_dtype: str = "int32", n: int | None = None) -> tuple[Any, Any, Any]:
    """Recursive-doubling gTop-k with fold/unfold. Returns (I, V, alive positions of my k).

    With ``n`` (the bucket's size; the device route, docs/gtopk.md#merge-fixed): the fixed-capacity
    merge, and "alive" is a bool mask of my k entries; no step waits for the data."""
    size, rank = link.size, link.rank
    fixed = n is not None
    m, rem = _layout(size)
    wire = _Wire(link, ops, idx, vals, k, index_dtype)
    if rank >= m:  # folded away: hand my list to rank - m, get the result and my mask back
        wire.exchange((idx, vals), rank - m, -1)
        I, V, mask = wire.exchange(None, -1, rank - m, with_mask=True)
        alive = ops.cast(mask, "bool")
        return I, V, alive if fixed else ops.nonzero(alive)
    tracked = [[idx, _all_alive(ops, k, idx, fixed)]]
    I, V = idx, vals
    if rank < rem:
        pi, pv = wire.exchange(None, -1, rank + m)
        tracked.append([pi, _all_alive(ops, k, idx, fixed)])
        I, V = merge(ops, (I, V), (pi, pv), k, n)
        _survive(ops, tracked, I, fixed)
    d = 1
    while d < m:
        peer = rank ^ d
        pi, pv = wire.exchange((I, V), peer, peer)
        I, V = merge(ops, (I, V), (pi, pv), k, n) if rank < peer else merge(ops, (pi, pv), (I, V), k, n)
        _survive(ops, tracked, I, fixed)
        d <<= 1
    if rank < rem:
        if fixed:
            mask = ops.cast(tracked[1][1], "uint8")
        else:
            mask = ops.index_fill(ops.zeros(k, "uint8", like=idx), tracked[1][1], 1)
        wire.exchange((I, V, mask), rank + m, -1, with_mask=True)
    return I, V, tracked[0][1]


def gtopk_simulate(ops: TensorOps, leaves: Sequence[tuple[Any, Any]], k: int,
                   n: int | None = None) -> tuple[Any, Any, list[Any]]:
    """The allgather-and-simulate oracle (docs/gtopk.md#allgather-oracle): the same merge tree over all P leaf lists.

    Returns (I, V, [alive positions of each rank's k entries]); with ``n``, the device route's
    fixed-capacity merge and alive masks (as :func:`gtopk_exchange`).
    """
    size = len(leaves)
    fixed = n is not None
    m, rem = _layout(size)
    tracked = [[leaf[0], _all_alive(ops, ops.numel(leaf[0]), leaf[0], fixed)] for leaf in leaves]
    # node j holds (I, V, the ranks whose contributions it carries)
    nodes = []
    for j in range(m):
        if j < rem:
            I, V = merge(ops, leaves[j], leaves[m + j], k, n)
            members = [j, m + j]
            _survive(ops, [tracked[r] for r in members], I, fixed)
        else:
            (I, V), members = leaves[j], [j]
        nodes.append((I, V, members))
    while len(nodes) > 1:
        nxt = []
        for a, b in zip(nodes[0::2], nodes[1::2]):
            I, V = merge(ops, a[:2], b[:2], k, n)
            members = a[2] + b[2]
            _survive(ops, [tracked[r] for r in members], I, fixed)
            nxt.append((I, V, members))
        nodes = nxt
    I, V, _ = nodes[0]
    return I, V, [t[1] for t in tracked]


class GTopK(SparseReducer):
    """gTop-k reducer (see the module docstring).

    Args:
        density: fraction of each bucket sent (float, per-layer dict or callable); k per bucket
            is ``max(int(n·density), 1)``.
        error_feedback: keep unsent and dropped values in a residual (default True).
        memory: another memory instead (``DGCMemory``: momentum correction, docs/topk.md#momentum-correction).
        min_k: the fewest elements a bucket sends (docs/topk.md#density-floor).
        dense_1d: send 1-D tensors whole, in buckets of their own (docs/topk.md#dense-1d).
        index_dtype: "int32", "int64" or None (int32 when it can hold every index).
        algorithm: "recursive_doubling" (default) or "allgather" (oracle/fallback, O(kP)).
        dense_when_full: density 1 buckets use a dense allreduce.

    Example::

        opt = DistributedOptimizer(opt, model.named_parameters(),
                                   compression=Compression.gtopk(density=0.001))
    """

    name = "gtopk"

    def __init__(self, density: Density = 0.001, error_feedback: bool = True, index_dtype: str | None = None,
                 algorithm: str = "recursive_doubling", dense_when_full: bool = True, memory: Memory | None = None,
                 min_k: int = 1, dense_1d: bool = True):
        if algorithm not in ALGORITHMS:
            raise ConfigError(f"gTop-k algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        super().__init__(TopKSelector(density, min_k=min_k, dense_1d=dense_1d), memory if memory is not None else ErrorFeedback(error_feedback),
                         index_dtype, dense_when_full)
        self.algorithm = algorithm

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm = ctx.ops, ctx.comm
        sel = self.select(bucket, rnd, flat, ctx)  # all k count as sent for now; finish() restores the dropped
        if isinstance(sel, Pending):
            return sel
        vals, idx, n = sel
        k = ops.numel(idx)
        name = rnd.wire(bucket)
        if comm.size == 1:
            return Pending(name, PendingSelection(idx, vals, n, bucket.name, local=True))
        idt = index_dtype_for(n, self.index_dtype)
        fixed = n if device_route(ops, vals) else None  # the device route (docs/gtopk.md#merge-fixed)
        if self.algorithm == "allgather":
            fn = self._allgather_fn(ops, idx, vals, k, idt, fixed)
        else:
            def fn(link: CountingLink, deadline: float) -> tuple[Any, Any, Any]:
                return gtopk_exchange(link, ops, idx, vals, k, idt, fixed)
        handle = comm.run_async(fn, name=f"{name}.gtopk", op="gtopk")
        return Pending(name, PendingSelection(idx, vals, n, bucket.name, step=rnd.step), (handle,))

    @staticmethod
    def _allgather_fn(ops: TensorOps, idx: Any, vals: Any, k: int, idt: str, fixed: int | None = None):
        def fn(link: CountingLink, deadline: float) -> tuple[Any, Any, Any]:
            ai, _ = link.allgather_tensor(ops, ops.cast(idx, idt))
            av, _ = link.allgather_tensor(ops, vals)
            ai = ops.cast(ai, "int64")
            leaves = [(ops.slice(ai, r * k, (r + 1) * k), ops.slice(av, r * k, (r + 1) * k)) for r in range(link.size)]
            I, V, alive = gtopk_simulate(ops, leaves, k, fixed)
            return I, V, alive[link.rank]
        return fn

    def exchanged(self, pending: Pending, ctx: ReduceContext) -> tuple[Any, Any]:
        st, ops = pending.state, ctx.ops
        I, V, alive = ctx.comm.wait(pending.handles[0])
        if ops.dtype_name(alive) == "bool":  # the device route's mask: restore all k, +0.0 where alive
            self.restore_not_alive(ops, st, alive)
            return I, V
        # the positions not alive, ascending: a k-entry mask (O(k)), not a sort-based isin
        kept = ops.index_fill(ops.zeros(ops.numel(st.idx), "uint8", like=st.idx), alive, 1)
        dropped = ops.nonzero(ops.compare(kept, "lt", 1))
        self.restore_dropped(ops, st, dropped)
        return I, V

    def config(self) -> dict:
        return {**super().config(), "algorithm": self.algorithm}

    def price(self, cost: Any, select_s: float | None = None, select_c0: float = 0.0) -> Pricing:
        return sparse_pricing(cost, "gtopk", self.density, select_s, select_c0)

    def __repr__(self) -> str:
        return f"GTopK(density={self.compressor.density!r}, algorithm={self.algorithm!r}, {self.memory!r})"
