"""Momentum factor masking is for what was applied (docs/gtopk.md#masking-delivered).

gTop-k and Ok-Topk drop some of a rank's selected entries in the global merge; those values go
back to the velocity, and now their momentum stays as it was. Exact values on in-process ranks
(NumpyOps), against a NumPy transcription of the rule:

    u = mu*u + g;  v = v + u;  (vals, idx) = top-k(v);  global (I, V, alive) = gTop-k merge
    delivered = idx[alive];  v[delivered] = 0;  u[delivered] = 0        (before: u[idx] = 0)
"""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, run_ranks
from hvd_commopt.memory.dgc import DGCMemory
from hvd_commopt.reduce import GTopK, ReduceContext
from hvd_commopt.reduce.gtopk import gtopk_simulate
from tests.reducers import start

ops = NumpyOps()
MU = np.float32(0.9)


def data_for(P, steps, n, seed=0):
    rng = np.random.default_rng(seed)
    return {(r, s): (rng.standard_normal(n) * (1 + r)).astype(np.float32) for r in range(P) for s in range(steps)}


def run(P, factory, data, steps, n, name="b"):
    """Per rank and step: (the reduced sum, u after, v after)."""
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0)
        red = factory()
        out = []
        for s in range(steps):
            res = red.finish(start(red, name, data[comm.rank, s].copy(), ctx, step=s), ctx)
            st = red.memory.state_dict()
            out.append((res.copy(), st["momentums"][name].copy(), st["velocities"][name].copy()))
        return out
    return run_ranks(P, body)


def reference(P, data, steps, n, k, masking="delivered"):
    """The rule in the module docstring (``masking="selected"``: the old rule, every selected
    entry's momentum zeroed; "off": none)."""
    u = [np.zeros(n, np.float32) for _ in range(P)]
    v = [np.zeros(n, np.float32) for _ in range(P)]
    out = []
    for s in range(steps):
        leaves = []
        for r in range(P):
            u[r] = u[r] * MU + data[r, s]
            v[r] = v[r] + u[r]
            vals, idx = ops.topk_abs(v[r], k)
            leaves.append((idx, vals))
        I, V, alive = gtopk_simulate(ops, leaves, k)
        res = np.zeros(n, np.float32)
        np.add.at(res, I, V)
        row = []
        for r in range(P):
            idx = leaves[r][0]
            delivered = idx[alive[r]]
            v[r][delivered] = 0.0
            if masking == "delivered":
                u[r][delivered] = 0.0
            elif masking == "selected":
                u[r][idx] = 0.0
            row.append((res.copy(), u[r].copy(), v[r].copy()))
        out.append(row)
    return out


def assert_runs_equal(got, want, P, steps):
    for s in range(steps):
        for r in range(P):
            for a, b, what in zip(got[r][s], want[s][r], ("result", "momentum", "velocity")):
                assert np.array_equal(a, b), (what, r, s, np.flatnonzero(a != b)[:5])


@pytest.mark.parametrize("P", [2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "allgather"])
def test_gtopk_masks_only_the_entries_the_merge_applied(P, algorithm):
    n, k, steps = 200, 10, 6
    data = data_for(P, steps, n, seed=P)
    got = run(P, lambda: GTopK(k / n, algorithm=algorithm, memory=DGCMemory(0.9), min_k=1), data, steps, n)
    assert_runs_equal(got, reference(P, data, steps, n, k), P, steps)


def test_the_old_rule_differs_where_the_merge_dropped_entries():
    """The new rule is not the old one in disguise: with 4 ranks the merge drops most of each
    rank's k, and the momenta differ exactly there."""
    P, n, k, steps = 4, 200, 10, 3
    data = data_for(P, steps, n, seed=7)
    got = run(P, lambda: GTopK(k / n, memory=DGCMemory(0.9), min_k=1), data, steps, n)
    old = reference(P, data, steps, n, k, masking="selected")
    assert any(not np.array_equal(got[r][0][1], old[0][r][1]) for r in range(P))
    # after one step the only difference is the dropped entries' momentum: u = g there
    for r in range(P):
        diff = np.flatnonzero(got[r][0][1] != old[0][r][1])
        assert np.array_equal(got[r][0][1][diff], data[r, 0][diff])
        assert np.all(old[0][r][1][diff] == 0.0)


def test_first_step_dropped_entries_keep_their_momentum_and_velocity_oktopk():
    """Ok-Topk drops too: after one step from zero, u = v = g except where this rank's entry was
    applied (the global top-k's indices that it selected), where both are 0."""
    P, n, k = 4, 400, 8
    data = data_for(P, 1, n, seed=3)
    got = run(P, lambda: Compression.oktopk(k / n, momentum_correction=True, min_k=1, dense_1d=False), data, 1, n)
    dropped_any = False
    for r in range(P):
        res, u, v = got[r][0]
        _, idx = ops.topk_abs(data[r, 0], k)
        applied = idx[res[idx] != 0.0]
        want = data[r, 0].copy()
        want[applied] = 0.0
        assert np.array_equal(v, want)
        # unbound momentum correction is error feedback (mu = 0): u = g, masked where applied
        assert np.array_equal(u, want)
        dropped_any |= applied.size < k
    assert dropped_any  # the merge dropped some entries


def test_a_later_round_keeps_the_momentum_masked():
    """A delayed schedule may finish round t after round t+1 selected: the record is round t+1's,
    so round t's dropped entries keep the masked momentum (the old rule) rather than a wrong one."""
    mem = DGCMemory(0.9)
    g = np.arange(1, 9, dtype=np.float32)
    for step in (0, 1):
        mem.snapshot(ops, "b", g, step)
        v = mem.compensate(ops, "b", g.copy())
        mem.update(ops, "b", v, np.array([6, 7]))
    u_before = mem.state_dict()["momentums"]["b"].copy()
    mem.restore_momentum(ops, "b", 0, np.array([0, 1]))  # round 0 is stale
    assert np.array_equal(mem.state_dict()["momentums"]["b"], u_before)
    mem.restore_momentum(ops, "b", 1, np.array([1]))  # round 1: position 1 of [6, 7]
    u = mem.state_dict()["momentums"]["b"]
    assert u[7] == np.float32(g[7])  # u was masked at step 0, so step 1's u is g
    assert u[6] == 0.0
    mem.restore_momentum(ops, "b", 1, np.array([0]))  # once per round
    assert mem.state_dict()["momentums"]["b"][6] == 0.0


def test_bool_mask_form_restores_the_same_bits():
    """The device route passes a bool mask over the k entries; +0.0 is added where delivered."""
    def masked(dropped):
        mem = DGCMemory(0.9)
        g = np.linspace(-1, 1, 9).astype(np.float32)
        mem.snapshot(ops, "b", g, 0)
        mem.update(ops, "b", mem.compensate(ops, "b", g.copy()), np.array([0, 4, 8]))
        mem.restore_momentum(ops, "b", 0, dropped)
        return mem.state_dict()["momentums"]["b"]
    a = masked(np.array([0, 2]))
    b = masked(np.array([True, False, True]))
    assert np.array_equal(a, b) and np.array_equal(np.signbit(a), np.signbit(b))
    assert a[0] == np.float32(-1.0) and a[4] == 0.0 and a[8] == np.float32(1.0)


def test_no_masking_and_skipped_rounds_restore_nothing():
    mem = DGCMemory(0.9, momentum_masking=False)
    g = np.ones(4, np.float32)
    mem.snapshot(ops, "b", g, 0)
    mem.update(ops, "b", mem.compensate(ops, "b", g.copy()), np.array([1]))
    mem.restore_momentum(ops, "b", 0, np.array([0]))
    assert np.array_equal(mem.state_dict()["momentums"]["b"], g)
    mem = DGCMemory(0.9)
    mem.snapshot(ops, "b", g, 0)
    mem.update(ops, "b", mem.compensate(ops, "b", g.copy()), np.array([1]))
    mem.skip("b")
    mem.restore_momentum(ops, "b", 0, np.array([0]))
    assert mem.state_dict()["momentums"]["b"][1] == 0.0
