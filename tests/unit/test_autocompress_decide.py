"""Rank 0's decision of compression="auto" from a profile (docs/auto-compression.md#in-situ):
what it decides, the alternative it measures next, and what its report shows."""
from __future__ import annotations

from types import SimpleNamespace

from hvd_commopt.autocompress import AutoOptions, Method
from hvd_commopt.autocompress.decide import Profile, decide
from hvd_commopt.fusion.cost_model import AlphaBeta, CostModel

DENSE, TOPK, DGC = Method("none"), Method("topk", 0.01), Method("dgc", 0.01)
# 1 GB/s both ways, no alpha: a dense 4 MiB bucket sends in 4.19 ms
LINK = CostModel(AlphaBeta(0.0, 1e-9), AlphaBeta(0.0, 1e-9), None, ranks=2)
MB = 1 << 20
# measured alone: DGC 1 % looks cheap (1 ms), Top-k 1 % dearer (2 ms), for any size
FITS = {"topk@0.01": (0.0, 0.002), "dgc@0.01": (0.0, 0.001)}
# the denser candidates (10 %, 3 %) cost more than any send here
ALL_FITS = {**FITS, **{f"{k}@{d}": (0.0, 0.1) for k in ("topk", "dgc") for d in (0.1, 0.03)}}


def test_the_report_gives_the_method_in_use_its_price_alone_and_its_measured_start():
    # profiled with DGC on both buckets, whose start took 6 ms in the step (1 ms alone): the model
    # prices what it measured alone (docs/auto-compression.md#in-situ), and the report shows both
    buckets = [SimpleNamespace(name=n, numel=MB, dtype="float32", dense=False) for n in ("a", "b")]
    opts = AutoOptions(allow=["none", "topk", "dgc"], min_density=0.01)
    prof = Profile((0.001, 0.001), (0.006, 0.006), 0.05, 5)
    out = decide(buckets, prof, [DGC, DGC], LINK, opts, lambda ms, top: ALL_FITS, ranks=2, adaptive=False,
                 banned=set(), comm_cpu=1.0)
    assert out["assignment"] == {"a": "dgc@0.01", "b": "dgc@0.01"}
    # the fastest predicted uniform assignments other than the decision (Top-k 1 %, then dense):
    # within the margin of a 50 ms step that the update mostly fills
    assert out["alternatives"] == [{"a": "topk@0.01", "b": "topk@0.01"}, {"a": "none", "b": "none"}]
    # in a step of nothing but these buckets, both are predicted beyond the margin: none is tried
    short = decide(buckets, Profile((0.001, 0.001), (0.006, 0.006), 0.0, 5), [DGC, DGC], LINK, opts,
                   lambda ms, top: ALL_FITS, ranks=2, adaptive=False, banned=set(), comm_cpu=1.0)
    assert short["alternatives"] == []
    rows = out["report"]["buckets"]
    assert [(b["in_use"], b["in_use_alone_ms"], b["measured_start_ms"]) for b in rows] == [("dgc@0.01", 1.0, 6.0)] * 2


def test_profile_is_the_median_of_the_samples():
    p = Profile.of([(0.3, [1.0, 2.0], [0.1, 0.2]), (0.1, [3.0, 4.0], [0.3, 0.4]), (0.2, [2.0, 3.0], [0.2, 0.3])], 2)
    assert p == Profile((2.0, 3.0), (0.2, 0.3), 0.2, 3)
