"""DistributedOptimizer(fusion=...) on in-process ranks: the planned strategies train like
threshold fusion, every rank ends with rank 0's plan, and the report is exposed."""
import copy
import threading

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import run_ranks  # noqa: E402
from hvd_commopt.errors import ConfigError  # noqa: E402
from hvd_commopt.fusion import AlphaBeta, CostModel  # noqa: E402

COST = CostModel(AlphaBeta(2e-4, 1e-9), AlphaBeta(2e-4, 1e-9), AlphaBeta(1e-4, 1e-9), ranks=2)
OPTS = {"warmup_steps": 1, "profile_steps": 3, "measure_steps": 2, "cost_model": COST}
_LOCK = threading.Lock()
_INIT: dict = {}


def make_model():
    with _LOCK:  # torch's RNG is shared by the thread-ranks: build the weights once
        if "w" not in _INIT:
            torch.manual_seed(0)
            _INIT["w"] = copy.deepcopy(_mlp().state_dict())
        m = _mlp()
        m.load_state_dict(_INIT["w"])
        return m


def _mlp():
    layers = [torch.nn.Linear(6, 16), torch.nn.ReLU()]
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 3))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(comm, fusion, steps=9, **kw):
    model = make_model()
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), communicator=comm,
                                   fusion=fusion, fusion_threshold=0, **kw)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(comm.rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("fusion", ["mgwfbp", "optimal", "auto"])
def test_planned_fusion_trains_like_threshold_fusion(fusion):
    def body(comm):
        ref, _ = train(comm, "threshold")
        got, opt = train(comm, fusion, fusion_options=OPTS)
        return ref, got, opt.comm_engine.plan, opt.fusion_report
    out = run_ranks(2, body)
    assert out[0][2] == out[1][2]  # same buckets on both ranks
    for ref, got, _, rep in out:
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert rep["phase"] == "done" and rep["measured_s"] > 0 and rep["predicted_s"] > 0
        assert rep["profile"]["tensors"] == 12 and rep["profile"]["backward_s"] >= 0
    assert out[0][0][0].shape == (16, 6)
    for a, b in zip(out[0][1], out[1][1]):
        assert torch.equal(a, b)


def test_verbose_argument_and_calibration_through_the_optimizer(capsys):
    def body(comm):
        _, opt = train(comm, "auto", verbose=True,
                       fusion_options={"warmup_steps": 1, "profile_steps": 2, "measure_steps": 2,
                                       "calibrate": {"sizes": [4096, 16384], "repeats": 2, "warmup": 1}})
        return opt.comm_engine.tuner.verbose, opt.fusion_report
    (v0, rep0), (v1, rep1) = run_ranks(2, body)
    assert v0 and v1 and rep0["cost_model"] == rep1["cost_model"] and rep0["cost_model"]["ranks"] == 2
    assert capsys.readouterr().out.count("hvd_commopt fusion: strategy=auto") == 1


def test_threshold_and_none_reports_and_bad_strategy():
    def body(comm):
        _, none = train(comm, "none", steps=1)
        _, thr = train(comm, "threshold", steps=1)
        return none.fusion_report, thr.fusion_report
    none, thr = run_ranks(1, body)[0]
    assert none["buckets"] == 12 and thr["strategy"] == "threshold"
    with pytest.raises(ConfigError, match="fusion must be one of"):
        run_ranks(1, lambda c: train(c, "fastest", steps=0))
