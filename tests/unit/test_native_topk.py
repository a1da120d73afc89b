"""ExactTopK in one native call equals its framework route (docs/selection.md#native-topk).

The two routes of ``ExactTopK.select`` run on the same inputs: NumpyOps offers ``fused_topk``
(the native call), ``_Steps`` declines it (the ten-odd TensorOps calls). Everything the selection
returns or changes must agree bit for bit: values, indices, the reported threshold, the sums
(in place or into ``out``), the momentum correction's ``u'``, the finiteness verdict and every
counter, across brackets forced wrong on purpose (retries, the full fallback, the "above hi"
branch), ties, NaN/Inf, zeros, both dtypes and both SIMD paths.
"""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt.select import host_native
from hvd_commopt.select import host_numpy
from hvd_commopt.select.addend import MomentumAddend
from hvd_commopt.select.exact_topk import ExactTopK
from hvd_commopt.numpy_ops import NumpyOps

pytestmark = pytest.mark.skipif(not host_native.native_sweep(), reason="the native kernels were not built")


class _Steps(NumpyOps):
    """NumpyOps without the native call: ExactTopK's framework route."""

    def fused_topk(self, *args):
        return None


class _LowBracket(ExactTopK):
    """Both bracket ranks far below the k-th value: the candidates hold many more than k >= hi."""

    def _bracket_ranks(self, n, k, m):
        j_hi = min(m - 1, int(3 * k * m / n) + 40)
        return j_hi + 1, j_hi


SELECTORS = {
    "default": lambda: ExactTopK(),
    "lo_too_high": lambda: ExactTopK(z=-6.0, small_n=0),                # retries
    "no_retries": lambda: ExactTopK(z=-6.0, small_n=0, max_retries=0),  # every element a candidate
    "tiny_sample": lambda: ExactTopK(z=0.0, small_n=0, min_sample=16, sample_scale=0.01),
    "loose": lambda: ExactTopK(z=30.0, small_n=0),
    "low_bracket": lambda: _LowBracket(small_n=0),                      # hi taken, or the above fallback
}


def _data(case: str, n: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    x, g, u = (rng.standard_normal(n).astype(dtype) for _ in range(3))
    if case == "ties":
        x[::3], g[::3], u[::3] = 2.0, 0.0, 0.0
    elif case == "two_values":
        x[:] = np.where(rng.random(n) < 0.5, 1.0, -1.0).astype(dtype)
        g[:], u[:] = 0.0, 0.0
    elif case == "nan":
        x[rng.integers(0, n, 7)] = np.nan
    elif case == "inf":
        x[rng.integers(0, n, 7)] = -np.inf
    elif case == "zeros":
        x[:], g[:], u[:] = 0.0, 0.0, 0.0
    elif case == "sparse":
        x[:] = 0.0
        x[rng.integers(0, n, 300)] = rng.standard_normal(300).astype(dtype)
        g[:], u[:] = 0.0, 0.0
    elif case == "scales":
        x *= np.exp(rng.standard_normal(n) * 8).astype(dtype)
    return x, g, u


def _run(ops, sel, x, g, u, k, addend: str, use_out: bool):
    x, g, u = x.copy(), g.copy(), u.copy()
    out = np.full_like(x, 7.0) if use_out else None
    add = {"none": None, "plain": g, "momentum": MomentumAddend(u, 0.9, g, np.full_like(u, 5.0))}[addend]
    with np.errstate(all="ignore"):
        r = sel.select(ops, x, k, addend=add, out=out)
    made = add.made if addend == "momentum" else None
    return r, x, out, made, dict(sel.stats)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_routes_agree(make, x, g, u, k, addend, use_out):
    fused, steps = (_run(ops, make(), x, g, u, k, addend, use_out) for ops in (NumpyOps(), _Steps()))
    (ra, xa, oa, ma, sa), (rb, xb, ob, mb, sb) = fused, steps
    assert _same(ra.indices, rb.indices) and _same(ra.values, rb.values)
    assert ra.threshold == rb.threshold or (ra.threshold != ra.threshold and rb.threshold != rb.threshold)
    assert _same(ra.acc, rb.acc) and _same(xa, xb) and _same(oa, ob) and _same(ma, mb)
    assert ra.finite == rb.finite and ra.count == rb.count == k
    assert sa == sb
    return sa


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize("case", ["normal", "ties", "two_values", "nan", "inf", "zeros", "sparse", "scales"])
def test_the_native_call_equals_the_framework_route(selector, case):
    stats = {}
    for i, (n, dtype, addend, use_out) in enumerate([
            (70_000, np.float32, "momentum", False), (70_000, np.float32, "momentum", True),
            (50_000, np.float64, "plain", True), (40_000, np.float32, "none", False),
            (3_000, np.float32, "momentum", True), (100_000, np.float64, "momentum", False)]):
        x, g, u = _data(case, n, dtype, seed=i)
        for k in (1, 37, n // 100, n // 20, n - 3):
            for key, v in _assert_routes_agree(SELECTORS[selector], x, g, u, k, addend, use_out).items():
                stats[key] = stats.get(key, 0) + v
    if case == "normal":  # the forced brackets reach the branches they were made for
        assert {"lo_too_high": stats["retries"], "no_retries": stats["full_fallbacks"],
                "low_bracket": stats["above_fallbacks"]}.get(selector, 1) > 0


def test_each_simd_path_equals_the_framework_route(simd):
    for case in ("ties", "nan"):
        x, g, u = _data(case, 90_001, np.float32, seed=3)
        for k in (1, 900, 30_000):
            _assert_routes_agree(SELECTORS["default"], x, g, u, k, "momentum", True)


@pytest.mark.parametrize("sums_first", [-1, 1 << 30], ids=["sample_first", "sums_first"])
def test_both_orders_of_the_native_call_equal_the_framework_route(sums_first):
    """A buffer that fits in cache gets its sums in a pass of their own before the sample
    (docs/selection.md#native-topk); forced both ways, every size, dtype and addend agrees."""
    prev = host_native._native._set_sums_first_max(sums_first)
    try:
        for selector in ("default", "lo_too_high", "no_retries", "low_bracket"):
            for case, n, dtype, addend in (("normal", 70_000, np.float32, "momentum"),
                                           ("ties", 50_000, np.float64, "plain"),
                                           ("nan", 120_000, np.float32, "momentum")):
                x, g, u = _data(case, n, dtype, seed=5)
                for k in (1, n // 100, n // 20):
                    for use_out in (False, True):
                        _assert_routes_agree(SELECTORS[selector], x, g, u, k, addend, use_out)
    finally:
        host_native._native._set_sums_first_max(prev)


@pytest.mark.parametrize("keys", ["spread", "one_bin", "two_bins"])
def test_the_sample_bracket_by_histogram_bins(keys):
    """The bracket's ranks come from the bin of the keys' top bits that holds them, then a
    quickselect in that bin: samples whose keys fill one bin, or two, give the exact ranks."""
    rng = np.random.default_rng(11)
    n = 200_000
    x = {"spread": rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 4),
         "one_bin": 1.0 + rng.random(n) * 0.2,
         "two_bins": np.where(rng.random(n) < 0.5, 1.0, 4.0) + rng.random(n) * 0.01}[keys].astype(np.float32)
    for k in (1, 200, 2_000, 20_000):
        _assert_routes_agree(SELECTORS["default"], x, x * 0, x * 0, k, "plain", False)
        _assert_routes_agree(SELECTORS["lo_too_high"], x, x * 0, x * 0, k, "none", False)


def test_the_native_call_declines_what_it_cannot_take():
    """float16, mixed dtypes, or the native kernels turned off: None, nothing written."""
    x = np.ones(40_000, np.float16)
    assert host_numpy.np_fused_topk(x, 10, None, 1, 0, 2) is None
    y = np.ones(40_000, np.float32)
    assert host_numpy.np_fused_topk(y, 10, None, 1, 0, 2, g=np.ones(40_000, np.float64)) is None
    prev, host_native.USE_NATIVE = host_native.USE_NATIVE, False
    try:
        assert host_numpy.np_fused_topk(y, 10, None, 1, 0, 2) is None
    finally:
        host_native.USE_NATIVE = prev


def test_a_sample_position_outside_the_buffer_is_an_error():
    """Refused before anything is written, on the sums-first route too."""
    x = np.ones(1000, np.float32)
    with pytest.raises(ValueError, match="sample position"):
        host_numpy.np_fused_topk(x, 10, np.array([5, 1000], np.int64), 1, 0, 2)
    g, u = np.full(1000, 2.0, np.float32), np.full(1000, 3.0, np.float32)
    uo, y = np.zeros_like(u), np.zeros_like(x)
    with pytest.raises(ValueError, match="sample position"):
        host_numpy.np_fused_topk(x, 10, np.array([5, -1], np.int64), 1, 0, 2, g=g, u=u, mu=0.9, u_out=uo, out=y)
    assert not uo.any() and not y.any()


@pytest.mark.parametrize("n", [1, 2, 17, 4096, 100_000])
def test_quickselect_on_adversarial_orders(n):
    """Sorted, reversed, constant and organ-pipe inputs: the k-th key is found (the fallback to a
    sort after 64 rounds keeps the worst case bounded)."""
    base = np.arange(n, dtype=np.float32)
    for x in (base, base[::-1].copy(), np.zeros(n, np.float32),
              np.concatenate([base[: n // 2], base[: n - n // 2][::-1]])):
        for k in sorted({1, max(1, n // 3), n}):
            r = ExactTopK(small_n=1 << 30).select(NumpyOps(), x.copy(), k)
            want = np.sort(np.abs(x), kind="stable")[::-1][k - 1]
            assert float(r.threshold) == float(want)
            assert np.asarray(r.indices).size == k


def test_output_buffers_shorter_than_k_are_an_error():
    x = np.ones(1000, np.float32)
    with pytest.raises(ValueError, match="topk: vals must be a contiguous buffer of 4-byte items holding at least k"):
        host_native._native.topk(x, None, x, None, 0.0, None, 10, None, 1, 0, 2, np.empty(5, np.float32),
                                    np.empty(10, np.int64))
