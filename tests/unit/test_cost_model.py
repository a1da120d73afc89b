"""Cost models: AlphaBeta fit and serialisation, closed-form collective costs (docs/cost-models.md#closed-form-costs, docs/cost-models.md#fitted-allreduce-model, docs/gtopk.md#costs, docs/gtopk.md#non-power-of-two)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hvd_commopt.fusion.cost_model import (AlphaBeta, CostModel, allgather_time, gtopk_time,
                                           ring_allreduce_time, sparse_k, topk_allgather_time)

LINK = AlphaBeta(1e-3, 1e-9)


# -- AlphaBeta ------------------------------------------------------------------------------------

def test_time_is_affine_and_zero_for_empty_message():
    ab = AlphaBeta(2e-4, 5e-10)
    assert ab.time(0) == 0.0
    assert ab.time(1_000_000) == 2e-4 + 5e-10 * 1_000_000
    assert ab(4096) == ab.time(4096)  # usable as a comm-time callable


@pytest.mark.parametrize("alpha,beta", [(-1e-6, 0.0), (0.0, -1e-9), (math.nan, 0.0), (math.inf, 1.0)])
def test_rejects_negative_or_nonfinite(alpha, beta):
    with pytest.raises(ValueError, match="fit"):
        AlphaBeta(alpha, beta)


def test_time_rejects_negative_size():
    with pytest.raises(ValueError, match="bytes"):
        AlphaBeta(1.0, 1.0).time(-1)


@pytest.mark.parametrize("alpha,beta", [(9.08e-4, 7.40e-10), (2.36e-4, 4.06e-10), (0.0, 1e-9), (1e-3, 0.0)])
def test_fit_recovers_exact_model(alpha, beta):
    sizes = [8192 * 4 * i for i in range(1, 64)]  # the reference's sizes (docs/cost-models.md#fitted-allreduce-model)
    times = [alpha + beta * s for s in sizes]
    fit = AlphaBeta.fit(sizes, times)
    assert fit.alpha == pytest.approx(alpha, rel=1e-9, abs=1e-15)
    assert fit.beta == pytest.approx(beta, rel=1e-9, abs=1e-21)


def test_fit_with_repeated_sizes_is_least_squares():
    rng = np.random.default_rng(0)
    sizes = np.repeat([1e5, 2e5, 4e5, 8e5], 10)
    times = 1e-4 + 2e-9 * sizes + rng.normal(0, 1e-6, sizes.size)
    fit = AlphaBeta.fit(sizes, times)
    beta_ref, alpha_ref = np.polyfit(sizes, times, 1)
    assert fit.alpha == pytest.approx(alpha_ref, rel=1e-9)
    assert fit.beta == pytest.approx(beta_ref, rel=1e-9)


def test_fit_negative_alpha_is_refitted_through_origin():
    sizes = np.array([1e5, 2e5, 3e5, 4e5])
    times = 2e-9 * sizes - 1e-5  # unconstrained fit has alpha = -1e-5
    fit = AlphaBeta.fit(sizes, times)
    assert fit.alpha == 0.0
    assert fit.beta == pytest.approx(float(sizes @ times) / float(sizes @ sizes), rel=1e-12)


def test_fit_negative_beta_gives_constant_model():
    sizes = [1e3, 2e3, 3e3]
    times = [3e-4, 2e-4, 1e-4]  # times fall with size: pure noise
    fit = AlphaBeta.fit(sizes, times)
    assert fit.beta == 0.0
    assert fit.alpha == pytest.approx(2e-4)


@pytest.mark.parametrize("sizes,times,msg", [([1, 1, 1], [1, 2, 3], "distinct"), ([1, 2], [1], "one time per size"),
                                             ([1, 2], [1, math.nan], "non-finite")])
def test_fit_errors(sizes, times, msg):
    with pytest.raises(ValueError, match=msg):
        AlphaBeta.fit(sizes, times)


def test_dict_round_trip_is_json():
    ab = AlphaBeta(1.25e-4, 3.5e-10)
    assert AlphaBeta.from_dict(json.loads(json.dumps(ab.to_dict()))) == ab
    cm = CostModel(AlphaBeta(1e-4, 1e-9), AlphaBeta(2e-4, 2e-9), AlphaBeta(3e-5, 1e-9), ranks=8)
    assert CostModel.from_dict(json.loads(json.dumps(cm.to_dict()))) == cm
    cm1 = CostModel(AlphaBeta(1e-4, 1e-9), AlphaBeta(2e-4, 2e-9))
    assert CostModel.from_dict(json.loads(json.dumps(cm1.to_dict()))) == cm1
    with pytest.raises(ValueError, match="alpha"):
        AlphaBeta.from_dict({"beta": 1.0})
    with pytest.raises(ValueError, match="allgather"):
        CostModel.from_dict({"allreduce": {"alpha": 0, "beta": 0}})


# -- closed-form collectives ----------------------------------------------------------------------

def test_ring_allreduce_formula():
    # 2α(P−1) + 2(P−1)/P·n·β = 0.006 + 0.0015
    assert ring_allreduce_time(1_000_000, 4, LINK) == pytest.approx(0.0075, rel=1e-15)
    assert ring_allreduce_time(1_000_000, 1, LINK) == 0.0
    assert ring_allreduce_time(0, 4, LINK) == 0.0
    with pytest.raises(ValueError, match="ranks"):
        ring_allreduce_time(1, 0, LINK)


def test_allgather_formulas():
    assert allgather_time(1000, 5, LINK) == pytest.approx(4 * (1e-3 + 1000e-9))
    assert allgather_time(1000, 5, LINK, "recursive_doubling") == pytest.approx(3 * 1e-3 + 4 * 1000e-9)
    assert allgather_time(1000, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="ring"):
        allgather_time(1000, 4, LINK, "bruck")


def test_topk_matches_readme_formula():
    # README (docs/cost-models.md#closed-form-costs): α log P + 2(P−1) k β_word, with β_word = 4 bytes · β
    k, p = 1000, 8
    readme = LINK.alpha * math.log2(p) + 2 * (p - 1) * k * (4 * LINK.beta)
    assert topk_allgather_time(k, p, LINK, algorithm="recursive_doubling", fused=True) == pytest.approx(readme)
    # two separate ring allgathers, as the reference code issues them
    assert topk_allgather_time(k, p, LINK) == pytest.approx(2 * (p - 1) * (LINK.alpha + 4 * k * LINK.beta))
    assert topk_allgather_time(0, p, LINK) == 0.0


def test_gtopk_costs():
    k = 1000
    rnd = LINK.alpha + 8 * k * LINK.beta  # one round: k values + k indices, 4 bytes each
    assert gtopk_time(k, 8, LINK) == pytest.approx(3 * rnd)  # README α log P + 2k log P β
    assert gtopk_time(k, 2, LINK) == pytest.approx(rnd)
    assert gtopk_time(k, 1, LINK) == 0.0
    # docs/gtopk.md#non-power-of-two: P = 6 -> m = 4: fold + 2 rounds + unfold (+ k-bit mask)
    assert gtopk_time(k, 6, LINK) == pytest.approx(4 * rnd + math.ceil(k / 8) * LINK.beta)
    assert gtopk_time(k, 3, LINK) == pytest.approx(3 * rnd + math.ceil(k / 8) * LINK.beta)
    # docs/gtopk.md#costs tree: reduce + broadcast
    assert gtopk_time(k, 8, LINK, algorithm="tree") == pytest.approx(6 * rnd)
    with pytest.raises(ValueError, match="recursive_doubling"):
        gtopk_time(k, 8, LINK, algorithm="ring")


def test_sparse_k():
    assert sparse_k(4000, 0.01) == 10
    assert sparse_k(40, 0.001) == 1  # at least one entry (docs/wrapper.md#k-per-bucket)
    assert sparse_k(0, 0.001) == 0
    assert sparse_k(4000, 1.0) == 1000
    with pytest.raises(ValueError, match="density"):
        sparse_k(4000, 0.0)


# -- CostModel ------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 3, 8, 16])
def test_from_link_agrees_with_formulas(p):
    cm = CostModel.from_link(LINK, p)
    for n in (0, 4, 4096, 10_000_000):
        assert cm.allreduce_time(n) == pytest.approx(ring_allreduce_time(n, p, LINK), rel=1e-12)
        assert cm.allgather_time(n) == pytest.approx(allgather_time(n, p, LINK), rel=1e-12)
    rd = CostModel.from_link(LINK, p, allgather_algorithm="recursive_doubling")
    assert rd.allgather_time(4096) == pytest.approx(allgather_time(4096, p, LINK, "recursive_doubling"))
    nbytes, rho = 4 * 1_000_000, 0.001
    k = sparse_k(nbytes, rho)
    assert cm.topk_time(nbytes, rho) == pytest.approx(topk_allgather_time(k, p, LINK, fused=True), rel=1e-12)
    assert cm.gtopk_time(nbytes, rho) == pytest.approx(gtopk_time(k, p, LINK), rel=1e-12)


def test_comm_time_fn():
    cm = CostModel.from_link(LINK, 4)
    assert cm.comm_time_fn()(4096) == cm.allreduce_time(4096)
    assert cm.comm_time_fn("fp16")(4096) == cm.allreduce_time(2048)
    assert cm.comm_time_fn("topk", density=0.01)(40_000) == cm.topk_time(40_000, 0.01)
    assert cm.comm_time_fn("gtopk", density=0.01)(40_000) == cm.gtopk_time(40_000, 0.01)
    for kind in ("none", "fp16", "topk", "gtopk"):
        assert cm.comm_time_fn(kind, density=0.01)(0) == 0.0
    with pytest.raises(ValueError, match="'topk'"):
        cm.comm_time_fn("powersgd")
    with pytest.raises(ValueError, match="density"):
        cm.comm_time_fn("topk", density=2.0)


def test_gtopk_needs_p2p_fit():
    cm = CostModel(AlphaBeta(1e-4, 1e-9), AlphaBeta(1e-4, 1e-9), None, ranks=4)
    with pytest.raises(ValueError, match="p2p"):
        cm.gtopk_time(4000, 0.01)
    assert CostModel(AlphaBeta(1e-4, 1e-9), AlphaBeta(1e-4, 1e-9), None, ranks=1).gtopk_time(4000, 0.01) == 0.0


def test_cost_model_rejects_bad_ranks():
    with pytest.raises(ValueError, match="ranks"):
        CostModel(AlphaBeta(0, 0), AlphaBeta(0, 0), ranks=0)
    with pytest.raises(ValueError, match="ring"):
        CostModel.from_link(LINK, 4, allgather_algorithm="tree")
