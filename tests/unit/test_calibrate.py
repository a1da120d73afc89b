"""Calibration mechanics (docs/cost-models.md#fitted-allreduce-model): measure on every rank, fit on rank 0, broadcast the fit."""
from __future__ import annotations

import json

import numpy as np
import pytest

import hvd_commopt.calibrate as cal
from hvd_commopt.comm import run_ranks
from hvd_commopt.errors import ConfigError
from hvd_commopt.fusion.cost_model import AlphaBeta, CostModel

SIZES = [4096, 16384, 65536]


def _calibrate(comm):
    return cal.calibrate(comm, sizes=SIZES, repeats=3, warmup=1).to_dict()


def test_two_ranks_get_the_same_model():
    out = run_ranks(2, _calibrate)
    assert out[0] == out[1]
    model = CostModel.from_dict(out[0])
    assert model.ranks == 2 and model.p2p is not None
    for ab in (model.allreduce, model.allgather, model.p2p):
        assert ab.alpha >= 0 and ab.beta >= 0


def test_single_rank_skips_p2p():
    (d,) = run_ranks(1, _calibrate)
    model = CostModel.from_dict(d)
    assert model.ranks == 1 and model.p2p is None


def test_selected_collectives_only():
    (d,) = run_ranks(1, lambda c: cal.calibrate(c, SIZES, 1, 0, collectives=("allgather",)).to_dict())
    assert d["allreduce"] == {"alpha": 0.0, "beta": 0.0}


class _FakeClockComm:
    """Rank 0 of 1 whose collectives take exactly alpha + beta·bytes on a fake clock."""

    size, rank, buffer_kind = 1, 0, "numpy"
    models = {"allreduce": AlphaBeta(2e-4, 3e-10), "allgather": AlphaBeta(5e-4, 1e-9)}

    def __init__(self, clock):
        self.clock = clock

    def barrier(self, name=""):
        self.clock.now += 1.0  # must not be counted

    def allreduce_(self, buf, op="sum", name=""):
        self.clock.now += self.models["allreduce"].time(buf.nbytes)

    def allgather(self, buf, name=""):
        self.clock.now += self.models["allgather"].time(buf.nbytes)

    def allgather_object(self, obj, name=""):
        return [obj]

    def broadcast_object(self, obj, root=0, name=""):
        return obj


@pytest.mark.parametrize("statistic", ["min", "median", "mean"])
def test_fit_recovers_injected_costs(monkeypatch, statistic):
    class Clock:
        now = 0.0

    clock = Clock()
    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock.now)
    model = cal.calibrate(_FakeClockComm(clock), sizes=None, repeats=2, warmup=1, statistic=statistic)
    for name, ab in _FakeClockComm.models.items():
        fit = getattr(model, name)
        assert fit.alpha == pytest.approx(ab.alpha, rel=1e-6)
        assert fit.beta == pytest.approx(ab.beta, rel=1e-6)
    assert model.p2p is None


def test_min_statistic_ignores_interference_bursts(monkeypatch):
    """A stall that hits every size's first repeat (sizes are interleaved) leaves the min-fit exact."""
    class Clock:
        now = 0.0

    clock = Clock()
    monkeypatch.setattr(cal.time, "perf_counter", lambda: clock.now)

    class Stalling(_FakeClockComm):
        calls = 0

        def allreduce_(self, buf, op="sum", name=""):
            Stalling.calls += 1
            super().allreduce_(buf)
            if Stalling.calls <= len(cal.DEFAULT_SIZES):  # the whole first round of timed calls
                self.clock.now += 0.016

    model = cal.calibrate(Stalling(clock), repeats=3, warmup=0, collectives=("allreduce",))
    assert model.allreduce.alpha == pytest.approx(2e-4, rel=1e-6)
    assert model.allreduce.beta == pytest.approx(3e-10, rel=1e-6)


@pytest.mark.parametrize("kw,msg", [({"sizes": [4096]}, "distinct"), ({"sizes": [4096, 4097]}, "multiples of 4"),
                                    ({"repeats": 0}, "repeats"), ({"collectives": ("bcast",)}, "unknown"),
                                    ({"statistic": "max"}, "statistic")])
def test_argument_errors(kw, msg):
    def body(comm):
        args = {"sizes": SIZES, **kw}
        with pytest.raises(ConfigError, match=msg):
            cal.calibrate(comm, **args)
    run_ranks(1, body)


def test_native_backend_needs_make_buffer():
    class Native(_FakeClockComm):
        buffer_kind = "native"

        class backend:  # noqa: N801 - mimics Communicator.backend
            name = "nccl"

    with pytest.raises(ConfigError, match="make_buffer"):
        cal.calibrate(Native(None), sizes=SIZES)
    seen = []

    class Clock:
        now = 0.0

    def make(nbytes):
        seen.append(nbytes)
        return np.zeros(nbytes // 4, np.float32)

    cal.calibrate(Native(Clock()), sizes=SIZES, repeats=1, warmup=0, make_buffer=make)
    assert sorted(set(seen)) == SIZES


def test_main_writes_json(tmp_path, capsys, monkeypatch):
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK", "RANK", "HVD_COMMOPT_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    from hvd_commopt import runtime
    runtime.shutdown()  # an earlier test in this process may have initialised the runtime
    out = tmp_path / "cm.json"
    assert cal.main(["--sizes", "4096,8192,16384", "--repeats", "2", "--warmup", "0",
                     "--backend", "local", "--out", str(out)]) == 0
    model = CostModel.from_dict(json.loads(out.read_text()))
    assert model.ranks == 1
    text = capsys.readouterr().out
    assert "allreduce" in text and "alpha" in text and str(out) in text
    assert not runtime.is_initialized()  # main shut down the runtime it started


def test_main_reports_bad_arguments(capsys, monkeypatch):
    monkeypatch.delenv("HVD_COMMOPT_BACKEND", raising=False)
    assert cal.main(["--sizes", "4096", "--backend", "local"]) == 2
    assert "distinct" in capsys.readouterr().err
