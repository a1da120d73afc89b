"""Rank-side checks of compression="auto" under ``mpirun -np P`` (run by
test_parallel_autocompress.py): rank 0 decides and every rank uses the same methods per bucket,
although the ranks' profiles differ (rank 1 sleeps in some backward hooks); the weights stay
identical on every rank. Skipped at size 1 (docs/auto-compression.md#policy)."""
import time

import torch

import torch_plugin as hco
from hvd_commopt import runtime
from hvd_commopt.fusion import AlphaBeta, CostModel
from tests.parallel.ranks import require_mpirun

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
require_mpirun("tests/parallel/test_parallel_autocompress.py")
STEPS = 1 + 3 + 5 + 1 + 5  # first step, warm-up, profile, settle, measure
SLOW = CostModel(AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), ranks=P)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))


def train(compression, steps=STEPS):
    model = make_model()
    if R == 1:  # a different profile on rank 1: only rank 0's may decide
        model[2].weight.register_hook(lambda g: (time.sleep(0.004), g)[1])
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   fusion_threshold=0)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + R)
        x = torch.randn(16, 32, generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(1)).backward()
        opt.step()
    return model, opt


def everyone(obj):
    return runtime.communicator().allgather_object(obj)


def _same_everywhere(model, opt):
    rep = opt.compression_report
    methods = [(b["bucket"], b["method"]) for b in rep["buckets"]]
    assert all(m == methods for m in everyone(methods))
    assert everyone(rep["predicted_s"]) == [rep["predicted_s"]] * P  # rank 0's prediction
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert all(torch.equal(flat, f) for f in everyone(flat))
    return rep


def test_ranks_agree_on_the_choice_with_a_calibrated_link():
    model, opt = train(hco.Compression.auto(verbose=True))
    rep = _same_everywhere(model, opt)
    assert everyone(rep["cost_model"]) == [rep["cost_model"]] * P  # calibrated once, broadcast
    assert rep["measured_s"] > 0


def test_ranks_agree_on_a_sparse_choice_on_a_slow_link():
    model, opt = train(hco.Compression.auto(cost_model=SLOW, allow=["topk", "dgc"], margin=1e3))
    rep = _same_everywhere(model, opt)
    assert any("@" in b["method"] for b in rep["buckets"])
