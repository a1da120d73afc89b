"""Rank-side error scenarios, one per argv[1]; run by test_parallel_sync.py under mpirun."""
import sys
import time

import torch

import torch_plugin as hco
from hvd_commopt.errors import CollectiveTimeoutError, RankMismatchError

scenario = sys.argv[1]
hco.init()
torch.set_num_threads(1)
R, P = hco.rank(), hco.size()

if scenario == "mismatch":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8 + (R == P - 1)), torch.nn.Linear(8 + (R == P - 1), 2))
    try:
        hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    except RankMismatchError as e:
        print(f"rank {R}: RankMismatchError: {e}", flush=True)
        sys.exit(0)
    sys.exit(f"rank {R}: no error raised for a model that differs across ranks")

if scenario == "skip_step":
    # Rank 1 skips step 2; the others wait in that step's allreduce until the timeout, which
    # must name rank 1; then the job aborts instead of hanging.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    for step in range(3):
        if R == 1 and step == 2:
            print(f"rank {R}: skipping step {step} at t={time.time():.3f}", flush=True)
            time.sleep(150)  # far longer than the others' timeout: only their abort can end the job
            break
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        t0 = time.monotonic()
        try:
            opt.step()
        except CollectiveTimeoutError as e:
            print(f"rank {R}: CollectiveTimeoutError after {time.monotonic() - t0:.1f}s: {e} missing={e.missing_ranks}", flush=True)
            raise
    sys.exit(0)

sys.exit(f"unknown scenario {scenario}")
