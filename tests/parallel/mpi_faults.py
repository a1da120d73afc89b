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


if scenario in ("raise", "raise_after_dist_init"):
    # Rank `failing` raises at step 3; the others are then waiting in step 3's allreduce (or
    # reach it soon) and would sit there for the whole collective timeout without the notice.
    if scenario == "raise_after_dist_init":
        # torch.distributed set up after init() (a DDP model beside ours, as the suite's baselines
        # do it): torch's exception hook then wraps ours and holds stderr in a buffer while ours runs
        import datetime

        import torch.distributed as dist

        from hvd_commopt import env, runtime
        from torch_plugin.rendezvous import init_default_group
        if not dist.is_initialized():
            init_default_group("gloo", env.detect_launch(), datetime.timedelta(minutes=2),
                               runtime.communicator().backend)
    model, opt = build()
    for step in range(200):
        if R == failing and step == 3:
            print(f"rank {R}: raising at t={time.time():.3f}", flush=True)
            raise ValueError(f"boom on rank {R}")
        train_step(model, opt)
    sys.exit(f"rank {R}: trained 200 steps although rank {failing} raised")

if scenario == "exit_early":
    # Rank 1 ends its script after 3 steps (as with unequal data shards) without any error.
    model, opt = build()
    for step in range(200):
        if R == 1 and step == 3:
            print(f"rank {R}: leaving at t={time.time():.3f}", flush=True)
            break
        train_step(model, opt)
    print(f"rank {R}: end of script after {step} steps", flush=True)
    sys.exit(0)

if scenario == "bpps":
    # A second backward pass before step() with backward_passes_per_step=1 raises on rank 1 only.
    model, opt = build(backward_passes_per_step=1)
    for step in range(200):
        opt.zero_grad()
        model(torch.ones(8, 32)).square().mean().backward()
        if R == 1 and step == 3:
            print(f"rank {R}: second backward at t={time.time():.3f}", flush=True)
            model(torch.ones(8, 32)).square().mean().backward()
        opt.step()
    sys.exit(f"rank {R}: trained 200 steps although rank 1 misused backward_passes_per_step")

if scenario == "finish":
    # Everyone trains the same steps; rank 0 then works 3 s longer (a checkpoint) without
    # collectives. Legitimate: the job must end with exit code 0, promptly.
    model, opt = build()
    for _ in range(5):
        train_step(model, opt)
    if R == 0:
        time.sleep(3)
    print(f"rank {R}: done at t={time.time():.3f}", flush=True)
    sys.exit(0)

if scenario == "mismatch":
    # Rank 0 gathers an object (an allgather) where the others go straight into the step's
    # bucket allreduce: the timeout must say which rank is in which collective. (Different
    # compression per rank no longer gets this far: the wrap-time settings check refuses it.)
    model, opt = build()
    print(f"rank {R}: stepping at t={time.time():.3f}", flush=True)
    if R == 0:
        hco.allgather_object(R)
    train_step(model, opt)
    sys.exit(f"rank {R}: a step with different collectives on different ranks completed")

if scenario == "init_only":
    print(f"rank {R}: initialised", flush=True)
    sys.exit(0)

sys.exit(f"unknown scenario {scenario}")
