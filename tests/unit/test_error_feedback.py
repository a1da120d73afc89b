"""Error feedback: sent + residual == accumulated, bit for bit; state survives a checkpoint."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from hvd_commopt import Compression, ConfigError, NumpyOps, run_ranks
from hvd_commopt.compress import DGCSelector, TopKSelector
from hvd_commopt.memory import DGCMemory, ErrorFeedback
from hvd_commopt.reduce import ReduceContext
from tests.reducers import bucket, reduce_once

ops = NumpyOps()


def grads(steps, n, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * rng.uniform(0.01, 10)).astype(dtype) for _ in range(steps)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("density", [0.001, 0.05, 0.5])
def test_invariant_bit_exact_over_steps(dtype, density):
    ef, comp = ErrorFeedback(), TopKSelector(density)
    residual = np.zeros(3000, dtype)
    for step, g in enumerate(grads(6, 3000, dtype=dtype)):
        acc = ef.compensate(ops, "b", g.copy())
        np.testing.assert_array_equal(acc, g + residual)  # acc = grad + residual (same float op)
        acc_copy = acc.copy()
        vals, idx = comp.select(ops, acc, bucket("b"), step)
        ef.update(ops, "b", acc, idx)
        residual = ef.residual(ops, "b", acc).copy()
        sent = np.zeros_like(acc_copy)
        sent[idx] = vals
        total = sent + residual
        assert np.array_equal(total.view(np.uint8), acc_copy.view(np.uint8))  # the invariant, bit for bit
        assert np.all(residual[idx] == 0) and np.count_nonzero(sent) <= len(idx)


def test_disabled_error_feedback_keeps_nothing():
    ef = ErrorFeedback(enabled=False)
    g = grads(1, 100)[0]
    acc = ef.compensate(ops, "b", g)
    ef.update(ops, "b", acc, np.array([1, 2]))
    assert ef.residual(ops, "b", g) is None and ef.state_dict() == {}


def test_restore_returns_values_exactly():
    ef = ErrorFeedback()
    g = grads(1, 50)[0]
    acc = ef.compensate(ops, "b", g.copy())
    idx = np.array([3, 7, 11])
    ef.update(ops, "b", acc, idx)
    ef.restore(ops, "b", idx[:2], g[idx[:2]])
    r = ef.residual(ops, "b", g)
    expected = g.copy()
    expected[11] = 0
    assert np.array_equal(r, expected)


def test_dense_path_clears_the_residual():
    ef = ErrorFeedback()
    g = grads(2, 20)
    acc = ef.compensate(ops, "b", g[0].copy())
    ef.update(ops, "b", acc, np.array([0]))
    x = ef.compensate_dense(ops, "b", g[1].copy())
    np.testing.assert_array_equal(x[1:], g[1][1:] + g[0][1:])
    assert ef.residual(ops, "b", g[1]) is None


def test_dgc_velocity_invariant_and_masks():
    mem, comp = DGCMemory(momentum=0.9), DGCSelector(0.01, sample_ratio=1.0)
    for step, g in enumerate(grads(5, 2000)):
        v = mem.compensate(ops, "b", g.copy())
        v_before = v.copy()
        vals, idx = comp.select(ops, v, bucket("b"), step)
        mem.update(ops, "b", v, idx)
        v_after = mem.residual(ops, "b", g)
        sent = np.zeros_like(v_before)
        sent[idx] = vals
        assert np.array_equal(sent + v_after, v_before)
        assert np.all(v_after[idx] == 0) and np.all(mem._u.live("b")[idx] == 0)


def test_state_dict_round_trip_continues_identically():
    gs = grads(8, 500, seed=3)
    ef_a = ErrorFeedback()
    comp = TopKSelector(0.02)

    def step(ef, g, i):
        acc = ef.compensate(ops, "b", g.copy())
        vals, idx = comp.select(ops, acc, bucket("b"), i)
        ef.update(ops, "b", acc, idx)
        return vals, idx

    for i in range(4):
        step(ef_a, gs[i], i)
    blob = pickle.dumps(ef_a.state_dict())
    ef_b = ErrorFeedback()
    ef_b.load_state_dict(pickle.loads(blob))
    for i in range(4, 8):
        va, ia = step(ef_a, gs[i], i)
        vb, ib = step(ef_b, gs[i], i)
        assert np.array_equal(ia, ib) and np.array_equal(va, vb)
    assert np.array_equal(ef_a.residual(ops, "b", gs[0]), ef_b.residual(ops, "b", gs[0]))


def test_state_dict_is_a_copy_and_size_mismatch_is_explained():
    ef = ErrorFeedback()
    g = grads(1, 10)[0]
    acc = ef.compensate(ops, "b", g.copy())
    ef.update(ops, "b", acc, np.array([0]))
    sd = ef.state_dict()
    sd["residuals"]["b"][:] = 123
    assert ef.residual(ops, "b", g)[1] == g[1]
    ef2 = ErrorFeedback()
    ef2.load_state_dict({"residuals": {"b": np.zeros(11, np.float32)}})
    with pytest.raises(ConfigError, match="fusion plan changed"):
        ef2.compensate(ops, "b", g)


@pytest.mark.parametrize("factory", [lambda: Compression.topk(0.05), lambda: Compression.randomk(0.05, seed=3),
                                     lambda: Compression.dgc(0.05, warmup_epochs=2, steps_per_epoch=2, momentum=0.9),
                                     lambda: Compression.gtopk(0.05)])
def test_reducer_checkpoint_round_trip_three_ranks(factory):
    """Run 3 steps, checkpoint (pickled), then 3 more: a fresh reducer loaded from the checkpoint
    produces bit-identical results (residuals, momenta, step counters, DGC epoch all restored)."""
    data = {(r, s): grads(1, 400, seed=100 * r + s)[0] for r in range(3) for s in range(6)}

    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        red = factory()
        for s in range(3):
            for b in ("b0", "b1"):
                reduce_once(red, b, data[comm.rank, s].copy(), ctx, step=s)
        sd = pickle.loads(pickle.dumps(red.state_dict()))
        red2 = factory()
        red2.load_state_dict(sd)
        outs = []
        for s in range(3, 6):
            for b in ("b0", "b1"):
                o1 = reduce_once(red, b, data[comm.rank, s].copy(), ctx, step=s)
                o2 = reduce_once(red2, b, data[comm.rank, s].copy(), ctx, step=s)
                outs.append((o1, o2))
        return outs

    for rank_out in run_ranks(3, body):
        for o1, o2 in rank_out:
            assert np.array_equal(o1, o2)
