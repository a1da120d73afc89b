"""The sparse result's one-pass build (``scatter_sum``, hvd_commopt/select/_hostkernels_index.c) against
the plain path it stands in for: zeros, ``np.add.at`` in order, the scaled sums written back, bit for
bit, on every dtype, run layout, scale, special value and chunk boundary, streamed or not, on the
AVX2 path and the portable one (docs/selection.md#scatter-sum)."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt.select import host_native as sk
from hvd_commopt.select.kernels import kernels_for
from hvd_commopt.numpy_ops import NumpyOps
from hvd_commopt.reduce.sparse import scatter_result

native = pytest.importorskip("hvd_commopt.select._hostkernels",
                             reason="the native extension was not built (no C compiler at install time)")


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int32 if a.dtype == np.float32 else np.int64)


def _plain(n: int, idx: np.ndarray, vals: np.ndarray, scale: float):
    """The plain path's operations (reduce/sparse.py): zeros, add in order, scale the sums, write
    them back."""
    out = np.zeros(n, vals.dtype)
    np.add.at(out, idx, vals)
    sums = out[idx]
    if scale != 1.0:
        sums = sums * vals.dtype.type(scale)
        out[idx] = sums
    return out, sums, bool(np.isfinite(sums).all())


def _runs(rng, n: int, sizes: list[int]) -> np.ndarray:
    """The concatenation of ascending selections (one per rank), positions unique in each."""
    return np.concatenate([np.sort(rng.choice(n, s, replace=False)) for s in sizes]).astype(np.int64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,sizes", [(1, [1]), (1000, [10]), (1024, [100, 100]), (1025, [3, 1024, 7]),
                                     (70_001, [700, 700, 700, 700, 700]), (300_000, [3000] * 8)])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3, 1 / 7])
def test_build_is_bit_identical_to_the_plain_path(dtype, n, sizes, scale, simd, stream_min):
    rng = np.random.default_rng(n + len(sizes))
    idx = _runs(rng, n, sizes)
    vals = rng.standard_normal(idx.size).astype(dtype) * dtype(1e3)
    vals[::5] = -vals[::5]
    vals[3::11] = -0.0
    want_out, want_sums, want_finite = _plain(n, idx, vals, scale)
    out = np.full(n, 7.0, dtype)  # every element is overwritten, whatever the buffer held
    sums = np.empty(idx.size, dtype)
    assert sk.np_scatter_sum(out, idx, vals, scale, sums) is want_finite is True
    assert np.array_equal(_bits(out), _bits(want_out))
    assert np.array_equal(_bits(sums), _bits(want_sums))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_repeated_positions_add_in_order_and_non_finite_sums_are_reported(dtype, simd):
    n = 5000
    idx = np.array([1, 7, 4000, 4999, 1, 2, 7, 4999, 0, 7, 10], np.int64)  # three runs, repeats across them
    vals = np.array([1e-8, 3.0, np.inf, 2.0, 1.0, -1.0, 1e30, 5.0, 4.0, -1e30, np.nan], dtype)
    for scale in (1.0, 0.25, 1 / 3):
        want_out, want_sums, want_finite = _plain(n, idx, vals, scale)
        out, sums = np.ones(n, dtype), np.empty(idx.size, dtype)
        assert sk.np_scatter_sum(out, idx, vals, scale, sums) is want_finite is False
        assert np.array_equal(_bits(out), _bits(want_out)) and np.array_equal(_bits(sums), _bits(want_sums))
    finite_vals = np.nan_to_num(vals, nan=0.0, posinf=1.0).astype(dtype)
    out, sums = np.ones(n, dtype), np.empty(idx.size, dtype)
    assert sk.np_scatter_sum(out, idx, finite_vals, 1.0, sums) is True


def test_an_unaligned_buffer_and_an_empty_selection(stream_min):
    base = np.full(100_001, 3.0, np.float32)
    out = base[1:]  # 4 bytes past the allocation's alignment
    idx = np.array([0, 5, 99_999], np.int64)
    vals = np.array([1.0, -2.0, 3.0], np.float32)
    sums = np.empty(3, np.float32)
    assert sk.np_scatter_sum(out, idx, vals, 0.5, sums) is True
    want, want_sums, _ = _plain(out.size, idx, vals, 0.5)
    assert np.array_equal(_bits(out), _bits(want)) and np.array_equal(sums, want_sums) and base[0] == 3.0
    empty_i, empty_v = np.empty(0, np.int64), np.empty(0, np.float32)
    assert sk.np_scatter_sum(out, empty_i, empty_v, 0.5, empty_v.copy()) is True
    assert not out.any() and np.signbit(out).sum() == 0  # every element +0.0


def test_too_many_runs_leave_the_buffer_to_the_plain_path(restore_native):
    n = 1000
    idx = np.arange(200, dtype=np.int64)[::-1].copy()  # 200 descending entries: 200 runs
    vals = np.ones(200, np.float32)
    out = np.full(n, 9.0, np.float32)
    assert sk.np_scatter_sum(out, idx, vals, 1.0, np.empty(200, np.float32)) is None
    assert (out == 9.0).all()
    # the core falls back to the plain path and gets the same result
    got, finite, sums = scatter_result(NumpyOps(), out, n, idx, vals, 0.5)
    want, want_sums, _ = _plain(n, idx, vals, 0.5)
    assert finite and np.array_equal(got, want) and np.array_equal(sums, want_sums)


def test_bad_buffers_and_positions_are_refused():
    out, sums = np.zeros(100, np.float32), np.empty(3, np.float32)
    with pytest.raises(IndexError, match="outside"):
        native.scatter_sum(out, np.array([0, 100, 1], np.int64), np.ones(3, np.float32), 1.0, sums)
    with pytest.raises(ValueError, match="float32/float64"):
        native.scatter_sum(out, np.array([0, 1, 2], np.int64), np.ones(3, np.float64), 1.0, sums)
    # the wrapper declines what the kernel cannot take, leaving the plain path to it
    assert sk.np_scatter_sum(out.astype(np.float16), np.zeros(3, np.int64), np.ones(3, np.float16), 1.0,
                             np.empty(3, np.float16)) is None
    assert sk.np_scatter_sum(out, np.zeros(3, np.int32), np.ones(3, np.float32), 1.0, sums) is None


def test_scatter_result_takes_the_one_pass_build_with_the_same_bits(restore_native):
    """The core's sparse result (reduce/sparse.py) with the native build and without it."""
    rng = np.random.default_rng(9)
    n = 250_000
    idx = _runs(rng, n, [2500, 2500, 2500])
    vals = rng.standard_normal(idx.size).astype(np.float32)
    results = []
    for on in (True, False):
        sk.USE_NATIVE = on
        buf = rng.standard_normal(n).astype(np.float32)  # the round's bucket buffer, stale values
        out, finite, sums = scatter_result(NumpyOps(), buf, n, idx, vals, 1 / 3)
        assert out is buf and finite
        results.append((out.copy(), sums.copy()))
        if not on:  # kernels off: the adapter declines at once (no sums buffer), the plain path builds
            assert kernels_for(NumpyOps(), buf).scatter_sum(buf, idx, vals, 1 / 3) is None
    assert np.array_equal(_bits(results[0][0]), _bits(results[1][0]))
    assert np.array_equal(_bits(results[0][1]), _bits(results[1][1]))
