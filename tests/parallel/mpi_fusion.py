"""Rank-side checks of fusion="mgwfbp"/"optimal"/"auto" under ``mpirun -np P`` (run by
test_parallel_fusion.py): T-MG-6, the plan is identical on every rank although the ranks'
profiles differ (rank 1 sleeps in some backward hooks), and training with the plan equals
training with threshold fusion within floating-point tolerance. Skipped at size 1.
"""
import time

import pytest
import torch

import torch_plugin as hco
from hvd_commopt import runtime
from tests.parallel.ranks import require_mpirun

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
require_mpirun("tests/parallel/test_parallel_fusion.py")
OPTS = {"warmup_steps": 1, "profile_steps": 4, "measure_steps": 3,
        "calibrate": {"repeats": 4, "warmup": 2}}


def make_model(depth=8, width=32):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(10, width), torch.nn.ReLU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))


def batch(rank, step, n=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g)


def slow_down_rank1(model):
    """Rank 1 sleeps 3 ms in every other layer's backward: its profile differs from rank 0's."""
    if R != 1:
        return
    for i, m in enumerate(model):
        if isinstance(m, torch.nn.Linear) and i % 4 == 0:
            m.weight.register_hook(lambda g: (time.sleep(0.003), g)[1])


def train(fusion, steps=12, compression=None, threshold=4096, **kw):
    model = make_model()
    slow_down_rank1(model)
    if threshold is not None:
        kw["fusion_threshold"] = threshold
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), fusion=fusion,
                                   compression=compression, **kw)
    for step in range(steps):
        x, y = batch(R, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def everyone(obj):
    return runtime.communicator().allgather_object(obj)


@pytest.mark.parametrize("fusion", ["mgwfbp", "optimal", "auto"])
def test_plan_identical_on_all_ranks_and_training_equals_threshold(fusion):
    ref, _ = train("threshold")
    got, opt = train(fusion, fusion_options=OPTS)
    engine = opt.comm_engine
    plans = everyone((engine.plan, [b.names for b in engine.buckets]))
    assert all(p == plans[0] for p in plans), plans
    rep = opt.fusion_report
    assert rep["phase"] == "done" and rep["buckets"] == len(engine.plan)
    assert everyone(rep["cost_model"]) == [rep["cost_model"]] * P  # calibrated once, broadcast
    assert everyone(rep["predicted_s"]) == [rep["predicted_s"]] * P  # rank 0's prediction
    assert rep["measured_s"] > 0 and rep["profile"]["tensors"] == 20
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    flat = torch.cat([t.reshape(-1) for t in got])
    assert all(torch.equal(flat, f) for f in everyone(flat))


def test_sparse_topk_plans_with_omgs_and_ranks_stay_identical():
    got, opt = train("mgwfbp", compression=hco.Compression.topk(0.05), fusion_options=OPTS)
    rep = opt.fusion_report
    assert rep["chosen"] == "omgs" and rep["select_s"] is not None and rep["select_s"] >= 0
    plans = everyone(opt.comm_engine.plan)
    assert all(p == plans[0] for p in plans)
    flat = torch.cat([t.reshape(-1) for t in got])
    assert all(torch.equal(flat, f) for f in everyone(flat))


def test_layerwise_topk_in_fused_buckets_trains_like_one_bucket_per_layer():
    """docs/lags-omgs.md#lags-merged: LAGS's per-layer top-k sent in the default buckets gives the
    weights of one bucket per layer, bit for bit, on every rank."""
    per_layer, _ = train("threshold", compression=hco.Compression.topk(0.05), threshold=0)
    fused, opt = train("threshold", compression=hco.Compression.topk(0.05, layerwise=True), threshold=None)
    assert any(len(b.names) > 1 and not b.dense for b in opt.comm_engine.buckets)
    for a, b in zip(per_layer, fused):
        assert torch.equal(a, b)
    flat = torch.cat([t.reshape(-1) for t in fused])
    assert all(torch.equal(flat, f) for f in everyone(flat))
