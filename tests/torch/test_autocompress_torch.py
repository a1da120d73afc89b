"""DistributedOptimizer(compression="auto") end to end on in-process ranks: it trains, every rank
follows rank 0's choice, the report shows it, it composes with fusion="auto" and Schedule.od(),
and deciding dense equals plain S-SGD (docs/auto-compression.md)."""
import copy
import threading

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, Schedule, run_ranks  # noqa: E402
from hvd_commopt.fusion import AlphaBeta, CostModel  # noqa: E402

# 10 MB/s: the 1 MB layer's allreduce takes ~100 ms, its top-1 % far less. The link is not slow in
# fact, so a wide margin keeps the guard (docs/auto-compression.md#revert) from undoing the choice.
SLOW = CostModel(AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), ranks=2)
FAST = CostModel(AlphaBeta(1e-7, 1e-14), AlphaBeta(1e-7, 1e-14), AlphaBeta(1e-7, 1e-14), ranks=2)
# the sparse methods named (the default allows the quantisers instead, docs/auto-compression.md#accuracy-floor)
SPARSE = ["bf16", "topk", "dgc"]
QUANT = ["quant8", "quant4"]
STEPS = 1 + 3 + 5 + 1 + 5  # first step, warm-up, profile, settle, measure
TRIALS = 3 * (1 + 5)  # without a given cost model: up to two uniform assignments measured after, and the decision again (trial.py)
_LOCK = threading.Lock()
_INIT: dict = {}


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 4))


def make_model():
    with _LOCK:  # torch's RNG is shared by the thread-ranks: build the weights once
        if "w" not in _INIT:
            torch.manual_seed(0)
            _INIT["w"] = copy.deepcopy(_mlp().state_dict())
        m = _mlp()
        m.load_state_dict(_INIT["w"])
        return m


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, (x[:, :4].argmax(1))  # a learnable target


def train(comm, compression, steps=STEPS, adamw=False, **kw):
    torch.set_num_threads(1)
    model = make_model()
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-3) if adamw
             else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    opt = hco.DistributedOptimizer(inner,
                                   named_parameters=model.named_parameters(), communicator=comm,
                                   compression=compression, **kw)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(comm.rank, step % 4)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if hasattr(opt, "drain"):
        opt.drain()
    return [p.detach().clone() for p in model.parameters()], opt, losses


def _check_agreed(res):
    (p0, o0, l0), (p1, o1, _) = res
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # every rank applied the same update
    assert l0[-1] < l0[0]
    rep = o0.compression_report
    assert rep is not None and rep["decisions"] == 1
    assert [b["method"] for b in rep["buckets"]] == [b["method"] for b in o1.compression_report["buckets"]]
    return rep


def test_auto_trains_and_reports_its_choice_per_bucket():
    res = run_ranks(2, lambda comm: train(comm, Compression.auto(cost_model=SLOW, margin=1e3, allow=SPARSE)))
    rep = _check_agreed(res)
    big = max(rep["buckets"], key=lambda b: b["bytes"])
    assert "@" in big["method"]  # the bucket of the 1 MB layer goes sparse on the slow link
    assert rep["phase"] == "watch" and rep["measured_s"] > 0
    assert rep["predicted_s"] < rep["dense_predicted_s"]
    assert all(b["why"] for b in rep["buckets"])


def test_auto_under_adamw_keeps_every_bucket_dense_cast_or_quantised():
    """Under an Adam-type optimizer no sparse method is a candidate, even named in ``allow`` on a
    link where one would pay (docs/auto-compression.md#adaptive); the report says why. The casts
    and the quantisers remain."""
    res = run_ranks(2, lambda comm: train(comm, Compression.auto(cost_model=SLOW, margin=1e3, allow=SPARSE + QUANT),
                                           adamw=True))
    rep = _check_agreed(res)
    assert rep["adaptive_optimizer"] is True
    assert all("@" not in b["method"] for b in rep["buckets"])
    assert any(b["method"] in ("bf16", "quant8", "quant4") for b in rep["buckets"])  # the slow link still pays
    big = max(rep["buckets"], key=lambda b: b["bytes"])
    assert "Adam-type optimizer" in big["why"] or big["method"] in ("bf16", "quant8", "quant4")


def test_auto_composes_with_fusion_auto():
    opts = {"warmup_steps": 1, "profile_steps": 3, "measure_steps": 2, "cost_model": SLOW}
    res = run_ranks(2, lambda comm: train(comm, Compression.auto(cost_model=SLOW, margin=1e3), steps=STEPS + 7, fusion="auto",
                                           fusion_options=opts))
    rep = _check_agreed(res)
    assert res[0][1].fusion_report["phase"] == "done"
    assert [b["bucket"] for b in rep["buckets"]] == [b.name for b in res[0][1]._hco_engine.buckets]


def test_auto_composes_with_the_delayed_schedule():
    res = run_ranks(2, lambda comm: train(comm, Compression.auto(cost_model=SLOW, margin=1e3), steps=STEPS + 2,
                                           schedule=Schedule.od()))
    _check_agreed(res)


def test_auto_deciding_dense_is_plain_ssgd_with_momentum_bit_for_bit():
    auto = run_ranks(2, lambda comm: train(comm, Compression.auto(cost_model=FAST)))
    plain = run_ranks(2, lambda comm: train(comm, None))
    assert {b["method"] for b in auto[0][1].compression_report["buckets"]} == {"none"}
    for a, p in zip(auto[0][0], plain[0][0]):
        torch.testing.assert_close(a, p, rtol=0, atol=0)


def test_compression_report_is_none_for_a_fixed_compression():
    _, opt, _ = run_ranks(1, lambda comm: train(comm, None, steps=1))[0]
    assert opt.compression_report is None


def test_auto_on_one_rank_stays_dense_and_says_why():
    _, opt, _ = run_ranks(1, lambda comm: train(comm, "auto", steps=STEPS))[0]
    rep = opt.compression_report
    assert {b["method"] for b in rep["buckets"]} == {"none"}
    assert all("one rank" in b["why"] for b in rep["buckets"])


def test_auto_decides_before_step_0_from_the_link_and_the_compute_alone():
    """The wrapper's attach prices the buckets (docs/auto-compression.md#before-step-0): on the slow
    link the 1 MB layer's bucket is sparse from the first step, not after dense warm-up steps."""
    def body(comm):
        torch.set_num_threads(1)
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(), communicator=comm,
                                       compression=Compression.auto(cost_model=SLOW, margin=1e3, allow=SPARSE))
        policy = opt._hco_engine.engine.reducer.policy
        return {k: m.key for k, m in policy.reducer.assignment.items()}, dict(policy.report), policy.decisions
    (a0, rep0, d0), (a1, _, d1) = run_ranks(2, body)
    assert a0 == a1 and d0 == d1 == 0
    big = max(rep0["buckets"], key=lambda b: b["bytes"])
    assert "@" in a0[big["bucket"]] and big["method"] == a0[big["bucket"]]
    assert rep0["phase"] == "before step 0" and rep0["comm_cpu"] == 1.0  # CPU tensors: the send is the rank's work


def test_auto_calibrates_and_times_its_candidates_before_step_0_only(monkeypatch):
    """Neither the link's calibration nor the candidates' timing runs inside training: both run
    once, when the optimizer is wrapped; the decision after the profile reuses them."""
    from hvd_commopt.autocompress import policy as P
    calls = {"calibrate": [], "local": []}
    real_cal, real_local = P.calibrate, P.measure_local_costs

    def cal(comm, **kw):
        calls["calibrate"].append(comm.rank)
        return real_cal(comm, **kw)

    def local(*a, **kw):
        calls["local"].append(1)
        return real_local(*a, **kw)
    monkeypatch.setattr(P, "calibrate", cal)
    monkeypatch.setattr(P, "measure_local_costs", local)

    def body(comm):
        torch.set_num_threads(1)
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(), communicator=comm,
                                       compression=Compression.auto(margin=1e3))
        comm.barrier()  # both ranks wrapped
        before = (len(calls["calibrate"]), len(calls["local"]))
        for step in range(STEPS + TRIALS):
            opt.zero_grad()
            x, y = batch(comm.rank, step % 4)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return before, opt.compression_report
    res = run_ranks(2, body)
    # every rank times the candidates, at once (docs/auto-compression.md#costs-every-rank)
    assert sorted(calls["calibrate"]) == [0, 1] and calls["local"] == [1, 1]
    for before, rep in res:
        assert before == (2, 2)  # all of it before step 0
        assert rep["decisions"] == 1 and rep["phase"] == "watch"


def test_auto_by_default_quantises_on_a_slow_link_and_trains():
    """The default candidates (docs/auto-compression.md#kinds: an MLP under SGD, int8 and int4):
    no sparse method; on the slow link the 1 MB layer's bucket goes to a quantiser, every rank
    applies the same update and the loss falls."""
    res = run_ranks(2, lambda comm: train(comm, Compression.auto(cost_model=SLOW, margin=1e3)))
    rep = _check_agreed(res)
    assert rep["allow"] == ["none", "bf16", "quant8", "quant4"]
    assert rep["kinds"].startswith("model: other, 0% of ") and "optimizer: SGD" in rep["kinds"]
    assert all("@" not in b["method"] for b in rep["buckets"])
    big = max(rep["buckets"], key=lambda b: b["bytes"])
    assert big["method"] in ("quant8", "quant4")
