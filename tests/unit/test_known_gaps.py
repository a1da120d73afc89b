"""Wrap-time warnings for the combinations the convergence matrix measured short of the target
(docs/convergence-matrix.md#warnings): once per (method, family), naming the gap and an alternative."""
from __future__ import annotations

import warnings

import pytest

from hvd_commopt import Compression
from hvd_commopt.host import ADAPTIVE, GradientCapture
from hvd_commopt.reduce import known_gaps
from hvd_commopt.reduce.known_gaps import KNOWN_GAPS, MeasuredGapWarning, warn_known_gap
from tests.unit.test_adaptive_optimizers import Host as _Host

FACTORIES = {"topk": Compression.topk, "gtopk": Compression.gtopk, "oktopk": Compression.oktopk,
             "dgc": Compression.dgc, "randomk": Compression.randomk}


class Host(_Host):
    """The adaptive tests' host, whose SGD can run without its momentum (torch.optim.SGD's can)."""

    def hyper_without_momentum(self):
        return {"momentum": 0.0}


@pytest.fixture(autouse=True)
def fresh():
    known_gaps._warned.clear()
    yield
    known_gaps._warned.clear()


def bind(red, host):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        red.bind_host(host, ["w"])
    return [str(x.message) for x in w if issubclass(x.category, MeasuredGapWarning)]


@pytest.mark.parametrize("family", ["sgd", ADAPTIVE])
@pytest.mark.parametrize("method", ["topk", "gtopk", "oktopk", "dgc"])
def test_each_measured_combination_warns_once_with_its_gap_and_alternative(method, family):
    gap = KNOWN_GAPS[method, family]
    host = Host(family, momentum=0.9 if family == "sgd" else 0.0)
    msgs = bind(FACTORIES[method](0.01), host)
    assert msgs == [gap.message(0.01)]
    assert f"Compression.{method} at density 0.01" in msgs[0] and gap.measured in msgs[0]
    assert gap.alternative in msgs[0] and "docs/convergence-matrix.md#warnings" in msgs[0]
    assert bind(FACTORIES[method](0.001), host) == []  # once per process and combination


def test_the_table_covers_exactly_the_measured_combinations():
    methods = ("topk", "gtopk", "oktopk", "dgc", "cocod", "local_sgd", "od", "ssd", "cd")
    assert sorted(KNOWN_GAPS) == sorted((m, f) for m in methods for f in ("sgd", ADAPTIVE))
    for gap in KNOWN_GAPS.values():  # each names its set-up: the seeds and the date of the 3-seed matrix
        assert "3 seeds" in gap.measured and "2026-11-27" in gap.measured
        assert gap.namespace == ("Compression" if gap.method in ("topk", "gtopk", "oktopk", "dgc") else "Schedule")


def test_what_was_not_measured_does_not_warn():
    assert bind(Compression.topk(0.05), Host("sgd", 0.9)) == []  # denser than measured
    assert bind(Compression.topk(0.01), Host("sgd", 0.0)) == []  # SGD without momentum
    assert bind(Compression.topk(0.01), Host("other", 0.9)) == []  # another optimizer
    assert bind(Compression.randomk(0.3), Host("sgd", 0.9)) == []  # random-k warns on its own terms
    assert warn_known_gap("topk", 0.01, GradientCapture(), ["w"]) is None  # no optimizer


def test_a_per_layer_density_warns():
    msgs = bind(Compression.topk({"default": 0.05}), Host("sgd", 0.9))
    assert len(msgs) == 1 and "per-layer densities" in msgs[0]


def test_lags_is_topk_and_warns_as_topk():
    assert FACTORIES["topk"](0.01).method == "topk"
    assert Compression.dgc(0.01).method == "dgc" and Compression.gtopk(0.01).method == "gtopk"


def test_the_warning_is_a_user_warning_that_filters_silence():
    assert issubclass(MeasuredGapWarning, UserWarning) and not issubclass(MeasuredGapWarning, RuntimeWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", MeasuredGapWarning)
        Compression.topk(0.01).bind_host(Host("sgd", 0.9), ["w"])


def test_cocod_is_a_schedule_entry():
    host = Host("sgd", 0.9)
    with pytest.warns(MeasuredGapWarning, match=r"^Schedule.cocod under SGD with momentum .* -0.56 / -0.65 points .*"
                                                r"synchronous S-SGD"):
        assert warn_known_gap("cocod", None, host, ["w"], "Schedule") is KNOWN_GAPS["cocod", "sgd"]
    assert warn_known_gap("cocod", None, host, ["w"]) is None  # not a compression
    assert warn_known_gap("topk", 0.01, host, ["w"], "Schedule") is None  # not a schedule


def test_local_sgd_under_adaptive_is_a_schedule_entry():
    host = Host(ADAPTIVE, momentum=0.0)
    with pytest.warns(MeasuredGapWarning, match=r"^Schedule.local_sgd under an adaptive optimizer .* \+5.9 % .*"
                                                r"Schedule.diloco\(50, outer_lr=1.0, outer_momentum=0.5\)"):
        assert warn_known_gap("local_sgd", None, host, ["w"], "Schedule") is KNOWN_GAPS["local_sgd", ADAPTIVE]


@pytest.mark.parametrize("family", ["sgd", ADAPTIVE])
@pytest.mark.parametrize("method", ["od", "ssd", "cd", "cocod", "local_sgd"])
def test_each_schedule_measured_short_warns_once_as_a_schedule(method, family):
    host = Host(family, momentum=0.9 if family == "sgd" else 0.0)
    with pytest.warns(MeasuredGapWarning, match=rf"^Schedule.{method} under "):
        assert warn_known_gap(method, None, host, ["w"], "Schedule") is KNOWN_GAPS[method, family]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_known_gap(method, None, host, ["w"], "Schedule") is KNOWN_GAPS[method, family]  # once
    assert warn_known_gap(method, None, Host("sgd", 0.0), ["w"], "Schedule") is None  # SGD without momentum


def test_schedules_not_measured_short_do_not_warn():
    for name in ("sync", "diloco"):
        assert warn_known_gap(name, None, Host("sgd", 0.9), ["w"], "Schedule") is None
        assert warn_known_gap(name, None, Host(ADAPTIVE, 0.0), ["w"], "Schedule") is None
