"""Adasum on in-process ranks (NumpyOps): docs/adasum.md#invariants (T-AS-1 … T-AS-4),
the closed form, the fold for sizes that are not powers of two, and the op=Adasum dispatch."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import NumpyOps, TensorSpec, build_engine, collectives, run_ranks
from hvd_commopt.buckets import Bucket
from hvd_commopt.compress.ternary import TernaryCompressor
from hvd_commopt.compression import Compression
from hvd_commopt.errors import ConfigError
from hvd_commopt.reduce import Adasum, AdasumReducer, ReduceContext, RoundInfo, make_reducer
from hvd_commopt.reduce.adasum import adasum_pair, adasum_tree, tensor_bounds

ops = NumpyOps()


def allreduce_adasum(vecs, **kw):
    return run_ranks(len(vecs), lambda comm: collectives.allreduce(comm, ops, vecs[comm.rank].copy(), op=Adasum, **kw))


def closed_form(a, b):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    d = a64 @ b64
    return (1 - d / (2 * (a64 @ a64))) * a64 + (1 - d / (2 * (b64 @ b64))) * b64


@pytest.mark.parametrize("P", [2, 4])
def test_orthogonal_gradients_are_summed(P):
    """T-AS-1: disjoint supports -> every pairwise dot is 0 -> exact sum."""
    n = 4 * P + 3
    vecs = []
    for r in range(P):
        v = np.zeros(n, np.float32)
        v[r::P] = np.arange(1, len(v[r::P]) + 1, dtype=np.float32) * (r + 1)
        vecs.append(v)
    for out in allreduce_adasum(vecs):
        np.testing.assert_array_equal(out, np.sum(vecs, axis=0))


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_identical_gradients_are_averaged(P):
    """T-AS-2: every rank holds v -> exactly v (coefficients 1/2 at every level)."""
    v = np.random.default_rng(1).standard_normal(37).astype(np.float32)
    for out in allreduce_adasum([v.copy() for _ in range(P)]):
        np.testing.assert_array_equal(out, v)


def test_two_ranks_closed_form():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal(10), rng.standard_normal(10)
    outs = allreduce_adasum([a, b])
    np.testing.assert_allclose(outs[0], closed_form(a, b), rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_parallel_gradients_blend():
    """b = 3a: coefficients 1 - 3/2 = -1/2 and 1 - 3/18 = 5/6 -> -a/2 + 5a/2 = 2a."""
    a = np.array([1.0, -2.0, 0.5, 4.0])
    for out in allreduce_adasum([a, 3 * a]):
        np.testing.assert_allclose(out, 2 * a, rtol=1e-15)


@pytest.mark.parametrize("P", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_all_ranks_equal_and_match_tree(P, n):
    """T-AS-3: bit-identical on every rank; the local operator tree up to float64 rounding."""
    rng = np.random.default_rng(P * 100 + n)
    vecs = [rng.standard_normal(n).astype(np.float64) for _ in range(P)]
    outs = allreduce_adasum(vecs)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    ref = adasum_tree(ops, [v.copy() for v in vecs], [(0, n)])
    np.testing.assert_allclose(outs[0], ref, rtol=1e-10, atol=1e-12)


def test_zero_vector_contributes_nothing():
    v = np.array([1.0, 2.0, 3.0], np.float32)
    for out in allreduce_adasum([v, np.zeros(3, np.float32)]):
        np.testing.assert_array_equal(out, v)


def test_per_tensor_in_a_fused_bucket():
    """T-AS-4: a bucket of two tensors = each tensor reduced alone."""
    P = 4
    rng = np.random.default_rng(3)
    specs = [TensorSpec("w", (3, 5), "float64"), TensorSpec("b", (6,), "float64")]
    bucket = Bucket.of(0, specs)
    vecs = [rng.standard_normal(21) for _ in range(P)]

    def body(comm):
        fused = AdasumReducer().reduce(bucket, RoundInfo(), vecs[comm.rank].copy(), ReduceContext(comm, ops))
        w = collectives.allreduce(comm, ops, vecs[comm.rank][:15].copy(), op=Adasum, name="w")
        b = collectives.allreduce(comm, ops, vecs[comm.rank][15:].copy(), op=Adasum, name="b")
        return fused, np.concatenate([w, b])
    for fused, alone in run_ranks(P, body):
        np.testing.assert_allclose(fused, alone, rtol=1e-12, atol=1e-14)
    assert tensor_bounds(bucket) == [(0, 15), (15, 21)]
    # and it is not the whole-bucket operator
    whole = adasum_tree(ops, [v.copy() for v in vecs], [(0, 21)])
    assert not np.allclose(whole, fused)


def test_scale_factors_and_no_division():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    for out in allreduce_adasum([a, b], prescale_factor=2.0, postscale_factor=0.5):
        np.testing.assert_array_equal(out, [1.0, 1.0])


def test_fp16_compression_and_float32():
    v = np.random.default_rng(4).standard_normal(9).astype(np.float32)
    outs = allreduce_adasum([v, v], compression=Compression.fp16)
    np.testing.assert_array_equal(outs[0], v.astype(np.float16).astype(np.float32))
    assert outs[0].dtype == np.float32


def test_one_rank_returns_the_input():
    v = np.arange(5.0)
    np.testing.assert_array_equal(allreduce_adasum([v])[0], v)


def test_pair_is_symmetric():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal(8), rng.standard_normal(8)
    np.testing.assert_allclose(adasum_pair(ops, a, b, [(0, 8)]), adasum_pair(ops, b, a, [(0, 8)]), rtol=1e-14)


def test_errors():
    with pytest.raises(ConfigError, match="floating"):
        allreduce_adasum([np.arange(3), np.arange(3)])
    with pytest.raises(ConfigError, match="Adasum"):
        make_reducer(Compression.topk(0.1), Adasum)
    with pytest.raises(ConfigError, match="Adasum"):
        AdasumReducer(TernaryCompressor(0.5, 2))


def test_engine_op_adasum():
    """The optimizers' path: op=Adasum picks the Adasum reducer, gradients are not divided by P."""
    P = 2
    grads = [{"w": np.array([1.0, 0.0, 2.0]), "b": np.array([3.0])},
             {"w": np.array([0.0, 5.0, 0.0]), "b": np.array([3.0])}]

    def body(comm):
        e = build_engine(comm, ops, op=Adasum)
        e.register([TensorSpec("w", (3,), "float64"), TensorSpec("b", (1,), "float64")])
        assert isinstance(e.reducer, AdasumReducer)
        return e.reduce_step({k: v.copy() for k, v in grads[comm.rank].items()})
    for out in run_ranks(P, body):
        np.testing.assert_array_equal(out["w"], [1.0, 5.0, 2.0])  # orthogonal: summed
        np.testing.assert_array_equal(out["b"], [3.0])            # identical: averaged
    with pytest.raises(ConfigError, match="gradient_predivide_factor"):
        run_ranks(1, lambda comm: build_engine(comm, ops, op=Adasum, gradient_predivide_factor=2.0))


def test_traffic_is_that_of_a_ring_allreduce_plus_the_dots():
    """docs/adasum.md#halving-doubling: n(P-1)/P elements out in the halving, as many in the
    gathering, plus 3 float64 per tensor and group round (level l has l+1 rounds: L(L+1)/2 = 3
    for P = 2^L = 4)."""
    P, n = 4, 1000
    bucket = Bucket.single("b", n, "float64")

    def body(comm):
        red = AdasumReducer()
        pending = red.start(bucket, RoundInfo(), np.ones(n) * (comm.rank + 1), ReduceContext(comm, ops))
        red.finish(pending, ReduceContext(comm, ops))
        return pending.bytes_sent
    assert run_ranks(P, body) == [2 * n * (P - 1) // P * 8 + 3 * 8 * 3] * P
