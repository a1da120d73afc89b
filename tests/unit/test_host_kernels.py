"""The native host kernels (hvd_commopt/select/_hostkernels.c) against the NumPy kernels they stand in
for: bit for bit, on every comparison, dtype, special value and block boundary, on the AVX2 path
and the portable one (docs/selection.md#native-sweep)."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import host_memory
from hvd_commopt.select import host_native
from hvd_commopt.select import host_numpy as sk
from hvd_commopt.numpy_ops import NumpyOps
from hvd_commopt.select.host import HostKernels
from hvd_commopt.select.kernels import kernels_for

native = pytest.importorskip("hvd_commopt.select._hostkernels",
                             reason="the native extension was not built (no C compiler at install time)")


def _specials(x: np.ndarray) -> np.ndarray:
    """Zeros of both signs, infinities, NaNs, denormals and ties scattered through x."""
    tiny = np.finfo(x.dtype).smallest_subnormal
    for j, v in enumerate((0.0, -0.0, np.inf, np.nan, -np.inf, tiny, -3 * tiny, 1.0, -1.0)):
        x[j::7 + 2 * j] = v
    return x


def _bits(a: np.ndarray | None):
    return None if a is None else a.view(np.uint8)


def _sweep_both(x, plan, g=None, out=None):
    """np_sweep with the NumPy kernel and with the native one, each on fresh copies."""
    runs = []
    for on in (False, True):
        host_native.USE_NATIVE = on
        xx = x.copy()
        oo = None if out is None else np.zeros_like(x)
        idx, vals = sk.np_sweep(xx, plan, g, oo)
        runs.append((idx, _bits(vals), _bits(xx), _bits(oo)))
    return runs


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 100, 4097, 70001])
def test_sweep_is_bit_identical_to_numpy(dtype, n, simd, restore_native):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(dtype)
    if n > 20:
        x = _specials(x)
    g = rng.standard_normal(n).astype(dtype)
    key_of = sk.np_key_of(np.dtype(dtype))
    inf_key = sk.NP_KEYS[np.dtype(dtype)][2]
    for op in sk.OPS:
        for thr in (0.0, 0.3, 1.0, 2.5, np.inf, np.nan):
            plan = sk.threshold_plan(op, thr, key_of, inf_key)
            if plan in (sk.ALL, sk.NONE):
                continue
            for args in ((), (g,), (g, True)):
                (i0, v0, x0, o0), (i1, v1, x1, o1) = _sweep_both(x, plan, *args)
                assert np.array_equal(i0, i1) and i1.dtype == np.int64, (op, thr, len(args))
                assert np.array_equal(v0, v1) and np.array_equal(x0, x1), (op, thr, len(args))
                assert (o0 is None and o1 is None) or np.array_equal(o0, o1)


def test_sweep_continues_past_full_output_buffers(restore_native):
    # every element selected: the first output buffers (n/32) fill, the kernel says where it
    # stopped and the sweep goes on into larger ones
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    plan = ("ge", 0)
    idx, vals = sk.np_sweep(x, plan)
    assert np.array_equal(idx, np.arange(x.size)) and np.array_equal(vals, x)


def test_sweep_keeps_x_when_writing_the_sum_elsewhere(restore_native):
    rng = np.random.default_rng(1)
    x, g = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    x0, out = x.copy(), np.empty_like(x)
    sk.np_sweep(x, ("ge", 0), g, out)
    assert np.array_equal(x, x0) and np.array_equal(out, x0 + g)
    sk.np_sweep(x, ("ge", 0), g)  # no out: the sum goes into x
    assert np.array_equal(x, x0 + g)


def test_the_kernels_refuse_buffers_they_cannot_read():
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="contiguous buffer of 4-byte items"):
        native.sweep(x, None, np.zeros(10, np.float64), 0, 0, np.zeros(16, np.int64), np.zeros(16, np.float32), 0)
    with pytest.raises(ValueError, match="float32 or float64"):
        native.sweep(np.zeros(10, np.int16), None, np.zeros(10, np.int16), 0, 0, np.zeros(16, np.int64),
                     np.zeros(16, np.int16), 0)
    with pytest.raises(ValueError, match="at least as long as x"):
        native.scale_add(x, 0.5, np.zeros(5, np.float32), np.zeros(10, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mu", [0.9, 0.0, 0.99, 1 / 3])
def test_scale_add_is_a_multiply_then_an_add(dtype, mu, restore_native):
    rng = np.random.default_rng(2)
    t, g = _specials(rng.standard_normal(5003).astype(dtype)), rng.standard_normal(5003).astype(dtype)
    ref = np.add(np.multiply(t, dtype(mu)), g)
    out = np.empty_like(t)
    assert host_memory.scale_add(out, t, mu, g) is out and np.array_equal(_bits(out), _bits(ref))
    same = t.copy()
    host_memory.scale_add(same, same, mu, g)  # in place into t
    assert np.array_equal(_bits(same), _bits(ref))
    host_native.USE_NATIVE = False
    assert np.array_equal(_bits(host_memory.scale_add(np.empty_like(t), t, mu, g)), _bits(ref))


def test_numpy_ops_scale_add_into_matches_scale_into_then_add(restore_native):
    ops = NumpyOps()
    rng = np.random.default_rng(3)
    u, g = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    ref = ops.add(ops.scale_into(np.empty_like(u), u, 0.9), g)
    assert np.array_equal(ops.scale_add_into(np.empty_like(u), u, 0.9, g), ref)


def test_use_native_reports_and_restores(restore_native):
    assert host_native.native_sweep()
    host_native.USE_NATIVE = False
    assert not host_native.native_sweep() and host_native.native() is None
    host_native.USE_NATIVE = True
    assert host_native.native_sweep() and host_native.native() is native


def test_momentum_addend_is_made_inside_the_sweep(monkeypatch, restore_native):
    """The momentum correction's u' = mu*u + g is made by the selection's sweep (no pass of its
    own), and the sample, the sums, u' and the candidates equal the two-pass form bit for bit."""
    from hvd_commopt.select import addend as A
    ops = NumpyOps()
    rng = np.random.default_rng(4)
    u, g, v = (_specials(rng.standard_normal(20_001).astype(np.float32)) for _ in range(3))
    sidx = np.arange(3, u.size, 97)
    want_u = np.add(np.multiply(u, np.float32(0.9)), g)
    want_acc = v + want_u
    thr = float(np.partition(np.abs(np.nan_to_num(want_acc)), u.size - 300)[u.size - 300])
    want_idx, want_vals = sk.np_sweep(want_acc.copy(), sk.threshold_plan("ge", thr, sk.np_key_of(v.dtype),
                                                                         sk.NP_KEYS[v.dtype][2]))
    for in_place in (False, True):
        uu = u.copy()
        a = A.MomentumAddend(uu, 0.9, g, uu if in_place else np.empty_like(u))
        assert np.array_equal(_bits(A.gather(ops, a, sidx)), _bits(want_u[sidx])) and a.made is None
        monkeypatch.setattr(NumpyOps, "scale_add_into", lambda *args: pytest.fail("a pass of its own"))
        acc, idx, vals = A.add_abs_where(kernels_for(ops, v), v.copy(), a, "ge", thr, np.empty_like(v))
        monkeypatch.undo()
        assert a.made is a.out and np.array_equal(_bits(a.make(ops)), _bits(want_u))
        assert np.array_equal(_bits(acc), _bits(want_acc))
        assert np.array_equal(idx, want_idx) and np.array_equal(_bits(vals), _bits(want_vals))
    # every element a candidate: the output buffers fill and the sweep goes on where it stopped,
    # each element's u' made exactly once
    a = A.MomentumAddend(u.copy(), 0.9, g, np.empty_like(u))
    acc, idx, vals = A.add_abs_where(kernels_for(ops, v), v.copy(), a, "ge", 0.0)
    assert np.array_equal(idx, np.arange(u.size)) and np.array_equal(_bits(a.made), _bits(want_u))
    assert np.array_equal(_bits(vals), _bits(want_acc)) and np.array_equal(_bits(acc), _bits(want_acc))


def test_momentum_addend_without_a_fused_pass_is_made_first(restore_native, monkeypatch):
    """Kernels without the fused sweep (TF's return None) get u' made by scale_add_into first;
    paths that slice or sum the addend get it made as well."""
    from hvd_commopt.select import addend as A

    class NoFused(NumpyOps):
        pass

    fused = HostKernels.add_momentum_abs_where
    monkeypatch.setattr(HostKernels, "add_momentum_abs_where",
                        lambda self, *a, **kw: None if isinstance(self.ops, NoFused) else fused(self, *a, **kw))

    ops = NoFused()
    rng = np.random.default_rng(5)
    u, g, v = (rng.standard_normal(5000).astype(np.float32) for _ in range(3))
    a = A.MomentumAddend(u.copy(), 0.5, g, np.empty_like(u))
    acc, idx, _ = A.add_abs_where(kernels_for(ops, v), v.copy(), a, "ge", 1.0)
    want_u = np.add(np.multiply(u, np.float32(0.5)), g)
    assert np.array_equal(a.made, want_u) and np.array_equal(acc, v + want_u)
    b = A.MomentumAddend(u.copy(), 0.5, g, np.empty_like(u))
    assert np.array_equal(A.made(ops, b), want_u) and A.made(ops, None) is None


def _aligned(n: int, dtype, shift: int = 0) -> np.ndarray:
    """A zeroed n-element array whose data starts ``shift`` elements past a 64-byte boundary."""
    item = np.dtype(dtype).itemsize
    raw = np.zeros((n + shift) * item + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start:start + (n + shift) * item].view(dtype)[shift:]


@pytest.fixture
def streaming():
    """Every buffer written with streaming stores, then the default back."""
    prev = native._set_stream_min(0)
    yield
    native._set_stream_min(prev)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shift", [0, 1])  # aligned: streamed; one element off: plain stores
def test_streamed_sweep_writes_and_selects_the_same_bits(dtype, shift, streaming, restore_native):
    """docs/selection.md#streaming-stores: the sum, u' and the candidates of every form of the
    sweep are the NumPy kernel's, bit for bit, whether the outputs were streamed or not."""
    n = 70_001
    rng = np.random.default_rng(7)
    x, g, u = (_specials(rng.standard_normal(n).astype(dtype)) for _ in range(3))
    plan = sk.threshold_plan("ge", 1.5, sk.np_key_of(np.dtype(dtype)), sk.NP_KEYS[np.dtype(dtype)][2])
    host_native.USE_NATIVE = False
    want_u = np.add(np.multiply(u, dtype(0.9)), g)
    want = {"copy": (x, None), "add": (x + g, None), "momentum": (x + want_u, want_u)}
    host_native.USE_NATIVE = True
    for form, (want_y, want_uo) in want.items():
        want_idx, want_vals = sk.np_sweep(want_y.copy(), plan)
        y, uo = _aligned(n, dtype, shift), _aligned(n, dtype, shift)
        momentum = (u, 0.9, uo) if form == "momentum" else ()
        idx, vals = host_native.native_run(x, plan, None if form == "copy" else g, y, momentum)
        assert np.array_equal(idx, want_idx) and np.array_equal(_bits(vals), _bits(want_vals)), form
        assert np.array_equal(_bits(y), _bits(want_y)), form
        assert want_uo is None or np.array_equal(_bits(uo), _bits(want_uo)), form


@pytest.mark.parametrize("n,shift", [(0, 0), (5, 3), (1000, 0), (100_003, 7)])
def test_stream_store_copies_and_zeroes(stream_min, n, shift):
    src = np.frombuffer(np.random.default_rng(n).bytes(n), np.uint8)
    dst = _aligned(n + 8, np.uint8, shift)[:n]
    dst[:] = 0xAB
    native.stream_store(dst, src)
    assert np.array_equal(dst, src)
    native.stream_store(dst, None)
    assert not dst.any()
    with pytest.raises(ValueError, match="same size"):
        native.stream_store(dst, np.zeros(n + 1, np.uint8))


def test_set_stream_min_reports_the_previous_setting():
    prev = native._set_stream_min(-1)
    try:
        assert native._set_stream_min(4096) == -1 and native._set_stream_min(prev) == 4096
    finally:
        native._set_stream_min(prev)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32, np.float16, np.int8])
def test_take_reads_every_listed_position(dtype, restore_native):
    """docs/selection.md#random-access: the prefetching gather is x[idx], any order, repeats."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(50_000) * 100).astype(dtype)
    idx = rng.integers(0, x.size, 5000).astype(np.int64)
    got = host_memory.take(x, idx)
    assert got is not None and got.dtype == x.dtype and np.array_equal(got.view(np.uint8), x[idx].view(np.uint8))
    assert host_memory.take(x, idx[:10]) is None  # below RANDOM_ACCESS_MIN: the caller's own path
    host_native.USE_NATIVE = False
    assert host_memory.take(x, idx) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scatter_add_adds_in_order_like_numpy_add_at(dtype, restore_native):
    rng = np.random.default_rng(4)
    dst = _specials(rng.standard_normal(30_000).astype(dtype))
    idx = rng.integers(0, dst.size, 8000).astype(np.int64)
    vals = _specials(rng.standard_normal(idx.size).astype(dtype))
    want = dst.copy()
    np.add.at(want, idx, vals)  # unbuffered, in order: the same additions in the same order
    got = dst.copy()
    assert host_memory.scatter_add(got, idx, vals)
    assert np.array_equal(_bits(got), _bits(want))


def test_zero_at_writes_positive_zeros_and_the_index_kernels_check_bounds(restore_native):
    x = -np.ones(5000, np.float32)
    idx = np.arange(0, 5000, 3, dtype=np.int64)
    assert host_memory.zero_at(x, np.concatenate([idx, idx[:100]]))
    assert np.array_equal(_bits(x[idx]), _bits(np.zeros(idx.size, np.float32))) and (np.delete(x, idx) == -1).all()
    bad = np.full(2000, 5000, np.int64)
    for call in (lambda: native.scattered(0, x, bad, np.empty(2000, np.float32)),
                 lambda: native.scattered(1, x, bad, np.zeros(2000, np.float32)),
                 lambda: native.scattered(2, x, -bad)):
        with pytest.raises(IndexError, match="outside"):
            call()


def test_the_extension_in_use_is_built_from_these_sources():
    """An extension built from older sources (an editable install not rebuilt) lacks the newer
    kernels: it is refused at import with a warning naming the rebuild; this build is in use."""
    assert native.KERNELS_VERSION == host_native.KERNELS_VERSION
    assert host_native._native is native
