"""Sparse reducers on in-process ranks (NumpyOps): Top-k allgather, random-k, DGC, gTop-k.

The constructors are given ``min_k=1``, the reference rule ``k = max(int(n·ρ), 1)`` the expected
values here are written in (the default floor is 16, docs/topk.md#density-floor).

docs/topk.md#invariants, docs/gtopk.md#what-it-equals, docs/gtopk.md#invariants, docs/lags-omgs.md#invariants, docs/wrapper.md#degenerate-case-tests.
"""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, TensorSpec, build_engine, run_ranks
from hvd_commopt.compress import TopKSelector
from hvd_commopt.compress.randomk import randomk_indices
from hvd_commopt.reduce import DenseAllreduce, GTopK, ReduceContext, SparseAllgather
from hvd_commopt.reduce.gtopk import gtopk_simulate, merge
from tests.reducers import start

ops = NumpyOps()
SIZES = [2, 3, 4, 5, 6, 7, 8]


def data_for(P, steps, n, seed=0, dtype=np.float32, integer=False):
    out = {}
    for r in range(P):
        rng = np.random.default_rng(seed * 1000 + r)
        for s in range(steps):
            x = rng.integers(-50, 51, n) if integer else rng.standard_normal(n) * (1 + r)
            out[r, s] = x.astype(dtype)
    return out


def run(P, factory, data, steps, post="average", name="b", size=None):
    """Per rank: [(residual before the step, output, residual after, bytes_sent)] per step."""
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size if post == "average" else 1.0)
        red = factory()
        rec = []
        for s in range(steps):
            x = data[comm.rank, s]
            before = getattr(red, "residual", lambda *a: None)(ops, name, x)
            before = np.zeros_like(x) if before is None else before.copy()
            p = start(red, name, x.copy(), ctx, step=s)
            out = red.finish(p, ctx)
            after = getattr(red, "residual", lambda *a: None)(ops, name, x)
            after = np.zeros_like(x) if after is None else after.copy()
            rec.append((before, out, after, p.bytes_sent))
        return rec
    return run_ranks(P, body)


def leaves_of(P, data, recs, s, k):
    out = []
    for r in range(P):
        acc = data[r, s] + recs[r][s][0]
        v, i = ops.topk_abs(acc, k)
        out.append((i, v))
    return out


def scatter(n, idx, vals, dtype=np.float32):
    y = np.zeros(n, dtype)
    np.add.at(y, idx, vals)
    return y


# -- density 1 equals dense (T-GT-6, docs/topk.md#invariants, docs/wrapper.md#degenerate-case-tests) ----------------------------------------
@pytest.mark.parametrize("factory", [lambda: Compression.topk(1.0, min_k=1), lambda: Compression.gtopk(1.0, min_k=1),
                                     lambda: Compression.randomk(1.0, min_k=1),
                                     lambda: Compression.dgc(1.0, momentum=0.0)])
def test_density_one_equals_dense_bit_exact(factory):
    data = data_for(3, 3, 300)
    dense = run(3, DenseAllreduce, data, 3)
    got = run(3, factory, data, 3)
    for r in range(3):
        for s in range(3):
            assert np.array_equal(got[r][s][1], dense[r][s][1])
            assert got[r][s][3] == dense[r][s][3]  # the dense allreduce's traffic
            assert not np.any(got[r][s][2])        # nothing left behind


@pytest.mark.parametrize("P", [2, 3])
def test_density_one_through_the_sparse_paths(P):
    data = data_for(P, 2, 200)
    dense = run(P, DenseAllreduce, data, 2)
    topk = run(P, lambda: SparseAllgather(TopKSelector(1.0), dense_when_full=False), data, 2)
    gtopk = run(P, lambda: GTopK(1.0, dense_when_full=False), data, 2)
    for r in range(P):
        for s in range(2):
            assert np.array_equal(topk[r][s][1], dense[r][s][1])  # same summation order (rank order)
            if P == 2:
                assert np.array_equal(gtopk[r][s][1], dense[r][s][1])
            np.testing.assert_allclose(gtopk[r][s][1], dense[r][s][1], rtol=1e-6, atol=1e-6)


def test_dgc_density_one_is_momentum_sgd_on_the_average():
    data = data_for(2, 3, 50)
    got = run(2, lambda: Compression.dgc(1.0, momentum=0.9), data, 3)
    u = np.zeros(50, np.float32)
    for s in range(3):
        avg = (data[0, s] + data[1, s]) * np.float32(0.5)
        u = u * np.float32(0.9) + avg
        np.testing.assert_allclose(got[0][s][1], u, rtol=1e-6)


# -- P = 1 and P = 2 closed forms (T-GT-3) -----------------------------------------------------
@pytest.mark.parametrize("factory", [lambda: Compression.topk(0.05, min_k=1), lambda: Compression.gtopk(0.05, min_k=1)])
def test_one_rank_is_local_topk(factory):
    data = data_for(1, 3, 400)
    rec = run(1, factory, data, 3)[0]
    for s in range(3):
        acc = data[0, s] + rec[s][0]
        v, i = ops.topk_abs(acc, 20)
        assert np.array_equal(rec[s][1], scatter(400, i, v))
        assert np.array_equal(rec[s][1] + rec[s][2], acc)
        assert rec[s][3] == 0


def test_two_ranks_gtopk_is_topk_of_the_sum():
    k, n = 15, 600
    data = data_for(2, 4, n, seed=4)
    recs = run(2, lambda: Compression.gtopk(k / n, min_k=1), data, 4, post="sum")
    for s in range(4):
        (i0, v0), (i1, v1) = leaves_of(2, data, recs, s, k)
        x = scatter(n, i0, v0) + scatter(n, i1, v1)
        v, i = ops.topk_abs(x, k)
        assert np.array_equal(recs[0][s][1], scatter(n, i, v))
        assert np.array_equal(recs[1][s][1], recs[0][s][1])


# -- gTop-k: the oracle, identical ranks, conservation (T-GT-1, -2, -4, -5) --------------------
@pytest.mark.parametrize("P", SIZES)
def test_gtopk_equals_allgather_and_simulate_oracle(P):
    n, k, steps = 500, 12, 3
    data = data_for(P, steps, n, seed=P)
    recs = run(P, lambda: Compression.gtopk(k / n + 1e-9, min_k=1), data, steps, post="sum")
    ag = run(P, lambda: Compression.gtopk(k / n + 1e-9, algorithm="allgather", min_k=1), data, steps, post="sum")
    for s in range(steps):
        leaves = leaves_of(P, data, recs, s, k)
        I, V, alive = gtopk_simulate(ops, leaves, k)
        assert len(np.unique(I)) == len(I) <= k                       # T-GT-2
        ref = scatter(n, I, V)
        for r in range(P):
            assert np.array_equal(recs[r][s][1], ref)                 # T-GT-1 and T-GT-4, bit-exact
            assert np.array_equal(ag[r][s][1], ref)
            acc = data[r, s] + recs[r][s][0]
            survivors = leaves[r][0][alive[r]]
            expect = acc.copy()
            expect[survivors] = 0                                      # only survivors left the residual
            assert np.array_equal(recs[r][s][2], expect)
            assert np.array_equal(ag[r][s][2], expect)


@pytest.mark.parametrize("P", SIZES)
def test_gtopk_conservation_of_gradient_mass_exact(P):
    """Σ_i acc_i == R + Σ_i residual_i', exactly with integer-valued float64 data (T-GT-5)."""
    n, steps = 300, 4
    data = data_for(P, steps, n, seed=10 + P, dtype=np.float64, integer=True)
    recs = run(P, lambda: Compression.gtopk(0.03, min_k=1), data, steps, post="sum")
    for s in range(steps):
        accs = sum(data[r, s] + recs[r][s][0] for r in range(P))
        rhs = recs[0][s][1] + sum(recs[r][s][2] for r in range(P))
        assert np.array_equal(accs, rhs)


def test_gtopk_conservation_fp32_tolerance():
    P, n = 6, 2000
    data = data_for(P, 3, n, seed=2)
    recs = run(P, lambda: Compression.gtopk(0.01, min_k=1), data, 3, post="sum")
    for s in range(3):
        accs = sum((data[r, s] + recs[r][s][0]).astype(np.float64) for r in range(P))
        rhs = recs[0][s][1].astype(np.float64) + sum(recs[r][s][2].astype(np.float64) for r in range(P))
        np.testing.assert_allclose(accs, rhs, atol=1e-4)


def test_merge_is_robust_union():
    a = (np.array([1, 4, 7]), np.array([1.0, -5.0, 2.0]))
    b = (np.array([4, 7, 9]), np.array([5.0, 1.0, 0.5]))
    I, V = merge(ops, a, b, 3)
    # 4 cancels to 0; |7|=3, |1|=1, |9|=0.5 -> {1, 7, 9}; indices unique, ascending
    assert I.tolist() == [1, 7, 9] and V.tolist() == [1.0, 3.0, 0.5]
    I, V = merge(ops, (np.array([2, 3]), np.array([1.0, 1.0])), (np.array([0, 5]), np.array([1.0, -1.0])), 2)
    assert I.tolist() == [0, 2]  # four-way tie: the smaller indices


@pytest.mark.parametrize("factory", [lambda: Compression.topk(0.02, min_k=1), lambda: Compression.gtopk(0.02, min_k=1),
                                     lambda: Compression.randomk(0.02, seed=5, min_k=1), lambda: Compression.dgc(0.02, momentum=0.9)])
@pytest.mark.parametrize("P", [4, 5])
def test_all_ranks_hold_identical_results(factory, P):
    data = data_for(P, 3, 1000, seed=7)
    recs = run(P, factory, data, 3)
    for s in range(3):
        for r in range(1, P):
            assert np.array_equal(recs[r][s][1], recs[0][s][1])


@pytest.mark.parametrize("P", [1, 3])
def test_topk_allgather_is_average_of_local_topk(P):
    n, k = 800, 8
    data = data_for(P, 3, n, seed=8)
    recs = run(P, lambda: Compression.topk(k / n, min_k=1), data, 3)
    for s in range(3):
        ref = np.zeros(n, np.float32)
        for r in range(P):
            acc = data[r, s] + recs[r][s][0]
            v, i = ops.topk_abs(acc, k)
            np.add.at(ref, i, v)
            assert np.array_equal(scatter(n, i, v) + recs[r][s][2], acc)  # sent + residual == acc
        ref *= np.float32(1.0 / P)
        assert np.array_equal(recs[0][s][1], ref)


def test_randomk_indices_identical_across_ranks_and_values_averaged():
    P, n, k = 4, 1000, 20
    data = data_for(P, 3, n, seed=9)
    recs = run(P, lambda: Compression.randomk(k / n, seed=11, min_k=1), data, 3, name="bucket0:w")
    for s in range(3):
        idx = randomk_indices(11, "bucket0:w", s, n, k)
        for r in range(P):
            acc = data[r, s] + recs[r][s][0]
            assert np.flatnonzero(recs[r][s][2] == 0).tolist() == idx.tolist()  # same k zeroed everywhere
            np.testing.assert_allclose(recs[r][s][1][idx], sum(data[q, s] + recs[q][s][0] for q in range(P))[idx] / P,
                                       rtol=1e-5)
            assert np.count_nonzero(recs[r][s][1]) == k
            assert np.array_equal(recs[r][s][2][np.setdiff1d(np.arange(n), idx)], acc[np.setdiff1d(np.arange(n), idx)])


def test_dgc_across_ranks_sends_velocity_and_masks():
    P, n = 3, 50_000
    data = data_for(P, 2, n, seed=12)
    recs = run(P, lambda: Compression.dgc(0.001, momentum=0.9), data, 2)
    for s in range(2):
        out = recs[0][s][1]
        assert 0 < np.count_nonzero(out) <= P * 50
        for r in range(P):
            sent_idx = np.flatnonzero((recs[r][s][2] == 0))
            assert 0.8 * 50 <= len(sent_idx) <= 50


# -- dtypes, small layers ----------------------------------------------------------------------
@pytest.mark.parametrize("factory", [lambda: Compression.topk(0.05, min_k=1), lambda: Compression.gtopk(0.05, min_k=1),
                                     lambda: Compression.randomk(0.05, min_k=1), lambda: Compression.dgc(0.05, momentum=0.9),
                                     lambda: Compression.gtopk(1.0, min_k=1)])
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_dtype_round_trip(factory, dtype):
    data = data_for(3, 2, 300, dtype=dtype)
    recs = run(3, factory, data, 2)
    for r in range(3):
        for s in range(2):
            assert recs[r][s][1].dtype == dtype and recs[r][s][2].dtype == dtype


def test_layer_smaller_than_k_and_fewer_nonzeros_than_k():
    P = 3
    tiny = {(r, 0): np.array([0, 0, 3.0 * (r + 1)], np.float32) for r in range(P)}
    for factory in (lambda: Compression.topk(0.01, min_k=1), lambda: Compression.gtopk(0.01, min_k=1)):
        recs = run(P, factory, tiny, 1, post="sum")
        assert recs[0][0][1].tolist() == [0, 0, 18.0]           # k = max(int(3*0.01), 1) = 1
    zeros = {(r, 0): np.zeros(40, np.float32) for r in range(P)}
    sparse = {(r, 0): np.where(np.arange(40) == r, 1.0, 0.0).astype(np.float32) for r in range(P)}
    for d in (zeros, sparse):
        recs = run(P, lambda: Compression.gtopk(0.25, min_k=1), d, 1, post="sum")  # k = 10 > non-zeros
        total = sum(d[r, 0] for r in range(P))
        assert np.array_equal(recs[0][0][1] + sum(recs[r][0][2] for r in range(P)), total)
        assert np.array_equal(recs[0][0][1], total)


# -- traffic formulas -----------------------------------------------------------------------------
def gtopk_bytes(P, r, k, word=8, mask=1):
    m = 1 << (P.bit_length() - 1)
    rem = P - m
    rounds = m.bit_length() - 1
    if r >= m:
        return k * word                                 # fold: my list to rank r - m
    return rounds * k * word + (k * word + k * mask if r < rem else 0)  # rounds + unfold (+ mask)


@pytest.mark.parametrize("P", SIZES)
def test_traffic_formulas(P):
    n, k = 1000, 10
    data = data_for(P, 1, n)
    topk = run(P, lambda: Compression.topk(k / n, min_k=1), data, 1)
    topk64 = run(P, lambda: Compression.topk(k / n, index_dtype="int64", min_k=1), data, 1)
    gtopk = run(P, lambda: Compression.gtopk(k / n, min_k=1), data, 1)
    randk = run(P, lambda: Compression.randomk(k / n, min_k=1), data, 1)
    dense = run(P, lambda: Compression.topk(1.0, min_k=1), data, 1)
    for r in range(P):
        assert topk[r][0][3] == (P - 1) * k * (4 + 4)      # k·(value + index bytes) to each of P-1 peers
        assert topk64[r][0][3] == (P - 1) * k * (4 + 8)
        assert gtopk[r][0][3] == gtopk_bytes(P, r, k)      # 2k words per round, + fold/unfold
        assert randk[r][0][3] == int(2 * (P - 1) / P * k * 4)  # allreduce of k values, no indices
        assert dense[r][0][3] == int(2 * (P - 1) / P * n * 4)
    if P & (P - 1) == 0:  # power of two: exactly log2 P rounds on every rank, as in the paper
        assert all(gtopk[r][0][3] == (P.bit_length() - 1) * 2 * k * 4 for r in range(P))


# -- LAGS through the engine --------------------------------------------------------------------
SPECS = [TensorSpec("w1", (40, 25), "float32"), TensorSpec("b1", (3,), "float32"),
         TensorSpec("w2", (10, 40), "float32")]


class SpyTopK(SparseAllgather):
    def __init__(self, log, density):
        super().__init__(TopKSelector(density, dense_1d=False))  # b1 selected too, as the LAGS paper does
        self.log = log

    def start(self, bucket, rnd, flat, ctx):
        self.log.append(f"start:{rnd.wire(bucket)}")
        return super().start(bucket, rnd, flat, ctx)


def test_lags_per_layer_buckets_pipelined_from_hooks_with_per_layer_density():
    P = 2
    grads = {(r, s.name): np.random.default_rng(r * 10 + i).standard_normal(s.numel).astype(np.float32)
             for r in range(P) for i, s in enumerate(SPECS)}
    density = {"w2": 0.05, "w1": 0.01, "default": 0.5}

    def body(comm):
        log = []
        eng = build_engine(comm, ops, compression=SpyTopK(log, density), fusion_threshold=0)
        eng.register(SPECS)
        assert [list(b.names) for b in eng.buckets] == [["w2"], ["b1"], ["w1"]]  # one bucket per layer
        for name in eng.backward_names:  # backward order: w2, b1, w1
            log.append(f"ready:{name}")
            eng.grad_ready(name, grads[comm.rank, name].copy())
        out = eng.reduce_step()
        return log, out, eng.last_stats.per_bucket

    results = run_ranks(P, body)
    log = results[0][0]
    # each bucket's exchange starts from the hook, before the next gradient is ready (overlap)
    assert log == ["ready:w2", "start:bucket0:w2", "ready:b1", "start:bucket1:b1", "ready:w1", "start:bucket2:w1"]
    per_bucket = results[0][2]
    ks = {"bucket0:w2": 20, "bucket1:b1": 1, "bucket2:w1": 10}   # 400·0.05, max(int(3·0.5),1), 1000·0.01
    for b, k in ks.items():
        assert per_bucket[b]["bytes_sent"] == (P - 1) * k * 8
    for s in SPECS:  # each layer: its own top-k, averaged
        k = ks[[b for b in ks if b.endswith(s.name)][0]]
        ref = np.zeros(s.numel, np.float32)
        for r in range(P):
            v, i = ops.topk_abs(grads[r, s.name], k)
            np.add.at(ref, i, v)
        ref *= np.float32(0.5)
        for r in range(P):
            assert results[r][1][s.name].shape == s.shape
            assert np.array_equal(results[r][1][s.name].reshape(-1), ref)


@pytest.mark.parametrize("factory", [lambda: Compression.gtopk(0.01, momentum_correction=False, dense_1d=False, min_k=1),
                                     lambda: Compression.topk(0.01, momentum_correction=False, dense_1d=False, min_k=1)])
def test_whole_model_single_bucket_is_global_topk(factory):
    P = 3
    grads = {(r, s.name): np.random.default_rng(r * 10 + i).standard_normal(s.numel).astype(np.float32)
             for r in range(P) for i, s in enumerate(SPECS)}

    def body(comm):
        eng = build_engine(comm, ops, compression=factory(), fusion_threshold=1 << 30)
        eng.register(SPECS)
        assert len(eng.buckets) == 1
        for _ in range(2):
            for name in eng.backward_names:
                eng.grad_ready(name, grads[comm.rank, name].copy())
            out = eng.reduce_step()
        nnz = sum(np.count_nonzero(v) for v in out.values())
        return nnz, eng.state_dict(), out

    res = run_ranks(P, body)
    total = sum(s.numel for s in SPECS)
    k = int(total * 0.01)
    assert res[0][0] <= (k if isinstance(factory(), GTopK) else P * k)
    for r in range(1, P):
        for name in res[0][2]:
            assert np.array_equal(res[r][2][name], res[0][2][name])
    assert res[0][1]["step"] == 2 and list(res[0][1]["ranks"][0]["reducer"]["memory"]["residuals"]) == ["bucket0:w2+2"]


@pytest.mark.parametrize("factory", [lambda: Compression.gtopk(0.03, momentum_correction=False, min_k=1),
                                     lambda: Compression.topk(0.03, momentum_correction=False, min_k=1)])
def test_delayed_rounds_share_bucket_state_and_conserve_mass(factory):
    """Delayed schedules name rounds ``bucket@r<step>`` and start round t+1 before finishing
    round t: state is keyed by the bucket, and no gradient mass is lost or duplicated."""
    P, n, steps = 3, 200, 5
    data = data_for(P, steps, n, seed=21, dtype=np.float64, integer=True)

    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0)
        red = factory()
        outs, prev = [], None
        for s in range(steps):
            p = start(red, "bucket0:w", data[comm.rank, s].copy(), ctx, step=s, tag=f"r{s}")
            if prev is not None:
                outs.append(red.finish(prev, ctx))
            prev = p
        outs.append(red.finish(prev, ctx))
        assert list(red.state_dict()["memory"]["residuals"]) == ["bucket0:w"]
        return outs, red.residual(ops, "bucket0:w", data[0, 0]).copy()

    res = run_ranks(P, body)
    sent = sum(res[0][0])
    left = sum(r[1] for r in res)
    assert np.array_equal(sent + left, sum(data[r, s] for r in range(P) for s in range(steps)))
