"""Rank 0's decision of compression="auto" from a profile (docs/auto-compression.md#in-situ):
the method a bucket used while profiled is priced at no less than its measured start."""
from __future__ import annotations

from types import SimpleNamespace

from hvd_commopt.autocompress import AutoOptions, Method
from hvd_commopt.autocompress.decide import Profile, decide, in_situ_costs
from hvd_commopt.autocompress.pricing import bucket_costs
from hvd_commopt.fusion.cost_model import AlphaBeta, CostModel

DENSE, TOPK, DGC = Method("none"), Method("topk", 0.01), Method("dgc", 0.01)
# 1 GB/s both ways, no alpha: a dense 4 MiB bucket sends in 4.19 ms
LINK = CostModel(AlphaBeta(0.0, 1e-9), AlphaBeta(0.0, 1e-9), None, ranks=2)
MB = 1 << 20
# measured alone: DGC 1 % looks cheap (1 ms), Top-k 1 % dearer (2 ms), for any size
FITS = {"topk@0.01": (0.0, 0.002), "dgc@0.01": (0.0, 0.001)}
# the denser candidates (10 %, 3 %) cost more than any send here
ALL_FITS = {**FITS, **{f"{k}@{d}": (0.0, 0.1) for k in ("topk", "dgc") for d in (0.1, 0.03)}}


def _costs(names=("a", "b")):
    return [bucket_costs(n, 4 * MB, 0.001, (DENSE, TOPK, DGC), LINK, FITS) for n in names]


def test_the_method_in_use_is_priced_at_its_measured_start_beyond_a_dense_launch():
    costs = _costs()
    out = in_situ_costs(costs, [DGC, DENSE], [0.0051, 0.0001])
    assert out[0].costs[DGC] == (0.0051 - 0.0001, costs[0].costs[DGC][1])
    assert out[0].costs[TOPK] == costs[0].costs[TOPK] and out[1] == costs[1]


def test_a_measured_start_below_the_price_alone_keeps_the_price():
    costs = _costs()
    assert in_situ_costs(costs, [DGC, TOPK], [0.0005, 0.0015]) == costs  # no dense bucket: launch 0


def test_a_method_slower_in_the_step_than_alone_is_dropped_for_the_next_best():
    # profiled with DGC on both buckets; its start took 6 ms in the step: Top-k (2 ms alone) wins
    buckets = [SimpleNamespace(name=n, numel=MB, dtype="float32", dense=False) for n in ("a", "b")]
    opts = AutoOptions(allow=["none", "topk", "dgc"])

    def run(starts):
        prof = Profile((0.001, 0.001), starts, 0.05, 5)
        return decide(buckets, prof, [DGC, DGC], LINK, opts, lambda ms, top: ALL_FITS, ranks=2, adaptive=False,
                      banned=set(), comm_cpu=1.0)

    assert run((0.0009, 0.0009))["assignment"] == {"a": "dgc@0.01", "b": "dgc@0.01"}
    out = run((0.006, 0.006))
    assert out["assignment"] == {"a": "topk@0.01", "b": "topk@0.01"}
    assert [b["in_use_alone_ms"] for b in out["report"]["buckets"]] == [1.0, 1.0]


def test_profile_is_the_median_of_the_samples():
    p = Profile.of([(0.3, [1.0, 2.0], [0.1, 0.2]), (0.1, [3.0, 4.0], [0.3, 0.4]), (0.2, [2.0, 3.0], [0.2, 0.3])], 2)
    assert p == Profile((2.0, 3.0), (0.2, 0.3), 0.2, 3)
