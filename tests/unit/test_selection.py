"""Selection modes through the reducers (NumpyOps, in-process ranks): exact equals the reference
top-k bit for bit with error feedback fused, threshold reuse keeps its band and reports its
drift, DGC takes every mode, bad input is one ConfigError (docs/selection.md)."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, run_ranks
from hvd_commopt.buckets import Bucket
from hvd_commopt.select.strategies import ReuseTopK, SelectionStrategy, check_selection
from hvd_commopt.errors import ConfigError
from hvd_commopt.reduce import ReduceContext
from tests.reducers import start

ops = NumpyOps()


def _run(P, factory, steps, n, seed=0, scale=None):
    """Per rank: [(residual before, output, residual after)] per step, and the reducer."""
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        red = factory()
        rng = np.random.default_rng(seed + comm.rank)
        rec = []
        for s in range(steps):
            x = (rng.standard_normal(n) * (scale(s) if scale else 1.0)).astype(np.float32)
            before = red.residual(ops, "b", x)
            before = np.zeros_like(x) if before is None else before.copy()
            out = red.finish(start(red, "b", x.copy(), ctx, step=s), ctx)
            after = red.residual(ops, "b", x).copy()
            rec.append((x, before, out, after))
        return rec, red.stats()
    return run_ranks(P, body)


def _reference_topk(P, steps, n, k, seed=0):
    """Today's prologue by hand: acc = x + r; topk_abs; r = acc zeroed at idx; average of scatters."""
    res = [np.zeros(n, np.float32) for _ in range(P)]
    rngs = [np.random.default_rng(seed + r) for r in range(P)]
    outs = []
    for _ in range(steps):
        tot = np.zeros(n, np.float32)
        parts = []
        for r in range(P):
            acc = rngs[r].standard_normal(n).astype(np.float32) + res[r]
            v, i = ops.topk_abs(acc, k)
            res[r] = acc.copy()
            res[r][i] = 0
            parts.append((i, v))
        for i, v in parts:
            np.add.at(tot, i, v)
        outs.append((tot * np.float32(1.0 / P), [x.copy() for x in res]))
    return outs


@pytest.mark.parametrize("P", [1, 2, 3])
def test_exact_selection_through_the_reducer_equals_todays_topk(P):
    n, steps = 100_000, 3
    got = _run(P, lambda: Compression.topk(0.01), steps, n)
    want = _reference_topk(P, steps, n, 1000)
    for s in range(steps):
        for r in range(P):
            out, after = got[r][0][s][2], got[r][0][s][3]
            assert np.array_equal(out.view(np.int32), want[s][0].view(np.int32))
            assert np.array_equal(after.view(np.int32), want[s][1][r].view(np.int32))


def test_threshold_reuse_band_drift_stats_and_invariant():
    n, k, steps = 100_000, 1000, 24
    got = _run(2, lambda: Compression.topk(0.01, selection="threshold", tau=6, band=0.25), steps, n,
               scale=lambda s: 1.0 + 0.3 * np.sin(s / 2.0))
    for r in range(2):
        rec, stats = got[r]
        for x, before, out, after in rec:
            acc = x + before
            sent = acc != after
            assert 0.75 * k <= sent.sum() <= 1.25 * k or sent.sum() == k
            assert np.array_equal(np.where(sent, acc, 0) + after, acc)  # the EF invariant, exact
        st = stats["threshold"]["b"]
        assert st["steps"] == steps and st["reused"] > 0 and st["exact_scheduled"] >= 1
        assert st["exact_scheduled"] + st["reused"] + st["recompute_high"] + st["recompute_low"] == steps
        assert np.isfinite(st["drift_abs_mean"]) and st["drift_min"] <= st["drift_max"]  # all tried steps


def test_threshold_state_round_trips():
    red = Compression.topk(0.01, selection="threshold")
    r = ReuseTopK(tau=4, band=0.2)
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
    r.select(ops, x.copy(), 500, key="b")
    sd = r.state_dict()
    r2 = ReuseTopK(tau=4, band=0.2)
    r2.load_state_dict(sd)
    a, b = r.select(ops, x.copy(), 500, key="b"), r2.select(ops, x.copy(), 500, key="b")
    assert np.array_equal(a.indices, b.indices) and r.stats()["b"]["last_action"] == "reuse"
    assert "compressor" in red.state_dict()


def test_rollback_takes_back_its_own_round_once_under_a_delay():
    """A delayed schedule selects round 1 before round 0 settles: rolling round 0 back takes back
    round 0's exact selection only, and a second rollback of it nothing (docs/wrapper.md#nonfinite)."""
    sel, b = SelectionStrategy("exact"), Bucket.single("b", 50_000, "float32")
    x = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
    for step in (0, 1):
        sel.snapshot("b", step)
        sel.select_acc(ops, x.copy(), 500, b, step, None)
    sel.rollback("b", 0)
    sel.rollback("b", 0)
    sel.rollback("other", 1)
    assert sel.stats()["exact"]["calls"] == 1
    sel.rollback("b", 1)
    assert sel.stats()["exact"]["calls"] == 0


@pytest.mark.parametrize("selection", ["exact", "threshold", "sampled"])
def test_dgc_takes_every_selection(selection):
    got = _run(2, lambda: Compression.dgc(0.01, momentum=0.9, selection=selection), 5, 50_000)
    for r in range(2):
        for x, before, out, after in got[r][0]:
            assert np.isfinite(out).all() and 0 < np.count_nonzero(out) <= 2 * 500 * 1.3


def test_topk_sampled_mode_selects_about_k():
    got = _run(1, lambda: Compression.topk(0.01, selection="sampled"), 3, 100_000)
    for x, before, out, after in got[0][0]:
        assert 0.8 * 1000 <= np.count_nonzero(out) <= 1000


@pytest.mark.parametrize("kwargs, fix", [
    (dict(selection="fast"), "one of"),
    (dict(selection="threshold", tau=0), "tau=1"),
    (dict(selection="threshold", tau=2.5), "tau"),
    (dict(selection="threshold", band=0.0), "band"),
    (dict(selection="threshold", band=1.0), "band"),
    (dict(selection="threshold", band=-0.1), "band"),
])
def test_bad_selection_arguments_are_one_config_error(kwargs, fix):
    with pytest.raises(ConfigError, match=fix):
        Compression.topk(0.01, **kwargs)
    with pytest.raises(ConfigError, match=fix):
        Compression.dgc(0.01, **kwargs)


def test_threshold_density_rounding_k_to_zero_is_refused():
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0)
        red = Compression.topk(0.001, selection="threshold")
        start(red, "tiny", np.ones(500, np.float32), ctx)
    with pytest.raises(ConfigError, match="raise the density"):
        run_ranks(1, body)


def test_check_selection_accepts_good_values():
    assert check_selection("threshold", 1, 0.5) == ("threshold", 1, 0.5)
