"""Rank-side fault scenarios, one per argv[1]; run by test_faults.py under mpirun (or our launcher).

Each failing rank prints ``<event> at t=<unix time>`` just before it fails, so the wrapper can
measure how long the job lived on after the failure.
"""
import sys
import time

import torch

import torch_plugin as hco

scenario = sys.argv[1]
hco.init()
torch.set_num_threads(1)
R, P = hco.rank(), hco.size()
failing = int(sys.argv[2]) if len(sys.argv) > 2 else 1


def build(compression=None, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                                   compression=compression or hco.Compression.none, **kw)
    return model, opt


def train_step(model, opt):
    opt.zero_grad()
    model(torch.ones(8, 32)).square().mean().backward()
    opt.step()


if scenario == "mismatch":
    # Top-k on rank 0 (an allgather per bucket), dense on the others (an allreduce): the
    # timeout must say which rank is in which collective.
    comp = hco.Compression.topk(0.1) if R == 0 else hco.Compression.none
    model, opt = build(compression=comp)
    print(f"rank {R}: stepping at t={time.time():.3f}", flush=True)
    train_step(model, opt)
    sys.exit(f"rank {R}: a step with different collectives on different ranks completed")

sys.exit(f"unknown scenario {scenario}")
