"""``Compression.quantize(bits)``: low-bit exchange with error feedback (docs/quantize.md#exchange).

Dense (``density=None``), the shape of ZeRO++'s qgZ and torchft's quantised allreduce: the
compensated bucket ``acc = g + r`` is cut into P parts; part j is quantised and sent to rank j
(an all-to-all: the reduce-scatter's traffic, ``(P-1)/P`` of the bucket at ``bits`` bits); rank j
decodes the P parts it received, sums them in float32 in rank order, quantises the sum once more
and all-gathers it. Every rank decodes the same bytes, so every rank holds the same result, and
the error is at most two quantisations (each contribution's, and the owner's of the sum) however
many ranks there are, where a ring of requantising hops would add P-1.

Sparse (``density=rho``), SparseLoCo's recipe (top-k with 2-bit values and error feedback,
docs/quantize.md#sparseloco): the top ``k = ceil(rho*n)`` entries of ``acc`` by magnitude, their
values quantised, are all-gathered as (int32 indices, scales, codes); every rank decodes and adds
all P contributions in rank order: one quantisation.

Error feedback keeps ``r = acc - decode(sent)`` (the first quantisation, and for top-k what was not
selected): ``sent + r == acc`` exactly (docs/quantize.md#invariants). The owner's requantisation
of a sum is not fed back (it is a different vector on each owner; the bound above covers it).
Everything runs through the tensor ops (:mod:`hvd_commopt.compress.quantize`): a CUDA bucket is
selected, quantised, packed, decoded and summed on its device (docs/quantize.md#device).

SparseLoCo's own settings are options: ``chunk=C`` picks the top-k per chunk of C elements of
each tensor (:mod:`hvd_commopt.compress.chunked`; positions travel as their offsets inside their chunk,
packed in as few bits as the chunk needs, docs/quantize.md#chunked, docs/quantize.md#offsets) and ``ef_decay=beta`` scales the residual by beta before it is
added (``e = beta e + Delta``, docs/quantize.md#ef-decay). ``mean_over="senders"`` averages each
coordinate over the ranks whose selection holds it, not over all P, the rule of SparseLoCo's code
(DeMo's and templar's ``scatter_reduce(..., "mean", include_self=False)``;
docs/quantize.md#mean-over-senders).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import math

import numpy as np

from ..buckets import Bucket
from ..compress import nonfinite
from ..compress.chunked import (ChunkLayout, check_chunk, chunk_plan, member_sizes, offset_bytes, pack_offsets,
                                unpack_offsets)
from ..compress.quantize import (DEFAULT_BLOCK, check_bits, decode, decode_parts, decode_sum, encode, encode_parts,
                                 encode_payload, encoded_bytes)
from ..compress.selector import check_density
from ..errors import ConfigError
from ..fusion.pricing import Pricing, dense_pricing
from ..memory.base import Memory
from ..memory.error_feedback import ErrorFeedback
from ..tensor_ops import TensorOps
from .base import Pending, ReduceContext, Reducer, RoundInfo

__all__ = ["QuantizedAllreduce", "split_counts", "MEAN_OVER"]

MEAN_OVER = ("ranks", "senders")


def split_counts(n: int, parts: int) -> list[int]:
    """n elements in ``parts`` near-equal contiguous parts (the first ``n % parts`` one longer)."""
    return [n // parts + (1 if j < n % parts else 0) for j in range(parts)]


@dataclass
class _Quant:
    n: int
    counts: list[int]  # elements per part (dense) or None-equivalent [] (sparse)
    like: Any          # the bucket's flat: where the result is placed
    post: float
    local: Any = None  # one rank: the decoded contribution is the result
    layout: ChunkLayout | None = None  # chunk-wise top-k: the bucket's chunks and their maps
    bucket: str = ""   # the bucket's name: its buffers (QuantizedAllreduce._work_for)


class QuantizedAllreduce(Reducer):
    """Low-bit quantised allreduce (dense) or quantised top-k allgather (sparse), with EF.

    Args:
        bits: 2..8 bits per value (8 = int8, 4 = int4, 2 = ternary).
        density: None (dense) or the fraction of each bucket sent as quantised top-k.
        block: elements per float32 scale.
        error_feedback: keep what quantisation (and selection) dropped for the next round.
        nonfinite: "skip" or "raise" (docs/wrapper.md#nonfinite).
        chunk: with ``density``, the top-k of every chunk of this many elements of each tensor
            (SparseLoCo: 4096) instead of the whole bucket's; None (default) the whole bucket's.
        ef_decay: the error feedback's decay beta in (0, 1] (SparseLoCo: 0.95); 1 (default) none.
        mean_over: with ``density``, "ranks" (default) scales the sum of the P contributions by
            the context's postscale (1/P for an average); "senders" scales each coordinate by
            ``postscale * P / c`` instead, c the number of ranks that sent it (for an average: the
            mean over the senders, SparseLoCo's rule).
        memory: the memory to use instead of a fresh :class:`ErrorFeedback` (``compression="auto"``
            passes its shared momentum-correction memory, docs/auto-compression.md#quantised);
            its ``update_quantized`` keeps ``acc - sent``. Dense exchange only.
        whole_round_alone: on one rank, run the whole exchange (the owner's decode, sum and second
            quantisation, and the decode of the gathered parts) instead of returning the first
            quantisation: what ``auto`` times as the method's compute (docs/auto-compression.md#quantised).
    """

    name = "quantize"
    holds_rank_state = True

    def __init__(self, bits: int, density: float | None = None, block: int = DEFAULT_BLOCK, error_feedback: bool = True,
                 nonfinite: str = "skip", chunk: int | None = None, ef_decay: float = 1.0,
                 mean_over: str = "ranks", memory: Memory | None = None, whole_round_alone: bool = False):
        self.bits, self.block = check_bits(bits, block)
        self.rho = None if density is None else float(check_density(density))
        self.chunk = check_chunk(chunk)
        if self.chunk is not None and self.rho is None:
            raise ConfigError(f"chunk={chunk} chooses the top-k per chunk, so it needs a density: pass e.g. "
                              f"Compression.quantize({bits}, density=0.01, chunk={chunk}), or drop chunk for the "
                              f"dense quantised exchange")
        if mean_over not in MEAN_OVER:
            raise ConfigError(f"mean_over must be 'ranks' (the sum over all P ranks, scaled as the op asks) or "
                              f"'senders' (each coordinate averaged over the ranks that sent it), got {mean_over!r}")
        if mean_over == "senders" and self.rho is None:
            raise ConfigError(f"mean_over='senders' averages a sparse exchange over the ranks that sent each value, "
                              f"so it needs a density: pass e.g. Compression.quantize({bits}, density=0.01, "
                              f"mean_over='senders'); the dense exchange has every rank send every value")
        self.mean_over = mean_over
        if memory is not None and self.rho is not None:
            raise ConfigError("a quantiser with a memory of its own choosing is the dense exchange only; "
                              "drop density or memory")
        own = ErrorFeedback(error_feedback, nonfinite, decay=ef_decay)
        self.ef_decay = own.decay
        self.memory: Memory = own if memory is None else memory
        self.whole_round_alone = bool(whole_round_alone) and self.rho is None
        self._layouts: dict[tuple[int, ...], ChunkLayout] = {}  # planned once per bucket layout
        self._scales: dict[tuple[str, str, float, int], Any] = {}  # _senders_scale, uploaded once per device
        self._work: dict[str, Any] = {}  # per bucket: the decoded values' buffer (_work_for)

    @property
    def density(self) -> float | None:
        return self.rho

    def _k(self, n: int) -> int:
        assert self.rho is not None
        return min(n, max(1, int(math.ceil(self.rho * n))))

    def _layout(self, bucket: Bucket, n: int) -> ChunkLayout:
        """The chunk-wise top-k's plan for this bucket's layout, made once (docs/quantize.md#batched-topk)."""
        assert self.chunk is not None and self.rho is not None
        sizes = tuple(member_sizes(bucket, n))
        if sizes not in self._layouts:
            self._layouts[sizes] = ChunkLayout(chunk_plan(sizes, self.chunk, self.rho))
        return self._layouts[sizes]

    def _work_for(self, ops: TensorOps, name: str, n: int, like: Any) -> Any:
        """A float32 host buffer of n elements, made once per ``name`` and size, for the host
        kernels to write into: bucket ``name``'s decoded values, read by the memory's update within
        :meth:`start`, or its owned part's sum (``name:part``), read by the second quantisation
        within the same call. None for a device tensor (its kernels make their own results)."""
        if ops.on_device(like):
            return None
        buf = self._work.get(name)
        if buf is None or ops.numel(buf) != n or ops.device_name(buf) != ops.device_name(like):
            buf = self._work[name] = ops.empty(n, "float32", like=like)
        return buf

    def _senders_scale_on(self, ops: TensorOps, like: Any, post: float, size: int) -> Any:
        """:func:`_senders_scale` on like's device, uploaded once (not a host copy every round)."""
        key = (ops.name, ops.device_name(like), post, size)
        if key not in self._scales:
            self._scales[key] = ops.from_numpy(_senders_scale(post, size), like=like)
        return self._scales[key]

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm = ctx.ops, ctx.comm
        if ops.dtype_name(flat) != "float32":
            raise ConfigError(f"Compression.quantize works on float32 buckets; bucket {bucket.name!r} is "
                              f"{ops.dtype_name(flat)}: train in float32 (AMP keeps float32 gradients)")
        if ctx.prescale != 1.0:
            flat = ops.scale(flat, ctx.prescale)
        self.memory.snapshot(ops, bucket.name, flat, rnd.step)
        if ops.all_finite(flat):
            acc = self.memory.compensate(ops, bucket.name, flat)
        else:  # the memory never sees it; the NaN travels, so every rank sees a non-finite result
            nonfinite.report(self.memory.nonfinite, comm.rank, bucket.name)
            self.memory.skip(bucket.name)
            acc = flat
        x = ops.flatten(acc)
        n, size = ops.numel(x), comm.size
        st = _Quant(n, [], flat, ctx.postscale, bucket=bucket.name)
        if self.rho is not None and self.chunk is not None:
            st.layout = self._layout(bucket, n)
            idx, local = st.layout.select(ops, x)
            payload, dec = encode(ops, ops.gather(x, idx), self.bits, self.block)
            sent = ops.index_copy(ops.zeros(n, "float32", like=x), idx, dec)
            msg = ops.cat([pack_offsets(ops, local, st.layout.bits), payload])
        elif self.rho is not None:
            k = self._k(n)
            idx = ops.topk_abs(x, k)[1] if k < n else ops.arange(n, like=x)  # ascending, ties to the lower index
            payload, dec = encode(ops, ops.gather(x, idx), self.bits, self.block)
            sent = ops.index_copy(ops.zeros(n, "float32", like=x), idx, dec)
            msg = ops.cat([ops.as_bytes(ops.cast(idx, "int32")), payload])
        else:
            st.counts = split_counts(n, size)
            # the decoded values only feed the memory's update when the round is exchanged: then into a
            # buffer of this bucket's, reused (docs/quantize.md#native); alone they are the result
            work = self._work_for(ops, bucket.name, n, x) if size > 1 or self.whole_round_alone else None
            msg, sent = encode_parts(ops, x, st.counts, self.bits, self.block, dec_into=work)
        if ops.all_finite(acc):
            self.memory.update_quantized(ops, bucket.name, acc, ops.reshape(sent, ops.shape(acc)))
        if size == 1 and not self.whole_round_alone:
            st.local = sent
            return Pending(rnd.wire(bucket), st)
        wire = msg
        name = rnd.wire(bucket)
        if self.rho is not None:
            h = comm.allgather_tensor_async(ops, wire, f"{name}:qag", equal=True)
        else:
            h = comm.alltoall_tensor_async(ops, wire, [encoded_bytes(c, self.bits, self.block) for c in st.counts],
                                           f"{name}:qrs")
        return Pending(name, st, (h,))

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        ops, comm, st = ctx.ops, ctx.comm, pending.state
        if st.local is not None:
            out = st.local
        elif self.rho is not None:
            buf, _ = comm.wait(pending.handles[0])
            out, counts = self._sum_sparse(ops, buf, st, comm.size)
            if counts is not None:  # each coordinate times post * P / (ranks that sent it), one rounding
                return ops.mul(out, ops.gather(self._senders_scale_on(ops, out, st.post, comm.size), counts))
        else:
            out = self._reduce_scatter_allgather(pending, ctx, st)
        if st.post != 1.0:
            out = ops.scale(out, st.post)
        return out

    def _sum_sparse(self, ops: TensorOps, buf: Any, st: _Quant, size: int) -> tuple[Any, Any]:
        """The sum of the P decoded contributions in rank order, and (``mean_over="senders"``) how
        many ranks sent each coordinate (int64), else None."""
        n = st.n
        lay = st.layout
        k = self._k(n) if lay is None else lay.k
        ib = 4 * k if lay is None else offset_bytes(k, lay.bits)  # index bytes per rank
        per = ib + encoded_bytes(k, self.bits, self.block)
        out = ops.zeros(n, "float32", like=st.like)
        counts = None if self.mean_over == "ranks" else ops.zeros(n, "int64", like=st.like)
        ones = None if counts is None else ops.shift(ops.zeros(k, "int64", like=st.like), 1)
        starts = None if lay is None else lay.starts_on(ops, st.like)
        for r in range(size):  # rank order: the same sum everywhere
            if starts is None:
                idx = ops.cast(ops.from_bytes(ops.slice(buf, r * per, r * per + 4 * k), "int32"), "int64")
            else:
                idx = ops.add(unpack_offsets(ops, ops.slice(buf, r * per, r * per + ib), k, lay.bits, starts), starts)
            vals = decode(ops, ops.slice(buf, r * per + ib, (r + 1) * per), k, self.bits, self.block)
            out = ops.scatter_add(out, idx, vals)
            if counts is not None:
                counts = ops.scatter_add(counts, idx, ones)
        return out, counts

    def _reduce_scatter_allgather(self, pending: Pending, ctx: ReduceContext, st: _Quant) -> Any:
        ops, comm = ctx.ops, ctx.comm
        recv, lens = comm.wait(pending.handles[0])
        mine, off, contributions = st.counts[comm.rank], 0, []
        for ln in lens:  # the P contributions to my part, in rank order
            contributions.append(ops.slice(recv, off, off + ln))
            off += ln
        part = decode_sum(ops, contributions, mine, self.bits, self.block,
                          into=self._work_for(ops, st.bucket + ":part", mine, st.like))
        payload = encode_payload(ops, part, self.bits, self.block)  # the second quantisation
        h = comm.allgather_tensor_async(ops, payload, f"{pending.name}:qag")
        got, sizes = comm.wait(h)
        return decode_parts(ops, got, st.counts, sizes, self.bits, self.block, st.like)

    def settle(self, bucket: Bucket, rnd: RoundInfo, out: Any, ctx: ReduceContext,
               pending: Pending | None = None, flags: tuple[bool, ...] | None = None) -> bool:
        if not ctx.ops.all_finite(out):
            self.rollback(bucket, rnd, ctx)
            return False
        return True

    def rollback(self, bucket: Bucket, rnd: RoundInfo, ctx: ReduceContext) -> None:
        self.memory.rollback(ctx.ops, bucket.name, rnd.step)

    def relayout(self, ops: TensorOps, old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
        self.memory.relayout(ops, old, new)
        self._work.clear()  # scratch of the old buckets: the new ones make theirs on first use

    def config(self) -> dict:
        return {"reducer": self.name, "bits": self.bits, "block": self.block, "density": self.rho,
                "chunk": self.chunk, "mean_over": self.mean_over, "memory": self.memory.config()}

    def price(self, cost: Any, select_s: float | None = None, select_c0: float = 0.0) -> Pricing:
        ratio = (self.bits / 8 + 4 / self.block) / 4
        if self.rho is not None:  # indices and codes of k entries from every rank (an allgather)
            index = 4 if self.chunk is None else (self.chunk - 1).bit_length() / 8
            ratio = self.rho * (index + self.bits / 8 + 4 / self.block) / 4
        return dense_pricing(cost, ratio, f"quantised {self.bits}-bit exchange ({ratio:.3g} of the bytes)")

    def state_dict(self) -> dict:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(dict(state.get("memory", {})))

    def __repr__(self) -> str:
        extra = ("" if self.chunk is None else f", chunk={self.chunk}") + \
            ("" if self.ef_decay == 1.0 else f", ef_decay={self.ef_decay}") + \
            ("" if self.mean_over == "ranks" else f", mean_over={self.mean_over!r}")
        return f"QuantizedAllreduce(bits={self.bits}, density={self.rho}, block={self.block}{extra})"


def _senders_scale(post: float, size: int) -> np.ndarray:
    """float32 ``post * size / c`` for c = 0..size senders (0 where none sent): the factor of the
    senders' mean, rounded once (for an average, post = 1/size: ``1/c``)."""
    return np.array([0.0] + [post * size / c for c in range(1, size + 1)], dtype=np.float64).astype(np.float32)
