"""Fast selection (hvd_commopt.select) and its kernels, in NumPy, torch (host
kernels and ATen-only) and TF (host kernels and TF ops): bit for bit the same as ``topk_abs`` and
as a brute-force model of the contract (docs/selection.md)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hvd_commopt.memory.error_feedback import ErrorFeedback
from hvd_commopt.select.strategies import ExactTopK, ReuseTopK
from hvd_commopt.numpy_ops import NumpyOps
from hvd_commopt.select.host_numpy import OPS
from hvd_commopt.select.kernels import kernels_for

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
tf = pytest.importorskip("tensorflow")

from tf_plugin.ops import TFOps  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402

F32_INF_KEY = 0x7F800000


class _TorchAten(TorchOps):
    def host_view(self, t):  # no host view: the portable kernels on ATen ops
        return None


class _TFNative(TFOps):
    def host_view(self, t):  # no host view: the portable kernels on TF ops
        return None


VARIANTS = {"numpy": NumpyOps(), "torch-host": TorchOps(), "torch-aten": _TorchAten(), "tf-host": TFOps(),
            "tf-native": _TFNative()}
FAST = ("numpy", "torch-host", "torch-aten", "tf-host")


def ef_step(ops, selector, residual, grad, k, key=""):
    """The fused error-feedback step as ErrorFeedback.compensate_select runs it."""
    if isinstance(selector, ReuseTopK):
        r = selector.select(ops, residual, k, key=key, addend=grad)
    else:
        r = selector.select(ops, residual, k, addend=grad)
    return r.values, r.indices, ops.index_fill(r.acc, r.indices, 0.0)


def ef_step_reference(ops, residual, grad, k):
    """The unfused step: compensate (acc = grad + residual), topk_abs, update (copy + fill)."""
    acc = ops.add(grad, residual)
    vals, idx = ops.topk_abs(acc, k)
    residual = ops.copy_into(residual, 0, acc)
    return vals, idx, ops.index_fill(residual, idx, 0.0)

def to_native(ops, x: np.ndarray):
    if ops.name == "torch":
        return torch.from_numpy(np.array(x, copy=True))
    if ops.name == "tensorflow":
        return tf.constant(x)
    return np.array(x, copy=True)


def host(ops, t) -> np.ndarray:
    return np.asarray(ops.to_numpy(t))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def key_reference(x: np.ndarray, k: int):
    """The contract as a brute-force model: keys |x| (NaN largest, all NaN equal), stable order
    on -key (ties to the lower index), first k, indices ascending."""
    keys = (x.view(np.int32) & 0x7FFFFFFF).astype(np.int64)
    keys = np.minimum(keys, F32_INF_KEY + 1)
    idx = np.sort(np.argsort(-keys, kind="stable")[:k]).astype(np.int64)
    return x[idx], idx


# -- inputs ----------------------------------------------------------------------------------------

def make_inputs():
    rng = np.random.default_rng(12345)
    cases = {}
    for n in (1, 2, 3, 7, 64, 1000, 40_000, 300_001):
        cases[f"normal{n}"] = rng.standard_normal(n).astype(np.float32)
    n = 200_000
    cases["heavy_tail"] = (rng.standard_t(2, n) * np.exp(rng.standard_normal(n) * 3)).astype(np.float32)
    layers = [rng.standard_normal(s) * sc for s, sc in ((50_000, 1e-3), (80_000, 1.0), (512, 30.0), (69_488, 1e-5))]
    cases["layered_scales"] = np.concatenate(layers).astype(np.float32)
    cases["small_ints_many_ties"] = rng.integers(-4, 5, n).astype(np.float32)
    cases["two_values"] = np.where(rng.random(n) < 0.3, 1.0, -1.0).astype(np.float32)
    cases["all_equal"] = np.full(n, -3.25, np.float32)
    cases["zeros"] = np.zeros(n, np.float32)
    z = np.zeros(n, np.float32)
    z[rng.choice(n, 50, replace=False)] = rng.standard_normal(50)
    cases["mostly_zeros_nnz50"] = z
    z2 = np.zeros(n, np.float32)
    z2[rng.choice(n, 30_000, replace=False)] = rng.standard_normal(30_000)
    cases["mostly_zeros_nnz30k"] = z2
    signed_zeros = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0))
    signed_zeros[rng.choice(n, 100, replace=False)] = 1.0
    cases["signed_zeros"] = signed_zeros
    cases["denormals"] = (rng.standard_normal(n) * 1e-40).astype(np.float32)
    mixed = rng.standard_normal(n).astype(np.float32)
    mixed[rng.random(n) < 0.5] *= np.float32(1e-42)
    cases["denormal_mix"] = mixed
    tiny = np.zeros(n, np.float32)
    tiny[rng.random(n) < 0.2] = np.float32(1.4e-45)  # the smallest denormal, many ties with it
    cases["min_denormal_ties"] = tiny
    infs = rng.standard_normal(n).astype(np.float32)
    infs[rng.choice(n, 300, replace=False)] = np.inf
    infs[rng.choice(n, 300, replace=False)] = -np.inf
    cases["with_infs"] = infs
    cases["ascending"] = np.linspace(-1, 1, n, dtype=np.float32)
    cases["descending_abs"] = np.linspace(5, 0, n, dtype=np.float32)
    per = np.tile(np.array([100.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08], np.float32), n // 9 + 1)[:n]
    cases["periodic9"] = per * (1 + 1e-3 * rng.standard_normal(n)).astype(np.float32)
    spikes = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    spikes[:1000] = 10.0 + rng.random(1000).astype(np.float32)  # all large values in one region
    cases["clustered_head"] = spikes
    q = rng.standard_normal(n).astype(np.float16).astype(np.float32)  # many ties at fp16 resolution
    cases["fp16_quantised"] = q
    return cases


INPUTS = make_inputs()


def ks_for(n: int):
    ks = {1, n, max(1, n - 1), max(1, n // 1000), max(1, n // 100), max(1, n // 20), max(1, n // 2)}
    return sorted(k for k in ks if 1 <= k <= n)


# -- 1. exact selection == today's topk_abs, bit for bit -------------------------------------------

@pytest.mark.parametrize("case", sorted(INPUTS))
def test_exact_matches_torch_and_numpy_reference(case):
    x = INPUTS[case]
    tref, nref = TorchOps(), NumpyOps()
    ops = VARIANTS["torch-host"]
    sel = ExactTopK()
    for k in ks_for(x.size):
        rv, ri = tref.topk_abs(torch.from_numpy(x.copy()), k)
        nv, ni = nref.topk_abs(x.copy(), k)
        assert same_bits(rv.numpy(), nv) and np.array_equal(ri.numpy(), ni), f"references disagree {case} k={k}"
        r = sel.select(ops, torch.from_numpy(x.copy()), k)
        assert r.indices.dtype == torch.int64
        assert np.array_equal(r.indices.numpy(), ri.numpy()), f"{case} k={k}: indices differ"
        assert same_bits(r.values.numpy(), rv.numpy()), f"{case} k={k}: values differ"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", sorted(INPUTS))
def test_every_framework_identical(variant, case):
    x = INPUTS[case]
    if x.size > 300_001 and variant in ("tf-native", "torch-aten"):
        pytest.skip("slow path, covered on smaller inputs")
    ops = VARIANTS[variant]
    sel = ExactTopK()
    for k in ks_for(x.size):
        ev, ei = key_reference(x, k)
        r = sel.select(ops, to_native(ops, x), k)
        assert np.array_equal(host(ops, r.indices), ei), f"{variant} {case} k={k}"
        assert same_bits(host(ops, r.values), ev), f"{variant} {case} k={k}"


@pytest.mark.parametrize("variant", FAST)
def test_forced_fallbacks_stay_exact(variant):
    """Wrong brackets on purpose: every retry / fallback branch must still be exact."""
    ops = VARIANTS[variant]
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(100_000).astype(np.float32), INPUTS["small_ints_many_ties"],
          INPUTS["mostly_zeros_nnz50"], INPUTS["clustered_head"]]
    selectors = [
        ExactTopK(z=-6.0, small_n=0),               # lo too high (retries), hi too low (above fallback)
        ExactTopK(z=-6.0, small_n=0, max_retries=0),  # retries exhausted: everything is a candidate
        ExactTopK(z=0.0, small_n=0, min_sample=16, sample_scale=0.01),  # tiny sample
        ExactTopK(z=30.0, small_n=0),               # very loose bracket
    ]
    for sel in selectors:
        for x in xs:
            for k in (1, 37, x.size // 100, x.size // 20, x.size - 3):
                ev, ei = key_reference(x, k)
                r = sel.select(ops, to_native(ops, x), k)
                assert np.array_equal(host(ops, r.indices), ei)
                assert same_bits(host(ops, r.values), ev)
    assert selectors[0].stats["retries"] > 0
    assert selectors[1].stats["full_fallbacks"] > 0


class _LowBracket(ExactTopK):
    """Both thresholds far below the k-th value: the 'above hi' fallback branch."""

    def _bracket_ranks(self, n, k, m):
        j_hi = min(m - 1, int(3 * k * m / n) + 40)
        return j_hi + 1, j_hi


@pytest.mark.parametrize("variant", FAST)
def test_above_fallback_stays_exact(variant):
    ops = VARIANTS[variant]
    rng = np.random.default_rng(8)
    sel = _LowBracket(small_n=0)
    for x in (rng.standard_normal(100_000).astype(np.float32), INPUTS["small_ints_many_ties"],
              INPUTS["two_values"], INPUTS["mostly_zeros_nnz30k"]):
        for k in (1, 37, x.size // 100, x.size // 20):
            ev, ei = key_reference(x, k)
            r = sel.select(ops, to_native(ops, x), k)
            assert np.array_equal(host(ops, r.indices), ei)
            assert same_bits(host(ops, r.values), ev)
    assert sel.stats["above_fallbacks"] > 0


def test_k_zero_and_k_over_n():
    ops = VARIANTS["torch-host"]
    x = torch.randn(1000)
    r = ExactTopK().select(ops, x, 0)
    assert r.indices.numel() == 0 and r.values.numel() == 0
    r = ExactTopK().select(ops, x, 5000)
    assert torch.equal(r.indices, torch.arange(1000)) and torch.equal(r.values, x)


# -- 2. NaN and Inf: deterministic (NaN largest, all NaNs equal, lower index first) -------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_nan_is_largest_and_deterministic(variant):
    ops = VARIANTS[variant]
    rng = np.random.default_rng(3)
    n = 120_000
    x = rng.standard_normal(n).astype(np.float32)
    pos = rng.choice(n, 500, replace=False)
    payloads = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF], dtype=np.uint32)
    x[pos] = payloads[rng.integers(0, 4, 500)].view(np.float32)  # quiet/signalling, both signs
    x[rng.choice(n, 50, replace=False)] = np.inf
    sel = ExactTopK()
    for k in (1, 100, 500, 549, 550, 551, 1200, n // 10, n):
        ev, ei = key_reference(x, k)
        r = sel.select(ops, to_native(ops, x), k)
        assert np.array_equal(host(ops, r.indices), ei), k
        assert same_bits(host(ops, r.values), ev), k
    # where today's TorchOps is deterministic (fewer NaNs than k) it agrees
    k = 2000
    rv, ri = TorchOps().topk_abs(torch.from_numpy(x.copy()), k)
    r = sel.select(ops, to_native(ops, x), k)
    assert np.array_equal(host(ops, r.indices), ri.numpy())


# -- 3. the primitives ---------------------------------------------------------------------------

def _brute_where(x, op, thr):
    keys = np.minimum((x.view(np.int32) & 0x7FFFFFFF).astype(np.int64), F32_INF_KEY + 1)
    if math.isnan(thr):
        tk = F32_INF_KEY + 1
        if op == "gt":
            return np.zeros(0, np.int64)
        if op == "le":
            return np.arange(x.size, dtype=np.int64)
    elif thr < 0:
        return np.arange(x.size, dtype=np.int64) if op in ("ge", "gt") else np.zeros(0, np.int64)
    else:
        with np.errstate(over="ignore"):
            tk = int(np.float32(thr).view(np.int32)) & 0x7FFFFFFF
    m = {"ge": keys >= tk, "gt": keys > tk, "le": keys <= tk, "lt": keys < tk}[op]
    return np.flatnonzero(m).astype(np.int64)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_abs_where_contract(variant):
    ops = VARIANTS[variant]
    rng = np.random.default_rng(5)
    n = 70_000
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.choice(n, 20, replace=False)] = np.nan
    x[rng.choice(n, 20, replace=False)] = -np.inf
    x[rng.choice(n, 200, replace=False)] = -0.0
    x[rng.choice(n, 200, replace=False)] = 1e-42
    x[rng.choice(n, 300, replace=False)] = 1.5
    thrs = [0.0, -0.0, -1.0, 1e-42, 1.5, 1.5000001, 0.1 + 1e-12, 2.0, np.inf, np.nan, 1e300, float(np.abs(x[7]))]
    t = to_native(ops, x)
    for op in OPS:
        for thr in thrs:
            idx, vals = kernels_for(ops, t).abs_where(t, op, thr)
            want = _brute_where(x, op, thr)
            got = host(ops, idx)
            assert got.dtype == np.int64
            assert np.array_equal(got, want), (op, thr)
            assert same_bits(host(ops, vals), x[want]), (op, thr)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_add_abs_where_is_add_then_where(variant):
    ops = VARIANTS[variant]
    rng = np.random.default_rng(9)
    n = 600_000  # several chunks
    r0 = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    want_acc = r0 + g
    thr = float(np.partition(np.abs(want_acc), n - 3000)[n - 3000])
    r = to_native(ops, r0)
    acc, idx, vals = kernels_for(ops, r).add_abs_where(r, to_native(ops, g), "ge", thr)
    assert same_bits(host(ops, acc), want_acc)
    want = _brute_where(want_acc, "ge", thr)
    assert np.array_equal(host(ops, idx), want)
    assert same_bits(host(ops, vals), want_acc[want])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kth_largest_abs(variant):
    ops = VARIANTS[variant]
    rng = np.random.default_rng(11)
    x = rng.standard_normal(5000).astype(np.float32)
    x[:30] = np.nan
    x[30:40] = -np.inf
    x[40:100] = -0.0
    keys = np.sort(np.minimum((x.view(np.int32) & 0x7FFFFFFF).astype(np.int64), F32_INF_KEY + 1))[::-1]
    t = to_native(ops, x)
    for k in (1, 30, 31, 40, 41, 100, 2500, 4900, 4941, 5000):
        v = kernels_for(ops, t).kth_largest_abs(t, k)
        kk = keys[k - 1]
        if kk > F32_INF_KEY:
            assert math.isnan(v)
        else:
            assert np.float32(v).view(np.int32) == kk, k


# -- 4. error feedback, fused --------------------------------------------------------------------

@pytest.mark.parametrize("variant", FAST)
def test_fused_ef_step_equals_todays_step(variant):
    ops = VARIANTS[variant]
    tref = TorchOps()
    rng = np.random.default_rng(21)
    n, k = 400_000, 4000
    res_fast = to_native(ops, np.zeros(n, np.float32))
    res_ref = torch.zeros(n)
    sel = ExactTopK()
    for step in range(4):
        g = (rng.standard_normal(n) * (1 + step)).astype(np.float32)
        acc_before = host(ops, res_fast) + g
        v1, i1, res_fast = ef_step(ops, sel, res_fast, to_native(ops, g), k)
        v2, i2, res_ref = ef_step_reference(tref, res_ref, torch.from_numpy(g.copy()), k)
        assert np.array_equal(host(ops, i1), i2.numpy())
        assert same_bits(host(ops, v1), v2.numpy())
        assert same_bits(host(ops, res_fast), res_ref.numpy())
        # invariant: scatter(idx, vals) + residual == acc, bit for bit
        rebuilt = host(ops, res_fast).copy()
        rebuilt[host(ops, i1)] += host(ops, v1)
        assert same_bits(rebuilt, acc_before)


# -- 5. threshold reuse --------------------------------------------------------------------------

@pytest.mark.parametrize("variant", FAST)
def test_reuse_counts_band_and_stats(variant):
    ops = VARIANTS[variant]
    rng = np.random.default_rng(31)
    n, k = 300_000, 3000
    reuse = ReuseTopK(tau=8, band=0.2)
    residual = to_native(ops, np.zeros(n, np.float32))
    run = longest = 0
    for step in range(40):
        scale = 1.0 + 0.5 * math.sin(step / 3.0)   # drifting gradient scale
        g = (rng.standard_normal(n) * scale).astype(np.float32)
        acc = host(ops, residual) + g
        thr_before = reuse._state["b0"].thr if "b0" in reuse._state else None
        vals, idx, residual = ef_step(ops, reuse, residual, to_native(ops, g), k, key="b0")
        i = host(ops, idx)
        action = reuse.stats()["b0"]["last_action"]
        if action == "reuse":
            assert k * 0.8 <= i.size <= k * 1.2
            assert np.array_equal(i, _brute_where(acc, "ge", thr_before))  # exactly {|x| >= thr}
        else:
            ev, ei = key_reference(acc, k)
            assert np.array_equal(i, ei)
        assert same_bits(host(ops, vals), acc[i])
        run = run + 1 if action == "reuse" else 0
        longest = max(longest, run)
    s = reuse.stats()["b0"]
    assert s["steps"] == 40
    assert s["exact_scheduled"] + s["reused"] + s["recompute_high"] + s["recompute_low"] == 40
    assert s["reused"] > 0 and s["exact_scheduled"] >= 1
    assert longest <= 8  # never more than tau reuses in a row


@pytest.mark.parametrize("variant", FAST)
def test_error_feedback_fused_equals_unfused(variant):
    """ErrorFeedback.compensate_select == compensate, topk_abs, update, bit for bit."""
    ops = VARIANTS[variant]
    rng = np.random.default_rng(41)
    n, k = 200_000, 2000
    fused, plain = ErrorFeedback(), ErrorFeedback()
    sel = ExactTopK()
    for step in range(3):
        g = (rng.standard_normal(n) * (1 + step)).astype(np.float32)
        v1, i1 = fused.compensate_select(ops, "b", to_native(ops, g),
                                         lambda r, a: (lambda res: (res.values, res.indices, res.acc))(
                                             sel.select(ops, r, k, addend=a)))
        acc = plain.compensate(ops, "b", to_native(ops, g))
        v2, i2 = ops.topk_abs(acc, k)
        plain.update(ops, "b", acc, i2)
        assert np.array_equal(host(ops, i1), host(ops, i2))
        assert same_bits(host(ops, v1), host(ops, v2))
        assert same_bits(host(ops, fused.residual(ops, "b", to_native(ops, g))),
                         host(ops, plain.residual(ops, "b", to_native(ops, g))))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_zero_gives_zeros_of_the_same_dtype(variant):
    ops = VARIANTS[variant]
    for dt in (np.float32, np.float64, np.float16):
        x = np.arange(1, 11, dtype=dt)
        z = host(ops, ops.zero_(to_native(ops, x)))
        assert z.dtype == dt and np.array_equal(z, np.zeros(10, dt))
    if variant.startswith("tf"):  # the engine's lazy fusion buffer: zeros without assembling it
        from tf_plugin.ops import PackBuffer
        pb = PackBuffer(6, tf.float32, None, parts=[(0, tf.ones([6]))])
        assert np.array_equal(ops.zero_(pb).numpy(), np.zeros(6, np.float32))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_index_copy_writes_the_values_at_repeated_indices(variant):
    """index_copy (the sparse result's postscale at the exchanged positions): t[idx] = vals, a
    repeated index carrying the same value each time, identical in every framework."""
    ops = VARIANTS[variant]
    rng = np.random.default_rng(8)
    for dt in (np.float32, np.float64):
        t = rng.standard_normal(50).astype(dt)
        idx = np.array([7, 3, 7, 49, 0, 3, 7], np.int64)
        vals = (t[idx] * dt(0.5)).astype(dt)
        want = t.copy()
        want[idx] = vals
        got = host(ops, ops.index_copy(to_native(ops, t), to_native(ops, idx), to_native(ops, vals)))
        assert got.dtype == dt and np.array_equal(got, want)


@pytest.mark.parametrize("variant", FAST + ("tf-native",))
def test_add_abs_where_into_out_equals_in_place_and_leaves_acc(variant):
    ops = VARIANTS[variant]
    rng = np.random.default_rng(3)
    a, g = rng.standard_normal(70_000).astype(np.float32), rng.standard_normal(70_000).astype(np.float32)
    like = ops.from_numpy(a, like=None)
    acc, out = ops.from_numpy(a.copy(), like=like), ops.from_numpy(np.zeros_like(a), like=like)
    s_out, i_out, v_out = kernels_for(ops, acc).add_abs_where(acc, ops.from_numpy(g, like=like), "ge", 1.5, out)
    a2 = ops.from_numpy(a.copy(), like=like)
    s_in, i_in, v_in = kernels_for(ops, a2).add_abs_where(a2, ops.from_numpy(g, like=like), "ge", 1.5)
    assert np.array_equal(np.asarray(ops.to_numpy(acc)), a)  # acc intact
    for x, y in ((s_out, s_in), (i_out, i_in), (v_out, v_in)):
        assert np.array_equal(np.asarray(ops.to_numpy(x)), np.asarray(ops.to_numpy(y)))
    s = ops.scale_into(out, ops.from_numpy(a, like=like), 0.9)
    assert np.array_equal(np.asarray(ops.to_numpy(s)), np.asarray(ops.to_numpy(ops.scale(ops.from_numpy(a.copy(), like=like), 0.9))))


@pytest.mark.parametrize("variant", FAST)
@pytest.mark.parametrize("case", ["mc_mu09", "mc_mu09_nesterov", "dgc_exact", "dgc_threshold", "ef"])
def test_fused_memories_equal_unfused_on_every_ops(variant, case):
    from tests.unit.test_fused_memory import check_fused
    check_fused(VARIANTS[variant], case)


@pytest.mark.parametrize("variant", FAST + ("tf-native",))
def test_axpy_into_equals_copy_then_axpy_and_leaves_inputs(variant):
    """axpy_into(dst, y, a, x) is axpy_(copy_(dst, y), a, x) bit for bit (the delayed schedules'
    local step from the replica, docs/od-sgd.md#update-rule), with y and x intact."""
    ops = VARIANTS[variant]
    rng = np.random.default_rng(5)
    for dt in (np.float32, np.float64):
        y, x = rng.standard_normal(5000).astype(dt), rng.standard_normal(5000).astype(dt)
        like = ops.from_numpy(y, like=None)
        yt, xt = ops.from_numpy(y.copy(), like=like), ops.from_numpy(x.copy(), like=like)
        got = ops.axpy_into(ops.from_numpy(np.zeros_like(y), like=like), yt, -0.37, xt)
        want = ops.axpy_(ops.copy_(ops.from_numpy(np.zeros_like(y), like=like), ops.from_numpy(y, like=like)), -0.37,
                         ops.from_numpy(x, like=like))
        assert np.array_equal(np.asarray(ops.to_numpy(got)), np.asarray(ops.to_numpy(want)))
        assert np.array_equal(np.asarray(ops.to_numpy(yt)), y) and np.array_equal(np.asarray(ops.to_numpy(xt)), x)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("with_out", [False, True])
def test_layerwise_selection_is_each_members_top_k_in_every_framework(variant, with_out):
    """docs/lags-omgs.md#lags-merged: the members' exact top-k, bucket-relative and ascending, the
    accumulator equal to r + g; in place where the framework's slices are views."""
    from hvd_commopt.buckets import Bucket, TensorSpec
    from hvd_commopt.compress.topk import TopKSelector
    ops = VARIANTS[variant]
    specs = [TensorSpec("a", (300, 200), "float32"), TensorSpec("b", (50, 20), "float32"),
             TensorSpec("c", (40000,), "float32")]
    b = Bucket.of(0, specs)
    rng = np.random.default_rng(11)
    g = rng.standard_normal(b.numel).astype(np.float32)
    g[[10, 20, 60005, 60900]] = 4.0  # ties
    r = rng.standard_normal(b.numel).astype(np.float32)
    comp = TopKSelector({"a": 0.001, "b": 0.05, "c": 0.002}, layerwise=True)
    rt, gt = to_native(ops, r), to_native(ops, g)
    out = ops.empty(b.numel, "float32", like=rt) if with_out else None
    vals, idx, acc = comp.select_acc(ops, rt, b, 0, gt, out, fin := [])
    acc_np = r + g
    assert same_bits(host(ops, acc), acc_np) and fin == [True]
    if with_out:
        assert same_bits(host(ops, rt), r)  # r intact
    want = [key_reference(acc_np[o:o + n], k) for o, n, k in ((0, 60000, 60), (60000, 1000, 50), (61000, 40000, 80))]
    assert same_bits(host(ops, idx), np.concatenate([i + o for (_, i), o in zip(want, (0, 60000, 61000))]))
    assert same_bits(host(ops, vals), np.concatenate([v for v, _ in want]))
    if ops.name in ("torch", "numpy"):  # views: the bucket swept in place, no concatenation
        assert acc is (out if with_out else rt)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_scale_add_into_is_scale_into_then_add(variant):
    """The momentum correction's ``u = mu*u + g`` (one native pass on host memory) equals the
    framework's multiply then add bit for bit (docs/selection.md#native-sweep)."""
    ops = VARIANTS[variant]
    rng = np.random.default_rng(11)
    u = rng.standard_normal(300_001).astype(np.float32)
    u[::97], u[1::89] = np.inf, np.nan
    g = rng.standard_normal(u.size).astype(np.float32)
    want = np.add(np.multiply(u, np.float32(0.9)), g)
    ut = to_native(ops, u)
    got = ops.scale_add_into(ops.empty(u.size, "float32", like=ut), ut, 0.9, to_native(ops, g))
    assert same_bits(host(ops, got), want)
    if ops.name == "torch":  # into u itself, as a snapshot-free momentum update does
        assert same_bits(host(ops, ops.scale_add_into(ut, ut, 0.9, to_native(ops, g))), want)
        t64 = torch.from_numpy(u.astype(np.float64))
        ref64 = torch.mul(t64, 0.9).add_(t64)
        assert same_bits(ops.scale_add_into(torch.empty_like(t64), t64, 0.9, t64).numpy(), ref64.numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
def test_torch_index_ops_on_host_memory_equal_atens(dtype):
    """docs/selection.md#random-access: gather, scatter_add and index_fill(0) of large index sets run
    in the native kernels; the bits are ATen's index_select / index_add_ / index_fill_."""
    from hvd_commopt.host_memory import RANDOM_ACCESS_MIN
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(40_000, generator=g) * 50).to(dtype)
    idx = torch.randint(0, x.numel(), (6000,), generator=g)
    ops = TorchOps()
    assert idx.numel() >= RANDOM_ACCESS_MIN
    bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.int64: torch.int64}[dtype]
    assert torch.equal(ops.gather(x, idx).view(bits), x.index_select(0, idx).view(bits))
    if dtype in (torch.float32, torch.float64):
        vals = torch.randn(idx.numel(), generator=g, dtype=dtype)
        want = x.clone().index_add_(0, idx, vals)
        assert torch.equal(ops.scatter_add(x.clone(), idx, vals).view(bits), want.view(bits))
    want = x.clone().index_fill_(0, idx, 0)
    assert torch.equal(ops.index_fill(x.clone(), idx, 0.0).view(bits), want.view(bits))
    neg = ops.index_fill(x.clone(), idx, -0.0)  # -0.0 is not zero bytes: ATen's path
    assert torch.equal(neg.view(bits), x.clone().index_fill_(0, idx, -0.0).view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("postscale", [1.0, 0.5, 1 / 3])
def test_torch_sparse_result_build_equals_atens_ops(dtype, postscale):
    """docs/selection.md#scatter-sum: the sparse result built in one native pass has ATen's bits:
    zero_, index_add_ in order, the sums times a Python float (``mul_``) written back with
    index_copy_."""
    from hvd_commopt.reduce.sparse import scatter_result
    g = torch.Generator().manual_seed(11)
    n = 300_001
    idx = torch.cat([torch.randperm(n, generator=g)[:3000].sort().values for _ in range(3)])
    vals = torch.randn(idx.numel(), generator=g, dtype=dtype) * 100
    ops = TorchOps()
    buf = torch.randn(n, generator=g, dtype=dtype)
    out, finite, sums = scatter_result(ops, buf, n, idx, vals, postscale)
    assert out.data_ptr() == buf.data_ptr() and finite
    want = torch.zeros(n, dtype=dtype).index_add_(0, idx, vals)
    want_sums = want.index_select(0, idx).mul_(postscale)
    want.index_copy_(0, idx, want_sums)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(out.view(bits), want.view(bits)) and torch.equal(sums.view(bits), want_sums.view(bits))
    half = buf.to(torch.float16)
    assert kernels_for(ops, half).scatter_sum(half, idx, vals.to(torch.float16), 1.0) is None  # ATen's path
    from hvd_commopt.select import host_native
    prev, host_native.USE_NATIVE = host_native.USE_NATIVE, False
    try:  # kernels off: declined before anything is allocated
        assert kernels_for(ops, buf).scatter_sum(buf, idx, vals, 1.0) is None
    finally:
        host_native.USE_NATIVE = prev
