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
# the sparse methods named (the chooser's behaviour with them; the default allows the quantisers instead)
SPARSE_ALLOW = ("none", "bf16", "topk", "dgc")


def costs(link, fits=CHEAP_SELECT, options=None, sizes=SIZES, gaps=GAPS, sparse_ok=None):
    opts = options or AutoOptions(allow=SPARSE_ALLOW)
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


# -- ties and the rank's own cores (docs/auto-compression.md#ties, docs/auto-compression.md#comm-cpu) --
def _bucket(name, gap, costs_by_key):
    from hvd_commopt.autocompress import BucketCosts
    return BucketCosts(name, 4 * MB, gap, {Method.parse(k): v for k, v in costs_by_key.items()})


def test_among_sparse_densities_the_fastest_wins_even_within_the_tie():
    """A 0.5 s step (forward, backward, update): 1 % of it is 5 ms, more than Top-k 1 % saves over
    3 % (0.9 ms), less than either saves over dense (8.4 ms). The old tie handed the bucket to
    3 %; every density on offer trains, so the faster one is chosen."""
    b = _bucket("b0", 0.0, {"none": (0.0, 0.010), "topk@0.03": (0.001, 0.0015), "topk@0.01": (0.001, 0.0006)})
    ch = choose([b], update_s=0.5)
    assert [m.key for m in ch.methods] == ["topk@0.01"]
    assert ch.predicted_s == 0.5 + (0.001 + 0.0006)


def test_a_less_lossy_family_within_the_tie_still_wins():
    """bf16 within 1 % of Top-k's step: the cast is kept (a sparse method only where it pays)."""
    b = _bucket("b0", 0.0, {"none": (0.0, 0.020), "bf16": (0.0005, 0.010), "topk@0.01": (0.001, 0.0006)})
    ch = choose([b], update_s=1.0)  # the tie: 10 ms; dense is 18.4 ms behind Top-k, bf16 8.9 ms
    assert [m.key for m in ch.methods] == ["bf16"]
    ch = choose([b], update_s=0.1)  # 1 % of a 0.1 s step is 1 ms: Top-k's 8.9 ms more saving pays
    assert [m.key for m in ch.methods] == ["topk@0.01"]


def test_equal_times_go_to_the_least_lossy_within_the_family():
    b = _bucket("b0", 0.0, {"none": (0.0, 0.010), "topk@0.03": (0.001, 0.001), "topk@0.01": (0.001, 0.001)})
    assert [m.key for m in choose([b]).methods] == ["topk@0.03"]


def test_sending_on_the_ranks_own_cores_is_not_hidden_behind_backward():
    """The first bucket is ready 50 ms before the last: its 8 ms send fits behind the backward in
    the DAG (comm_cpu 0: dense), but on host memory the rank's cores do the sending (comm_cpu 1),
    so Top-k's 0.6 ms send at 1 ms of selection pays."""
    first = _bucket("b0", 0.001, {"none": (0.0, 0.008), "topk@0.01": (0.001, 0.0006)})
    last = _bucket("b1", 0.050, {"none": (0.0, 0.0001)})
    assert [m.key for m in choose([first, last]).methods] == ["none", "none"]
    ch = choose([first, last], comm_cpu=1.0)
    assert [m.key for m in ch.methods] == ["topk@0.01", "none"]
    # one stream: gap 1 ms, select 1 ms + send 0.6 ms, gap 50 ms, send 0.1 ms
    assert ch.predicted_s == pytest.approx(0.001 + 0.0016 + 0.050 + 0.0001, rel=1e-12)
    assert ch.dense_s == pytest.approx(0.001 + 0.008 + 0.050 + 0.0001, rel=1e-12)


def test_predict_with_comm_cpu_puts_that_share_of_the_send_on_the_compute_stream():
    cs = costs(SLOW_LINK)
    ms = [Method("none"), Method("topk", 0.1), Method("bf16"), Method("dgc", 0.1)]
    got = predict(cs, ms, update_s=0.002, comm_cpu=0.25)
    comp = [c.costs[m][0] + 0.25 * c.costs[m][1] for c, m in zip(cs, ms)]
    comm = [0.75 * c.costs[m][1] for c, m in zip(cs, ms)]
    ref = simulate([[i] for i in range(4)], [1, 2, 3, 4], GAPS, lambda x: comm[int(x) - 1], update_time=0.002,
                   compress_time=lambda x: comp[int(x) - 1])
    assert got.iteration_time == ref.iteration_time


def test_the_tie_is_taken_over_the_whole_assignment_not_bucket_by_bucket():
    """Ten buckets each save 1.5 ms of a ~1 s step (the tie: 10 ms) with Top-k; together 15 ms.
    Bucket by bucket every one stayed dense; over the assignment Top-k pays."""
    bs = [_bucket(f"b{i}", 0.0, {"none": (0.0, 0.003), "topk@0.01": (0.0005, 0.001)}) for i in range(10)]
    ch = choose(bs, update_s=1.0, comm_cpu=1.0)
    assert [m.key for m in ch.methods] == ["topk@0.01"] * 10
    assert ch.dense_s == pytest.approx(1.03, rel=1e-12) and ch.predicted_s == pytest.approx(1.015, rel=1e-12)
    few = [_bucket(f"b{i}", 0.0, {"none": (0.0, 0.003), "topk@0.01": (0.0005, 0.001)}) for i in range(3)]
    assert [m.key for m in choose(few, update_s=1.0, comm_cpu=1.0).methods] == ["none"] * 3  # 4.5 ms < 1 %


# the quantisers' compute, measured whole (c0 + s·x): int4 packs two codes a byte, so it costs more
QUANT_FITS = {**CHEAP_SELECT, "quant8": (1e-9, 1e-4), "quant4": (2e-9, 1e-4)}


def test_default_candidates_quantise_on_a_slow_link_and_stay_dense_on_a_fast_one():
    slow = choose(costs(SLOW_LINK, fits=QUANT_FITS, options=AutoOptions()))
    assert [m.key for m in slow.methods] == ["quant8"] * 4
    assert slow.predicted_s < 0.3 * slow.dense_s
    named = choose(costs(SLOW_LINK, fits=QUANT_FITS, options=AutoOptions(allow=("bf16", "quant8", "quant4"))))
    assert [m.key for m in named.methods] == ["quant4"] * 4  # half of int8's send, for 1 ms more compute
    fast = choose(costs(FAST_LINK, fits=QUANT_FITS, options=AutoOptions()))
    assert [m.key for m in fast.methods] == ["none"] * 4
