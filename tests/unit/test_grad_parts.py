"""A bucket's gradients read where they are, unpacked (docs/selection.md#grad-parts).

The native top-k given the addend ``g`` as parts must return, write and count exactly what it does
given the packed bucket; the engine's route with unpacked gradients must give the reduced
gradients and the memory of the route that packs them, bit for bit, including every path that
packs them after all (predivide, non-finite gradients, missing gradients, selections that do not
read parts).
"""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, build_engine, run_ranks
from hvd_commopt.select import host_native
from hvd_commopt.select import host_numpy
from hvd_commopt.select.host import HostKernels
from hvd_commopt.select.kernels import kernels_for
from hvd_commopt.buckets import Bucket
from hvd_commopt.select.addend import MomentumAddend
from hvd_commopt.select.exact_topk import ExactTopK
from hvd_commopt.select.grad_parts import GradParts
from hvd_commopt.engine import TensorSpec

from .test_native_topk import SELECTORS, _data, _same

pytestmark = pytest.mark.skipif(not host_native.native_sweep(), reason="the native kernels were not built")


def _splits(n: int, how: str) -> list[int]:
    """Part boundaries: aligned blocks, odd sizes (parts not on a 32-byte boundary), an empty part."""
    if how == "one":
        return [0, n]
    if how == "aligned":
        return sorted({0, n, *range(0, n, 4096)})
    if how == "odd":
        return sorted({0, n, *range(0, n, 1237), *range(3, n, 5003)})
    return [0, 5, 5, n // 2 + 1, n]  # "empty": a zero-length part


def _select(sel, x, g, u, k, addend: str, use_out: bool, parts: str | None, ops=None):
    x, u = x.copy(), u.copy()
    out = np.full_like(x, 7.0) if use_out else None
    gg = g.copy()
    if parts is not None:
        cuts = _splits(x.size, parts)
        gg = GradParts(NumpyOps(), np.full_like(x, 3.0), [(a, g[a:b].copy()) for a, b in zip(cuts, cuts[1:])])
    add = {"plain": gg, "momentum": MomentumAddend(u, 0.9, gg, np.full_like(u, 5.0))}[addend]
    with np.errstate(all="ignore"):
        r = sel.select(ops or NumpyOps(), x, k, addend=add, out=out)
    made = add.made if addend == "momentum" else None
    return r, x, out, made, dict(sel.stats), gg


@pytest.mark.parametrize("selector", ["default", "lo_too_high", "no_retries", "low_bracket"])
@pytest.mark.parametrize("case", ["normal", "ties", "nan", "zeros", "scales"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("parts", ["one", "aligned", "odd", "empty"])
def test_parts_read_in_place_equal_the_packed_bucket(selector, case, dtype, parts):
    n = 70_001
    x, g, u = _data(case, n, dtype, 3)
    k = 700
    make = SELECTORS[selector]
    for addend in ("momentum",):  # the form the engine hands over (MomentumCorrection / DGCMemory)
        for use_out in (False, True):
            ra, xa, oa, ma, sa, _ = _select(make(), x, g, u, k, addend, use_out, None)
            rb, xb, ob, mb, sb, gp = _select(make(), x, g, u, k, addend, use_out, parts)
            assert gp.parts, "the native call read the parts; nothing was packed"
            assert _same(ra.indices, rb.indices) and _same(ra.values, rb.values)
            assert ra.threshold == rb.threshold or (ra.threshold != ra.threshold and rb.threshold != rb.threshold)
            assert _same(ra.acc, rb.acc) and _same(xa, xb) and _same(oa, ob) and _same(ma, mb)
            assert ra.finite == rb.finite and sa == sb


@pytest.mark.parametrize("simd", [False, True])
def test_each_simd_path_reads_parts_alike(simd):
    from hvd_commopt.select import _hostkernels
    x, g, u = _data("normal", 50_000, np.float32, 5)
    prev = _hostkernels._set_simd(simd)
    try:
        ra = _select(ExactTopK(), x, g, u, 400, "momentum", True, None)
        rb = _select(ExactTopK(), x, g, u, 400, "momentum", True, "odd")
    finally:
        _hostkernels._set_simd(prev == "avx2")
    assert _same(ra[0].indices, rb[0].indices) and _same(ra[0].values, rb[0].values)
    assert _same(ra[2], rb[2]) and _same(ra[3], rb[3])


def test_streamed_parts_equal_plain_stores():
    from hvd_commopt.select import _hostkernels
    x, g, u = _data("normal", 300_000, np.float32, 9)
    prev = _hostkernels._set_stream_min(0)  # every part streams where aligned
    try:
        ra = _select(ExactTopK(), x, g, u, 3000, "momentum", True, None)
        rb = _select(ExactTopK(), x, g, u, 3000, "momentum", True, "odd")
    finally:
        _hostkernels._set_stream_min(prev)
    assert _same(ra[0].indices, rb[0].indices) and _same(ra[2], rb[2]) and _same(ra[3], rb[3])


class _NoFused(NumpyOps):
    """NumpyOps whose kernels have no native call: ExactTopK's framework route, which packs the parts."""


def test_the_framework_route_packs_the_parts_first(monkeypatch):
    fused = HostKernels.fused_topk
    monkeypatch.setattr(HostKernels, "fused_topk",
                        lambda self, *a: None if isinstance(self.ops, _NoFused) else fused(self, *a))
    x, g, u = _data("normal", 60_000, np.float32, 2)
    ra = _select(ExactTopK(), x, g, u, 600, "momentum", True, None)
    rb = _select(ExactTopK(), x, g, u, 600, "momentum", True, "odd", ops=_NoFused())
    assert rb[5].is_packed and _same(rb[5].buf, g)
    assert _same(ra[0].indices, rb[0].indices) and _same(ra[0].values, rb[0].values) and _same(ra[3], rb[3])


def test_parts_that_do_not_cover_x_in_order_are_declined_or_refused():
    from hvd_commopt.select import _hostkernels
    x = np.ones(100, np.float32)
    a, b = np.ones(60, np.float32), np.ones(40, np.float32)
    args = (1, None, 1, 0, 2)
    for bad in [((0, a),), ((0, a), (61, b)), ((0, a), (60, b.astype(np.float64))), ((0, a), (60, a))]:
        assert host_numpy.np_fused_topk(x, *args, g=bad) is None
        with pytest.raises(ValueError):
            _hostkernels.topk(x, bad, x.copy(), None, 0.0, None, 1, None, 1, 0, 2, np.empty(1, np.float32),
                              np.empty(1, np.int64))
    ok = host_numpy.np_fused_topk(x, *args, g=((0, a), (60, b)), out=np.empty_like(x))
    assert ok is not None and _same(ok[0], np.full(100, 2.0, np.float32))


# -- the engine: unpacked gradients against packed ones ---------------------------------------------
# one weight bucket above ExactTopK.small_n (a sampled bracket, so the pass tells finiteness) and the biases
SPECS = [TensorSpec(f"l{i}.w", (128, 60 + i), "float32") for i in range(5)] + [TensorSpec("l5.b", (16,), "float32")]


def _grads(rank: int, step: int, nan: bool = False) -> dict:
    rng = np.random.default_rng(1000 * rank + step)
    out = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}
    if nan:
        out["l2.w"][3, 4] = np.nan
    return out


def _train(comm, packed: bool, steps: int = 4, factor: float = 1.0, compression=None, nan_step: int = -1,
           skip: str | None = None):
    comp = compression if compression is not None else Compression.topk(0.05, min_k=1)
    eng = build_engine(comm, NumpyOps(), compression=comp, gradient_predivide_factor=factor)
    eng.register(SPECS)
    if packed:
        eng.reducer.reads_parts = lambda bucket, ops: False
    got = []
    for step in range(steps):
        g = _grads(comm.rank, step, nan=step == nan_step)
        for name in eng.backward_names:
            if name != skip:
                eng.grad_ready(name, g[name])
        out = eng.reduce_step({skip: g[skip]} if skip else None)
        got.append({k: v.copy() for k, v in out.items()})
    return got, {k: v.copy() for k, v in eng.reducer.memory.residuals().items()}


def _assert_same_training(a, b):
    (ga, ra), (gb, rb) = a, b
    for sa, sb in zip(ga, gb):
        assert sa.keys() == sb.keys() and all(_same(sa[k], sb[k]) for k in sa)
    assert ra.keys() == rb.keys() and all(_same(ra[k], rb[k]) for k in ra)


@pytest.mark.parametrize("case", ["plain", "predivide", "nan", "missing", "dgc_sampled", "dgc_exact", "nomc"])
def test_the_engine_reads_parts_with_the_results_of_packing(case):
    kw = {"predivide": {"factor": 2.0}, "nan": {"nan_step": 1}, "missing": {"skip": "l3.w"},
          "dgc_sampled": {"compression": "dgc"}, "dgc_exact": {"compression": "dgc_exact"},
          "nomc": {"compression": "nomc"}}.get(case, {})

    def body(comm, packed):
        k = dict(kw)
        k["compression"] = {"dgc": Compression.dgc(0.05, momentum=0.9),
                            "dgc_exact": Compression.dgc(0.05, momentum=0.9, selection="exact"),
                            "nomc": Compression.topk(0.05, min_k=1, momentum_correction=False),
                            }.get(k.get("compression"))
        return _train(comm, packed, **k)
    packs: list = []  # GradParts packed, on any rank: (had parts to copy)
    orig = GradParts.pack
    GradParts.pack = lambda self: packs.append(bool(self.parts)) or orig(self)
    try:
        with np.errstate(invalid="ignore"):
            unpacked = run_ranks(2, body, False)
            made = len(packs)
            packed = run_ranks(2, body, True)
    finally:
        GradParts.pack = orig
    for a, b in zip(unpacked, packed):
        _assert_same_training(a, b)
    assert len(packs) == made  # the packing route never makes GradParts
    if case in ("plain", "dgc_exact", "missing"):
        assert not any(packs)  # read in place every step, never copied
    elif case in ("nan", "predivide"):
        assert any(packs)  # the non-finite step's check, the prescale: packed, as the old route
    elif case == "dgc_sampled":  # the first step samples g itself (packed); then the sample is the sums'
        assert packs.count(True) == 2 and len(packs) == 2
    else:  # "nomc": error feedback's selection does not read parts: the engine packs as before
        assert packs == []


def test_only_momentum_selections_on_host_kernels_read_parts():
    bucket = Bucket.of(0, [TensorSpec("a", (10, 10), "float32")])

    def reads(comp, ops=NumpyOps()):
        return comp.reads_parts(bucket, ops)
    assert reads(Compression.topk(0.01))
    assert reads(Compression.dgc(0.01, momentum=0.9, selection="exact"))
    assert reads(Compression.dgc(0.01, momentum=0.9))  # sampled: from its second step on
    assert not reads(Compression.topk(0.01, momentum_correction=False))
    assert not reads(Compression.topk(0.01, layerwise=True))
    assert not reads(Compression.topk(0.01, selection="threshold"))
    assert not reads(Compression.dgc(0.01, momentum=0.9, nesterov=True, selection="exact"))
    assert not reads(Compression.gtopk(0.01))  # declared on the Reducer base: its start reads flat itself
    prev, host_native.USE_NATIVE = host_native.USE_NATIVE, False
    try:
        assert not reads(Compression.topk(0.01))
    finally:
        host_native.USE_NATIVE = prev


@pytest.mark.parametrize("thr", [0.7, 0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("parts", ["one", "odd", "empty"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_momentum_sweep_reads_parts_as_the_packed_bucket(thr, parts, dtype):
    """add_momentum_abs_where (DGC's sweep) with g in parts: the same sums, u', indices and values;
    the plans without a sweep (every element, none) join the parts."""
    x, g, u = _data("nan", 40_003, dtype, 8)
    cuts = _splits(x.size, parts)
    got = []
    for native in (True, False):
        prev, host_native.USE_NATIVE = host_native.USE_NATIVE, native
        try:
            for gg in (g.copy(), GradParts(NumpyOps(), np.empty_like(g), [(a, g[a:b].copy())
                                                                          for a, b in zip(cuts, cuts[1:])])):
                xx, uo, out = x.copy(), np.full_like(u, 5.0), np.full_like(x, 7.0)
                with np.errstate(all="ignore"):
                    y, un, idx, vals = kernels_for(NumpyOps(), xx).add_momentum_abs_where(xx, u.copy(), 0.9, gg, uo, "ge",
                                                                                       thr, out)
                got.append([y.tobytes(), un.tobytes(), idx.tobytes(), vals.tobytes(), xx.tobytes()])
                if isinstance(gg, GradParts):
                    assert gg.is_packed != native  # read in place by the native sweep, else packed
        finally:
            host_native.USE_NATIVE = prev
    assert got[0] == got[1] == got[2] == got[3]
