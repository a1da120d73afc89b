"""Adasum: adaptive summation of gradients by recursive vector halving / distance doubling.

Paper: Maleki, Musuvathi, Mytkowicz, Saarikivi, Xu, Eksarevskiy, Ekanayake, Barsoum, "Scaling
Distributed Training with Adaptive Summation", MLSys 2021 (arXiv:2006.02924); Horovod ships it as
``op=hvd.Adasum``. docs/adasum.md#adasum.

The pairwise operator, per tensor (layer) of the bucket (docs/adasum.md#closed-form)::

    adasum(a, b) = (1 - a·b / (2|a|²)) a + (1 - a·b / (2|b|²)) b

(a coefficient is 1 when its norm² is below 1e-8, as in Horovod). Orthogonal gradients are
summed, identical gradients averaged (T-AS-1, T-AS-2).

Algorithm over P = 2^L ranks (docs/adasum.md#halving-doubling)::

    range = [0, n); a level l = 0 .. L-1, d = 2^l, partner p = rank XOR d:
        split range at mid = lo + (hi-lo)//2; the lower rank of the pair keeps [lo, mid),
        the upper [mid, hi); each sends the other half of its vector to p
        a = lower subtree's values on the kept range, b = upper subtree's
        per tensor: (a·b, |a|², |b|²) on the kept range, summed over the 2d ranks of the group
            by recursive doubling (identical sums on all of them, IEEE addition commutes)
        fragment = ca·a + cb·b on the kept range
    allgather the fragments back by distance halving (l = L-1 .. 0): exchange with rank XOR 2^l,
    concatenate (lower rank's fragment first)

Traffic per rank: 2n(P-1)/P elements (as a ring allreduce) plus 3 float64 per tensor and group
round (L(L+1)/2 rounds).

Choices:

* Dots and norms are accumulated in float64 on the host (Horovod accumulates in double);
  the combination runs in the tensor's dtype through TensorOps.
* Not a power of two (docs/adasum.md#non-power-of-two): ranks m+j (m = 2^floor(log2 P)) first
  send their whole vector to rank j, which combines adasum(own, received) locally; the m ranks
  run the algorithm above; rank j sends the result back to m+j. The operator tree is then
  unbalanced (ranks j < P-m sit one level deeper), documented rather than refused.
* Runs on the communicator's progress thread (:meth:`Communicator.run_async`), like gTop-k.
* Works on the payload of a cast compressor (none/fp16/bf16); summable-only compressors
  (ternary) and sparse reducers cannot be combined with Adasum.
* :func:`adasum_tree` computes the same operator tree locally from all P vectors (the oracle
  of the tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..buckets import Bucket
from ..comm.communicator import CountingLink, from_wire, to_wire
from ..compress.base import Compressor
from ..compress.cast import NoneCompressor
from ..errors import ConfigError
from .base import Pending, ReduceContext, Reducer, RoundInfo

__all__ = ["AdasumReducer", "make_adasum_reducer", "adasum_pair", "adasum_exchange", "adasum_tree", "tensor_bounds",
           "coefficients"]

# Horovod's threshold below which a norm² counts as zero (its coefficient is then 1).
NORM_EPS = 1e-8
_CAST_COMPRESSORS = ("none", "fp16", "bf16")


def tensor_bounds(bucket: Bucket) -> list[tuple[int, int]]:
    """[start, stop) of every member tensor in the bucket's flat buffer."""
    out = []
    for off, shape in zip(bucket.offsets, bucket.shapes):
        n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        out.append((off, off + n))
    return out


def coefficients(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ca, cb) per tensor from rows (a·b, |a|², |b|²) (docs/adasum.md#closed-form)."""
    dot, na, nb = sums[:, 0], sums[:, 1], sums[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        ca = np.where(na >= NORM_EPS, 1.0 - dot / (2.0 * na), 1.0)
        cb = np.where(nb >= NORM_EPS, 1.0 - dot / (2.0 * nb), 1.0)
    return ca, cb


def _host64(ops: Any, t: Any) -> np.ndarray:
    return np.asarray(ops.to_numpy(ops.cast(t, "float64")), dtype=np.float64).reshape(-1)


def _partials(ops: Any, a: Any, b: Any, lo: int, hi: int, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
    """Rows (a·b, |a|², |b|²) per tensor over the part of [lo, hi) it covers (zeros elsewhere)."""
    A, B = _host64(ops, a), _host64(ops, b)
    out = np.zeros((len(bounds), 3), dtype=np.float64)
    for t, (s, e) in enumerate(bounds):
        s, e = max(s, lo), min(e, hi)
        if s < e:
            x, y = A[s - lo:e - lo], B[s - lo:e - lo]
            out[t] = (np.dot(x, y), np.dot(x, x), np.dot(y, y))
    return out


def _combine(ops: Any, a: Any, b: Any, lo: int, hi: int, bounds: Sequence[tuple[int, int]],
             ca: np.ndarray, cb: np.ndarray) -> Any:
    """ca_t·a + cb_t·b on [lo, hi), each element scaled by its tensor's coefficients."""
    if hi <= lo:
        return a
    va, vb = np.empty(hi - lo, np.float64), np.empty(hi - lo, np.float64)
    for t, (s, e) in enumerate(bounds):
        s, e = max(s, lo), min(e, hi)
        if s < e:
            va[s - lo:e - lo], vb[s - lo:e - lo] = ca[t], cb[t]
    dtype = ops.dtype_name(a)
    # the coefficient vectors in the tensor's dtype (via float32 for the half types)
    host = np.float64 if dtype == "float64" else np.float32
    ta = ops.cast(ops.from_numpy(va.astype(host), like=a), dtype)
    tb = ops.cast(ops.from_numpy(vb.astype(host), like=b), dtype)
    return ops.add(ops.mul(a, ta), ops.mul(b, tb))


def adasum_pair(ops: Any, a: Any, b: Any, bounds: Sequence[tuple[int, int]]) -> Any:
    """adasum(a, b) of two whole flat buffers, per tensor (no communication)."""
    n = ops.numel(a)
    ca, cb = coefficients(_partials(ops, a, b, 0, n, bounds))
    return _combine(ops, a, b, 0, n, bounds, ca, cb)


def adasum_tree(ops: Any, vectors: Sequence[Any], bounds: Sequence[tuple[int, int]]) -> Any:
    """The operator tree the distributed algorithm computes, evaluated locally (test oracle):
    fold ranks m+j into j, then pair neighbours level by level (docs/adasum.md#halving-doubling)."""
    size = len(vectors)
    m = 1 << (size.bit_length() - 1)
    nodes = [adasum_pair(ops, vectors[j], vectors[m + j], bounds) if j < size - m else vectors[j] for j in range(m)]
    while len(nodes) > 1:
        nodes = [adasum_pair(ops, x, y, bounds) for x, y in zip(nodes[0::2], nodes[1::2])]
    return nodes[0]


class _Link:
    """Framework tensors and float64 host arrays over a CountingLink's pairwise sendrecv."""

    def __init__(self, link: CountingLink, ops: Any, like: Any):
        self.link, self.ops, self.like = link, ops, like

    def tensor(self, t: Any, peer: int) -> Any:
        kind = self.link.buffer_kind
        got = self.link.sendrecv(to_wire(kind, self.ops, t), peer, peer)
        return from_wire(kind, self.ops, got, t)

    def host(self, arr: np.ndarray, peer: int) -> np.ndarray:
        if self.link.host:
            return np.asarray(self.link.sendrecv(np.ascontiguousarray(arr).reshape(-1), peer, peer)).reshape(arr.shape)
        t = self.ops.from_numpy(np.ascontiguousarray(arr).reshape(-1), like=self.like)
        return _host64(self.ops, self.link.sendrecv(t, peer, peer)).reshape(arr.shape)


def adasum_exchange(link: CountingLink, ops: Any, flat: Any, bounds: Sequence[tuple[int, int]]) -> Any:
    """Adasum of every rank's ``flat`` (same length everywhere); the same result on every rank."""
    size, rank = link.size, link.rank
    m = 1 << (size.bit_length() - 1)
    rem = size - m
    wire = _Link(link, ops, flat)
    n = ops.numel(flat)
    if rank >= m:  # folded away (docs/adasum.md#non-power-of-two)
        link.sendrecv(to_wire(link.buffer_kind, ops, flat), rank - m, -1)
        got = link.sendrecv(to_wire(link.buffer_kind, ops, ops.empty(0, ops.dtype_name(flat), like=flat)),
                            -1, rank - m)
        return from_wire(link.buffer_kind, ops, got, flat)
    if rank < rem:
        got = link.sendrecv(to_wire(link.buffer_kind, ops, ops.empty(0, ops.dtype_name(flat), like=flat)),
                            -1, rank + m)
        flat = adasum_pair(ops, flat, from_wire(link.buffer_kind, ops, got, flat), bounds)
    frag, lo, hi = flat, 0, n
    levels = m.bit_length() - 1
    for level in range(levels):
        d = 1 << level
        peer = rank ^ d
        mid = lo + (hi - lo) // 2
        first, second = ops.slice(frag, 0, mid - lo), ops.slice(frag, mid - lo, hi - lo)
        if rank < peer:
            a, b = first, wire.tensor(ops.clone(second), peer)
            hi = mid
        else:
            a, b = wire.tensor(ops.clone(first), peer), second
            lo = mid
        sums = _partials(ops, a, b, lo, hi, bounds)
        step = 1
        while step <= d:  # recursive doubling over the group of 2d ranks sharing the upper bits
            sums = sums + wire.host(sums, rank ^ step)
            step <<= 1
        frag = _combine(ops, a, b, lo, hi, bounds, *coefficients(sums))
    for level in range(levels - 1, -1, -1):
        peer = rank ^ (1 << level)
        other = wire.tensor(frag, peer)
        frag = ops.cat([frag, other] if rank < peer else [other, frag])
    if rank < rem:
        link.sendrecv(to_wire(link.buffer_kind, ops, frag), rank + m, -1)
    return frag


@dataclass
class _Adasum:
    payload: Any  # the compressed local vector (the result when nothing was sent)
    cctx: Any
    post: float


class AdasumReducer(Reducer):
    """``op=Adasum``: the bucket is combined by Adasum instead of summed (module docstring).

    Args:
        compressor: a cast compressor (``Compression.none``/``fp16``/``bf16``); the operator
            runs on the payload's dtype with float64 dots.

    With one rank the local bucket is returned (scaled).
    """

    name = "adasum"

    def __init__(self, compressor: Compressor | None = None):
        self.compressor = compressor or NoneCompressor()
        if not isinstance(self.compressor, Compressor) or self.compressor.name not in _CAST_COMPRESSORS:
            raise ConfigError(f"op=Adasum takes Compression.none, fp16 or bf16, got {self.compressor!r}: Adasum "
                              f"combines floating vectors, it cannot run on quantized or sparse payloads")

    def start(self, bucket: Bucket, rnd: RoundInfo, flat: Any, ctx: ReduceContext) -> Pending:
        ops, comm = ctx.ops, ctx.comm
        name = rnd.wire(bucket)
        if ctx.prescale != 1.0:
            flat = ops.scale(flat, ctx.prescale)
        payload, cctx = self.compressor.compress(ops, flat)
        state = _Adasum(payload, cctx, ctx.postscale)
        if comm.size == 1:
            return Pending(name, state)
        bounds = tensor_bounds(bucket)

        def fn(link: CountingLink, deadline: float) -> Any:
            return adasum_exchange(link, ops, payload, bounds)
        return Pending(name, state, (comm.run_async(fn, name=f"{name}.adasum", op="adasum"),))

    def finish(self, pending: Pending, ctx: ReduceContext) -> Any:
        st: _Adasum = pending.state
        payload = ctx.comm.wait(pending.handles[0]) if pending.handles else st.payload
        out = self.compressor.decompress(ctx.ops, payload, st.cctx)
        return ctx.ops.scale(out, st.post) if st.post != 1.0 else out

    def config(self) -> dict:
        return {"reducer": self.name, "compressor": self.compressor.config()}

    def __repr__(self) -> str:
        return f"AdasumReducer({self.compressor!r})"


def make_adasum_reducer(compression: Compressor | None = None) -> AdasumReducer:
    """The reducer for ``op=Adasum`` (the tensor collectives' entry point)."""
    return AdasumReducer(compression)
