"""Rank-side checks of NaN/Inf handling and checkpoints; run by test_reliability.py under mpirun.

docs/wrapper.md#nonfinite, docs/wrapper.md#checkpoints. Every rank runs these tests; a failure on
any rank fails the job. Skipped at size 1.
"""
import numpy as np
import pytest
import torch

import torch_plugin as hco
from hvd_commopt import Compression

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
pytestmark = pytest.mark.skipif(P == 1, reason="needs mpirun -np >= 2")


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def gathered(tensors):
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).reshape(1, -1)
    return hco.allgather(flat)


# -- NaN/Inf: DGC with a GradScaler -------------------------------------------------------------
STEPS, BAD, SCALE = 6, 2, 2.0 ** 10


def dgc_run(skip_bad):
    model = make_model()
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=Compression.dgc(0.2, sample_ratio=1.0))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    sent, skipped = [], []
    for s in range(STEPS):
        if skip_bad and s == BAD:
            scaler.update(new_scale=SCALE / 2)
            continue
        x, y = batch(R, s)
        if s == BAD and R == 0:
            x[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        sent.append(opt.comm_stats["bytes_sent"])
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    mem = opt.comm_engine.reducer.memory
    state = {k: torch.cat([t.reshape(-1) for t in d.values()]) for k, d in mem.state_dict().items()}
    return [p.detach().clone() for p in model.parameters()], state, sent, skipped, scaler.get_scale()


def test_dgc_nan_on_one_rank_costs_one_step_and_never_enters_the_memory():
    with pytest.warns(RuntimeWarning, match="rank 0: the gradient of bucket") if R == 0 else _no_check():
        params_a, mem_a, sent_a, skipped, scale = dgc_run(False)
    params_b, mem_b, _, _, _ = dgc_run(True)
    assert skipped == [s == BAD for s in range(STEPS)]
    assert scale == SCALE / 2
    assert all(torch.isfinite(t).all() for t in mem_a.values())
    assert all(b > 0 for b in sent_a[BAD + 1:]), sent_a  # the rank keeps sending after the NaN step
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
    for k in mem_a:
        assert torch.equal(mem_a[k], mem_b[k]), k
    everyone = gathered(params_a)
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(P))


class _no_check:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
