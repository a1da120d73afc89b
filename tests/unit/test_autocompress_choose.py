"""The pure chooser of compression="auto" on synthetic profiles, and its options' bad input
(docs/auto-compression.md#model, docs/auto-compression.md#options)."""
from __future__ import annotations

import pytest

from hvd_commopt.autocompress import AutoOptions, Method, choose, predict
from hvd_commopt.autocompress.pricing import bucket_costs
from hvd_commopt.errors import ConfigError
from hvd_commopt.fusion.cost_model import AlphaBeta, CostModel
from hvd_commopt.fusion.simulator import simulate

MB = 1 << 20
# 100 Gbit/s-ish and 100 Mbit/s-ish links, 2 ranks, with a point-to-point fit for gTop-k
FAST_LINK = CostModel(AlphaBeta(1e-5, 8e-11), AlphaBeta(1e-5, 8e-11), AlphaBeta(1e-5, 8e-11), ranks=2)
SLOW_LINK = CostModel(AlphaBeta(2e-4, 8e-8), AlphaBeta(2e-4, 8e-8), AlphaBeta(2e-4, 8e-8), ranks=2)
# the selection alone by kind (OMGS's c0 + s·x·log2 x), the cast whole by method (c0 + s·x)
CHEAP_SELECT = {"topk": (1e-10, 5e-5), "dgc": (5e-11, 5e-5), "bf16": (5e-9, 1e-5)}
SIZES = [4 * MB, 4 * MB, 2 * MB, 8 * MB]
GAPS = [0.004, 0.003, 0.003, 0.002]


def costs(link, fits=CHEAP_SELECT, options=None, sizes=SIZES, gaps=GAPS, sparse_ok=None):
    opts = options or AutoOptions()
    sparse_ok = sparse_ok or [True] * len(sizes)
    return [bucket_costs(f"b{i}", n, g, opts.candidates(ok), link, fits) for i, (n, g, ok)
            in enumerate(zip(sizes, gaps, sparse_ok))]


def test_fast_link_stays_dense():
    ch = choose(costs(FAST_LINK))
    assert [m.key for m in ch.methods] == ["none"] * 4
    assert ch.predicted_s == ch.dense_s


def test_slow_link_goes_sparse_and_predicts_a_shorter_step():
    ch = choose(costs(SLOW_LINK))
    assert all(m.sparse for m in ch.methods)
    assert ch.predicted_s < 0.5 * ch.dense_s
    assert all(m.density >= 0.01 for m in ch.methods)  # the default floor
    assert all("shorter than with this bucket dense" in b.why for b in ch.buckets)


def test_a_bucket_whose_selection_costs_more_than_it_saves_stays_dense():
    dear = {"topk": (1e-6, 0.0), "dgc": (1e-6, 0.0), "bf16": (1e-5, 0.0)}  # ~20 s (selection), ~10 s (cast) for 1M elements
    ch = choose(costs(SLOW_LINK, fits=dear))
    assert [m.key for m in ch.methods] == ["none"] * 4
    assert "costs more than it saves" in ch.buckets[0].why


def test_bounds_respected():
    opts = AutoOptions(allow=["topk"], min_density=0.03)
    ch = choose(costs(SLOW_LINK, options=opts))
    keys = {m.key for m in ch.methods}
    assert keys <= {"none", "topk@0.1", "topk@0.03"}
    assert keys & {"topk@0.1", "topk@0.03"}


def test_one_d_bucket_is_never_sparse():
    ch = choose(costs(SLOW_LINK, sparse_ok=[True, False, True, True]))
    assert not ch.methods[1].sparse


def test_predict_is_the_dag_simulator_of_the_buckets():
    cs = costs(SLOW_LINK)
    dense = [Method("none")] * 4
    got = predict(cs, dense, update_s=0.002)
    ref = simulate([[i] for i in range(4)], SIZES, GAPS, SLOW_LINK.allreduce.time, update_time=0.002,
                   compress_time=lambda nb: 0.0)
    assert got.iteration_time == ref.iteration_time
    assert got.bucket_end == ref.bucket_end


def test_ties_go_to_the_least_lossy_method():
    free = CostModel(AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0), AlphaBeta(0.0, 0.0), ranks=2)
    ch = choose(costs(free, fits={}))
    assert [m.key for m in ch.methods] == ["none"] * 4


def test_chooser_is_deterministic():
    a, b = choose(costs(SLOW_LINK)), choose(costs(SLOW_LINK))
    assert a == b


@pytest.mark.parametrize("kw, match", [
    (dict(allow=["topk", "zip"]), "unknown methods \\['zip'\\]"),
    (dict(allow=[]), "leaves nothing to choose from"),
    (dict(allow=["topk"], min_density=0.5), "excludes every candidate"),
    (dict(min_density=0), "min_density must be in"),
    (dict(margin=0), "margin must be"),
    (dict(period=0), "period must be"),
])
def test_bad_options_are_one_clear_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        AutoOptions(**kw)


def test_candidates_are_bounded_and_ordered():
    opts = AutoOptions(allow=["bf16", "topk", "gtopk"], min_density=0.01)
    keys = [m.key for m in opts.candidates()]
    assert keys[:2] == ["none", "bf16"]
    assert set(keys[2:]) == {f"{k}@{d:g}" for k in ("topk", "gtopk") for d in (0.1, 0.03, 0.01)}
    assert [m.key for m in opts.candidates(sparse_ok=False)] == ["none", "bf16"]
