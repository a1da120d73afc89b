"""``compression="auto"`` under an Adam-type optimizer has S-SGD's buckets: only dense methods are
candidates there, so the 1-D tensors stay in their groups instead of buckets of their own
(docs/auto-compression.md#adaptive-buckets). Under SGD they get their own only where a sparse method
is a candidate, that is when ``allow=`` names one (docs/topk.md#dense-1d,
docs/auto-compression.md#accuracy-floor)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.fusion import AlphaBeta, CostModel  # noqa: E402

# a given cost model: no calibration before step 0 (the decision is not what is tested here)
FAST = CostModel(AlphaBeta(1e-5, 1e-10), AlphaBeta(1e-5, 1e-10), None, ranks=2)


def _layout(comm, compression, adam: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-3) if adam
             else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt = hco.DistributedOptimizer(inner, named_parameters=model.named_parameters(), communicator=comm,
                                   compression=compression, fusion_options={"first_bucket_bytes": 0})
    layout = [list(b.names) for b in opt.comm_engine.buckets]
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # a step on the rebuilt layout
    return layout


@pytest.mark.parametrize("adam,allow", [(True, None), (True, ("none", "bf16", "topk")), (False, None),
                                        (False, ("none", "bf16", "topk"))])
def test_auto_buckets_under_adam_are_ssgds(adam, allow):
    ssgd = run_ranks(2, lambda comm: _layout(comm, None, adam))[0]
    auto = run_ranks(2, lambda comm: _layout(comm, Compression.auto(cost_model=FAST, **({} if allow is None else {'allow': allow})), adam))
    assert auto[0] == auto[1]
    assert ssgd == [["2.bias", "2.weight", "1.bias", "1.weight", "0.bias", "0.weight"]]
    if adam or allow is None:  # no sparse candidate: S-SGD's buckets
        assert auto[0] == ssgd
    else:  # the 1-D tensors whole in a bucket, the matrices in another, by their last arrival
        assert auto[0] == [["2.bias", "1.bias", "1.weight", "0.bias"], ["2.weight", "0.weight"]]
