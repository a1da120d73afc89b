"""Compressors that never communicate: fp16/bf16 casts, top-k, random-k, DGC (docs/topk.md#update-rule, docs/dgc.md#update-rule)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hvd_commopt import Compression, ConfigError, NumpyOps, run_ranks
from hvd_commopt.compress import (BF16Compressor, DensitySpec, DGCSelector, FP16Compressor, NoneCompressor,
                                  RandomKSelector, TopKSelector)
from hvd_commopt.memory.dgc import DGCMemory
from hvd_commopt.compress.dgc import warmup_ratio
from hvd_commopt.compress.randomk import randomk_indices
from hvd_commopt.buckets import Bucket, TensorSpec
from hvd_commopt.memory.error_feedback import ErrorFeedback
from hvd_commopt.engine import make_reducer
from hvd_commopt.reduce import DenseAllreduce, GTopK, ReduceContext, SparseAllgather
from tests.reducers import bucket, reduce_once

ops = NumpyOps()


def rand(n, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


# -- fp16 / bf16 -------------------------------------------------------------------------------
@pytest.mark.parametrize("comp,wire,rtol", [(FP16Compressor(), np.float16, 1e-3), (BF16Compressor(), np.uint16, 8e-3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cast_round_trip_dtypes(comp, wire, rtol, dtype):
    x = rand(1000, dtype=dtype)
    payload, ctx = comp.compress(ops, x.copy())
    assert payload.dtype == wire  # NumPy carries bf16 as uint16 bit patterns
    y = comp.decompress(ops, payload, ctx)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, x, rtol=rtol, atol=1e-6)
    assert comp.predivide  # average before the narrow sum (no overflow)


def test_cast_leaves_integers_and_narrow_alone():
    for comp in (FP16Compressor(), BF16Compressor(), NoneCompressor()):
        i = np.arange(10, dtype=np.int64)
        p, c = comp.compress(ops, i)
        assert p.dtype == np.int64 and comp.decompress(ops, p, c).dtype == np.int64
    h = rand(10, dtype=np.float16)
    p, c = FP16Compressor().compress(ops, h)
    assert p is h and FP16Compressor().decompress(ops, p, c).dtype == np.float16


@pytest.mark.parametrize("comp", [Compression.fp16, Compression.bf16, Compression.none])
def test_cast_allreduce_average_three_ranks(comp):
    data = [rand(257, seed=r) * 100 for r in range(3)]

    def body(comm):
        red = make_reducer(comp)
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        out = reduce_once(red, "b", data[comm.rank].copy(), ctx)
        return out

    outs = run_ranks(3, body)
    ref = sum(d.astype(np.float64) for d in data) / 3
    for o in outs:
        assert o.dtype == np.float32
        np.testing.assert_allclose(o, ref, rtol=1e-2, atol=0.2)
        np.testing.assert_array_equal(o, outs[0])


# -- density validation ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), float("inf"), "0.1", True, None])
@pytest.mark.parametrize("factory", [Compression.topk, Compression.randomk, Compression.dgc, Compression.gtopk])
def test_density_outside_unit_interval_is_a_clear_error(factory, bad):
    with pytest.raises(ConfigError) as e:
        factory(bad)
    assert "(0, 1]" in str(e.value)


def test_density_dict_and_callable_validation():
    with pytest.raises(ConfigError, match=r"density\['fc.weight'\].*\(0, 1\]"):
        Compression.topk({"fc.weight": 2.0, "default": 0.1})
    with pytest.raises(ConfigError, match="empty"):
        Compression.topk({})
    spec = DensitySpec(lambda name, n: 0.0)
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        spec(bucket("bucket0:x"), 10)


def test_density_spec_resolution():
    def engine_bucket(index, *names):  # a bucket as the engine builds it: named after its first tensor
        return Bucket.of(index, [TensorSpec(n, (10,), "float32") for n in names])

    spec = DensitySpec({"fc.weight": 0.5, "bucket3:conv+2": 0.25, "default": 0.01})
    assert spec(engine_bucket(0, "fc.weight"), 100) == 0.5
    assert engine_bucket(3, "conv", "a", "b").name == "bucket3:conv+2"
    assert spec(engine_bucket(3, "conv", "a", "b"), 100) == 0.25
    assert spec(engine_bucket(1, "other"), 100) == 0.01
    assert spec(engine_bucket(12, "fc.weight", "x", "y", "z"), 100) == 0.5  # by its first tensor
    with pytest.raises(ConfigError, match="default"):
        DensitySpec({"a": 0.5})(engine_bucket(0, "b"), 10)
    assert DensitySpec(lambda name, n: 1.0 if n < 100 else 0.1)(bucket("x"), 10) == 1.0


def test_k_per_bucket_rule():
    c = TopKSelector(0.01)
    assert c.k_for(1000) == 10
    assert c.k_for(150) == 1      # int(1.5) = 1
    assert c.k_for(3) == 1        # a layer smaller than 1/density still sends one
    assert TopKSelector(1.0).k_for(7) == 7
    assert DGCSelector(0.01).k_for(150) == 2  # DGC: ceil


# -- top-k ------------------------------------------------------------------------------------
def test_topk_is_exact_with_ties_to_lower_index():
    x = np.array([1, -3, 3, 0, 2, -3, 1], dtype=np.float32)
    vals, idx = TopKSelector(3 / 7 + 1e-9).select(ops, x)
    assert idx.tolist() == [1, 2, 5] and vals.tolist() == [-3, 3, -3]
    vals, idx = TopKSelector(2 / 7 + 1e-9).select(ops, x)
    assert idx.tolist() == [1, 2]  # three tie at |3|: the two lowest indices win
    x = rand(5000, seed=3)
    vals, idx = TopKSelector(0.01).select(ops, x)
    ref = np.sort(np.argsort(-np.abs(x), kind="stable")[:50])
    np.testing.assert_array_equal(idx, ref)
    np.testing.assert_array_equal(vals, x[ref])


def test_topk_select_scatters_back_to_the_selected_entries():
    c = TopKSelector(0.1)
    x = rand(100)
    vals, idx = c.select(ops, x)
    y = ops.scatter_add(ops.zeros(100, "float32"), idx, vals)
    assert np.count_nonzero(y) == 10 and y.dtype == x.dtype
    np.testing.assert_array_equal(y[idx], x[idx])
    assert c.collective == "sparse"


# -- random-k ---------------------------------------------------------------------------------
def test_randomk_indices_shared_seed():
    a = randomk_indices(7, "bucket0:w", 3, 10_000, 100)
    b = randomk_indices(7, "bucket0:w", 3, 10_000, 100)
    np.testing.assert_array_equal(a, b)
    assert len(np.unique(a)) == 100 and np.all(np.diff(a) > 0) and a.dtype == np.int64
    assert not np.array_equal(a, randomk_indices(7, "bucket0:w", 4, 10_000, 100))   # other step
    assert not np.array_equal(a, randomk_indices(7, "bucket1:w", 3, 10_000, 100))   # other bucket
    assert not np.array_equal(a, randomk_indices(8, "bucket0:w", 3, 10_000, 100))   # other seed


def test_randomk_without_memory_allreduces_the_same_indices():
    """collective == 'allreduce': every rank draws the same indices, so the k values are summed."""
    data = [rand(1000, seed=r) for r in range(3)]

    def body(comm):
        red = SparseAllgather(RandomKSelector(0.05, seed=1), ErrorFeedback(enabled=False))
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        return [reduce_once(red, "b", data[comm.rank].copy(), ctx, step=s) for s in range(2)]

    outs = run_ranks(3, body)
    for step in range(2):
        idx = randomk_indices(1, "b", step, 1000, 50)
        ref = np.zeros(1000, np.float32)
        ref[idx] = sum(d[idx] for d in data) / 3
        for o in outs:
            np.testing.assert_allclose(o[step], ref, rtol=1e-6)
            assert np.count_nonzero(o[step]) == 50


def test_make_reducer_checks_the_collective():
    for selector in (TopKSelector(0.1), RandomKSelector(0.1)):
        with pytest.raises(ConfigError, match="sparse exchange"):
            make_reducer(selector)
    with pytest.raises(ConfigError, match="not an allreduce"):
        DenseAllreduce(DGCSelector(0.1))
    with pytest.raises(ConfigError, match="sparse compressor"):
        SparseAllgather(FP16Compressor())
    for red in (Compression.topk(0.1), Compression.randomk(0.1), Compression.dgc(0.1, momentum=0.9), Compression.gtopk(0.1)):
        assert make_reducer(red) is red
    assert isinstance(Compression.gtopk(0.1), GTopK)
    with pytest.raises(ConfigError, match="index_dtype"):
        Compression.topk(0.1, index_dtype="float32")
    with pytest.raises(ConfigError, match="algorithm"):
        Compression.gtopk(0.1, algorithm="tree")


# -- DGC --------------------------------------------------------------------------------------
def test_dgc_warmup_follows_the_code_not_the_readme():
    got = [warmup_ratio(0.001, e, 5) for e in range(6)]
    np.testing.assert_allclose(got[:5], [0.001 ** ((e + 1) / 6) for e in range(5)])
    np.testing.assert_allclose(got[:5], [0.3162, 0.1, 0.03162, 0.01, 0.003162], rtol=1e-3)
    assert got[5] == 0.001
    readme = [0.25, 0.063, 0.015, 0.004, 0.001]
    assert [warmup_ratio(0.001, e, 5, readme) for e in range(6)] == readme + [0.001]
    assert warmup_ratio(0.001, 0, 5, 0.5) == 0.5 and warmup_ratio(0.001, 4, 5, 0.5) == 0.5 ** 5
    assert warmup_ratio(0.1, 3, 5, 0.5) == 0.1  # never below the final ratio
    assert warmup_ratio(0.001, 2, 0) == 0.001


def test_dgc_epoch_from_steps_or_set_epoch():
    c = DGCSelector(0.001, warmup_epochs=5, steps_per_epoch=10)
    assert c.ratio(None, 10**6, step=0) == pytest.approx(0.001 ** (1 / 6))
    assert c.ratio(None, 10**6, step=25) == pytest.approx(0.001 ** (3 / 6))
    c.set_epoch(9)
    assert c.ratio(None, 10**6, step=0) == 0.001
    with pytest.raises(ConfigError, match="steps_per_epoch"):
        DGCSelector(0.001, warmup_epochs=5).ratio(None, 100)
    with pytest.raises(ConfigError, match="one ratio per warm-up epoch"):
        DGCSelector(0.001, warmup_epochs=5, warmup_coeff=[0.1, 0.01])
    red = Compression.dgc(0.001, warmup_epochs=2, steps_per_epoch=1, momentum=0.9)
    red.set_epoch(1)
    assert red.compressor.ratio(None, 100) == pytest.approx(0.001 ** (2 / 3))


def test_dgc_sampling_parameters_match_reference():
    c = DGCSelector(0.001)
    stride, ns, tks = c.sampling(1_000_000, 0.001)
    # reference: max(pct=10000, cpr=2000) -> stride ceil(1e6/1e4/32)*32+1 = 129, reduced by 8 until >= 1e4
    assert (stride, ns) == (97, 1_000_000 // 97) and tks == math.ceil(ns * 0.001)
    assert c.sampling(1500, 0.001)[:2] == (1, 1500)  # numel <= 2/ratio: every element is a sample


def test_dgc_select_near_k_and_large_values():
    x = rand(200_000, seed=5)
    c = DGCSelector(0.001)
    for step in range(3):
        vals, idx = c.select(ops, x, bucket("bucket0:w"), step)
        k = 200
        assert 0.8 * k <= len(idx) <= k
        assert np.all(np.diff(idx) > 0)
        np.testing.assert_array_equal(vals, x[idx])
        # everything selected is above (almost) everything not selected
        assert np.abs(vals).min() >= np.quantile(np.abs(x), 1 - 2.5 * k / x.size)


def test_dgc_select_with_full_sampling_is_exact_topk():
    x = rand(20_000, seed=6)
    vals, idx = DGCSelector(0.01, sample_ratio=1.0).select(ops, x, bucket("b"), 0)
    _, ref = ops.topk_abs(x, 200)
    np.testing.assert_array_equal(idx, ref)


def test_dgc_memory_momentum_correction_and_masking():
    mem = DGCMemory(momentum=0.9)
    g1, g2 = rand(10, seed=1), rand(10, seed=2)
    v1 = mem.compensate(ops, "b", g1.copy()).copy()          # u = g1, v = g1
    np.testing.assert_array_equal(v1, g1)
    idx = np.array([2, 5])
    mem.update(ops, "b", mem.residual(ops, "b", g1), idx)
    v2 = mem.compensate(ops, "b", g2.copy()).copy()
    u_ref = 0.9 * np.where(np.isin(np.arange(10), idx), 0, g1).astype(np.float32) + g2
    v_ref = np.where(np.isin(np.arange(10), idx), 0, g1).astype(np.float32) + u_ref
    np.testing.assert_allclose(v2, v_ref, rtol=1e-6)
    mem_nm = DGCMemory(momentum=0.9, momentum_masking=False)
    mem_nm.compensate(ops, "b", g1.copy())
    mem_nm.update(ops, "b", mem_nm.residual(ops, "b", g1), idx)
    assert mem_nm._u.live("b")[2] == g1[2]  # not masked


def test_dgc_memory_nesterov_and_clipping():
    g = np.full(4, 3.0, np.float32)  # norm 6
    mem = DGCMemory(momentum=0.5, nesterov=True, clip_norm=1.0)
    v = mem.compensate(ops, "b", g.copy())
    gc = g / (6 + 1e-6)
    np.testing.assert_allclose(v, 0.5 * gc + gc, rtol=1e-6)  # u = μ(0+g); v = 0 + u + g
    with pytest.raises(ConfigError):
        DGCMemory(clip_norm=0)
    with pytest.raises(ConfigError):
        DGCMemory(momentum=1.0)
