"""Ok-Topk on in-process ranks (NumpyOps): the exact global top-k of the summed local selections
on every rank, dropped values back in the residual, traffic as documented (docs/oktopk.md)."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, run_ranks
from hvd_commopt.errors import ConfigError
from hvd_commopt.fusion.cost_model import AlphaBeta
from hvd_commopt.fusion.sparse_scaling import compare_sparse, hist_bins, oktopk_bytes_per_rank
from hvd_commopt.reduce import ReduceContext
from hvd_commopt.select.host_numpy import NP_KEYS
from tests.reducers import start

ops = NumpyOps()


def _run(P, n, density, steps, integer=False, factory=None):
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0)  # post 1: the sum
        red = (factory or (lambda: Compression.oktopk(density)))()
        rng = np.random.default_rng(17 + comm.rank)
        rec = []
        for s in range(steps):
            x = (rng.integers(-30, 31, n) if integer else rng.standard_normal(n) * (1 + comm.rank)).astype(np.float32)
            r0 = red.residual(ops, "b", x)
            acc = x + (0 if r0 is None else r0)
            k = red.compressor.k_for(n)
            lv, li = ops.topk_abs(acc, k)  # this rank's local selection (exact mode = topk_abs)
            p = start(red, "b", x.copy(), ctx, step=s)
            out = red.finish(p, ctx).copy()
            rec.append(dict(acc=acc, li=li, lv=lv, out=out, res=red.residual(ops, "b", x).copy(),
                            sent=p.bytes_sent, info=dict(red.last_info.get("b", {}))))
        return rec
    return run_ranks(P, body)


def _reference(parts, k):
    """Exact global top-k of the sum of the local selections (summed in rank order)."""
    U, S = ops.unique_sum(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    keys = (S.view(np.int32) & 0x7FFFFFFF).astype(np.int64)
    order = np.lexsort((U, -keys))[:k]
    sel = np.sort(order)
    return U[sel], S[sel]


@pytest.mark.parametrize("P", [2, 3, 4, 5, 8])
def test_every_rank_gets_the_exact_global_topk_of_the_sum(P):
    n, d, steps = 30_000, 0.01, 3
    got = _run(P, n, d, steps)
    k = 300
    for s in range(steps):
        outs = [got[r][s]["out"] for r in range(P)]
        assert all(np.array_equal(outs[0].view(np.int32), o.view(np.int32)) for o in outs[1:])
        I, V = _reference([(got[r][s]["li"], got[r][s]["lv"]) for r in range(P)], k)
        want = np.zeros(n, np.float32)
        want[I] = V
        assert np.array_equal(outs[0].view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("P", [2, 3, 6])
def test_dropped_values_return_to_the_residual_exactly(P):
    """Integer data: sums are exact, so sent + residual == acc summed over ranks, bit for bit."""
    got = _run(P, 20_000, 0.02, 3, integer=True)
    for s in range(3):
        sent = sum(got[r][s]["acc"] - got[r][s]["res"] for r in range(P))
        assert np.array_equal(sent, got[0][s]["out"])
        for r in range(P):  # a rank's residual is its acc outside the global selection
            sel = got[0][s]["out"] != 0
            mine = np.zeros(20_000, bool)
            mine[got[r][s]["li"]] = True
            assert np.array_equal(got[r][s]["res"][~(sel & mine)], got[r][s]["acc"][~(sel & mine)])


def _exact_bytes(P, n, k, info, pair=8):
    """What CountingLink must count for one exchange (docs/oktopk.md#traffic), per call."""
    b = info["split_pairs"] * pair
    if info["rebalanced"]:
        b += int(2 * (P - 1) / P * min(64 * P, n) * 8)
    b += int(2 * (P - 1) / P * hist_bins(k) * 4)
    if info["histograms"] == 2:  # the sub-bin histogram
        b += int(2 * (P - 1) / P * 256 * 4)
    if info["cut_rows"] >= 0:  # the rows of the cut's cell (-1: the cut fell on a bin edge)
        b += (P - 1) * info["cut_rows"] * 16
    return b + (P - 1) * info["gathered_pairs"] * pair


@pytest.mark.parametrize("P", [2, 3, 4, 5, 6, 7, 8])
def test_traffic_matches_the_formula(P):
    n, d = 400_000, 0.01
    k = 4000
    got = _run(P, n, d, 3)
    for s in range(3):
        total = 0
        for r in range(P):
            rec = got[r][s]
            assert rec["sent"] == _exact_bytes(P, n, k, rec["info"])  # the accounting, exactly
            total += rec["sent"] - (int(2 * (P - 1) / P * min(64 * P, n) * 8) if rec["info"]["rebalanced"] else 0)
            assert rec["sent"] < 6 * k * 8  # < 6k (index, value) pairs per rank and step
        closed = P * oktopk_bytes_per_rank(k, P)
        assert abs(total - closed) <= 0.05 * closed, (total, closed)  # balanced regions: within 5 %


def test_rebalance_state_and_bad_arguments():
    with pytest.raises(ConfigError, match="rebalance"):
        Compression.oktopk(0.01, rebalance=0)
    got = _run(2, 10_000, 0.01, 3, factory=lambda: Compression.oktopk(0.01, rebalance=2))
    assert [got[0][s]["info"]["rebalanced"] for s in range(3)] == [True, False, True]


def test_one_rank_is_local_topk():
    got = _run(1, 5000, 0.02, 2)
    for rec in got[0]:
        want = np.zeros(5000, np.float32)
        want[rec["li"]] = rec["lv"]
        assert np.array_equal(rec["out"], want) and rec["sent"] == 0


def test_cost_model_compares_the_three_to_1024_ranks():
    """Bandwidth-bound (k = 1M): Ok-Topk < gTop-k < allgather at every P >= 8; latency-bound
    (k = 10k): Ok-Topk's O(P) rounds lose to gTop-k's log P at large P (docs/oktopk.md#traffic)."""
    link = AlphaBeta(alpha=5e-6, beta=1e-9)
    for row in compare_sparse(1_000_000, [8, 64, 256, 1024], link):
        assert row["oktopk"] < row["gtopk"] < row["topk_allgather"]
    small = compare_sparse(10_000, [1024], link)[0]
    assert small["gtopk"] < small["oktopk"] < small["topk_allgather"]
    assert NP_KEYS  # the key tables the global cut relies on are importable


def test_reducer_price_feeds_the_planners_and_simulator():
    from hvd_commopt.fusion.cost_model import CostModel
    from hvd_commopt.fusion.sparse_scaling import oktopk_time
    link = AlphaBeta(alpha=5e-6, beta=1e-9)
    cost = CostModel.from_link(link, ranks=8)
    pricing = Compression.oktopk(0.01).price(cost, select_s=0.0)
    nbytes = 4 * 1_000_000
    assert pricing.comm_time(nbytes) == pytest.approx(oktopk_time(10_000, 8, link))
    assert "Ok-Topk" in pricing.description
