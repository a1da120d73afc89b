"""Iteration time of each schedule against synchronous SGD, 2 ranks, one run.

    python benchmarks/schedules_bench.py            # relaunches itself under mpirun -np 2
    python benchmarks/schedules_bench.py --quick    # fewer blocks
    python benchmarks/schedules_bench.py --rate 1gbit   # ranks on emulated hosts (benchmarks/netemu.py)

Model: ``benchmarks.models.resnet18(width)`` (ResNet-18 shape; width 64 = 11.2M parameters,
45 MB of fp32 gradients), synthetic 32x32 images, batch ``--batch`` per rank, SGD(momentum 0.9),
one torch thread per rank, default fusion (one bucket).

Variants (each its own model and optimizer, interleaved block by block so machine noise hits all
of them alike; after each block the variant is drained, and the drain is part of the block):

  compute    the plain optimizer, no communication (lower bound)
  ssgd       Schedule.sync()
  od         Schedule.od(warmup_steps=0)
  ssd        Schedule.ssd(delay=5, warmup_steps=0)
  cd         Schedule.cd(warmup_steps=0, batch_size=batch)  (int8 ternary, fp32 every 5th step)
  cocod      Schedule.cocod(4)
  local_sgd  Schedule.local_sgd(4)

Warm-ups are 0 so that the steady state is measured (warm-up steps are S-SGD steps). Reported per
variant (rank 0; max over ranks too): mean seconds per step over all timed blocks (drains
included), median step, speed-up vs ssgd, and bytes this rank sent per step (the communicator's
counter). Writes benchmarks/results/schedules_bench.json (``schedules_bench_<network>.json`` with
``--rate``) and prints a table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (machine_info, relaunch_under_mpirun, table, under_launcher,  # noqa: E402
                               write_json)

VARIANTS = ["compute", "ssgd", "od", "ssd", "cd", "cocod", "local_sgd"]


def schedule_for(name: str, batch: int):
    from hvd_commopt import Schedule
    return {"ssgd": Schedule.sync(), "od": Schedule.od(warmup_steps=0),
            "ssd": Schedule.ssd(delay=5, warmup_steps=0), "cd": Schedule.cd(warmup_steps=0, batch_size=batch),
            "cocod": Schedule.cocod(4), "local_sgd": Schedule.local_sgd(4)}[name]


def rank_main(args) -> None:
    import torch
    import torch.nn.functional as F

    import torch_plugin as hco
    from benchmarks.models import resnet18

    comm = hco.init()
    torch.set_num_threads(1)
    rank, size = hco.rank(), hco.size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    runs = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        model = resnet18(width=args.width)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if name != "compute":
            opt = hco.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           schedule=schedule_for(name, args.batch))
        runs[name] = (model, opt)
    nparams = sum(p.numel() for p in runs["ssgd"][0].parameters())

    def step(model, opt):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def drain(name, opt):
        if name != "compute":
            opt.drain()

    for name, (model, opt) in runs.items():  # untimed warm-up (allocation, first collectives)
        for _ in range(args.warmup):
            step(model, opt)
        drain(name, opt)
    comm.barrier()

    times = {n: [] for n in VARIANTS}
    block_s = {n: 0.0 for n in VARIANTS}
    sent = {n: 0 for n in VARIANTS}
    for _ in range(args.blocks):
        for name in VARIANTS:
            model, opt = runs[name]
            comm.barrier()
            before = comm.traffic.snapshot()["bytes_sent"]
            t_block = time.perf_counter()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(model, opt)
                times[name].append(time.perf_counter() - t0)
            drain(name, opt)
            block_s[name] += time.perf_counter() - t_block
            sent[name] += comm.traffic.snapshot()["bytes_sent"] - before
    n_steps = args.blocks * args.steps
    mine = {n: {"mean_s": block_s[n] / n_steps, "median_s": statistics.median(times[n]),
                "bytes_sent_per_step": sent[n] / n_steps} for n in VARIANTS}
    everyone = comm.allgather_object(mine, name="bench.results")
    if rank == 0:
        ssgd = mine["ssgd"]["mean_s"]
        rows, results = [], []
        for n in VARIANTS:
            worst = max(e[n]["mean_s"] for e in everyone)
            r = dict(mine[n], variant=n, mean_s_max_rank=worst, speedup_vs_ssgd=ssgd / mine[n]["mean_s"])
            results.append(r)
            rows.append([n, 1e3 * r["mean_s"], 1e3 * worst, 1e3 * r["median_s"], r["speedup_vs_ssgd"],
                         r["bytes_sent_per_step"] / 1e6])
        print(table(["variant", "mean ms/step", "mean ms (max rank)", "median ms", "speed-up vs ssgd",
                     "MB sent/step"], rows))
        network = os.environ.get("HVD_BENCH_NETWORK", "loopback")
        payload = {"benchmark": "schedules_bench", "ranks": size,
                   "network": network if network != "loopback" else "loopback (shared memory, one host)",
                   "model": f"resnet18(width={args.width})", "parameters": nparams,
                   "gradient_MB": nparams * 4 / 1e6, "batch_per_rank": args.batch, "blocks": args.blocks,
                   "steps_per_block": args.steps, "warmup_steps": args.warmup, "results": results,
                   "machine": machine_info(), "argv": sys.argv[1:]}
        path = write_json("schedules_bench" if network == "loopback" else f"schedules_bench_{network}", payload)
        print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps per block (a multiple of 5 and 4 is fair)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="2 blocks of 5 steps, width 32")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--rate", help="run the ranks on emulated hosts joined by links of this rate (e.g. 1gbit)")
    args = p.parse_args()
    if args.quick:
        args.blocks, args.steps, args.width = 2, 5, 32
    if args.rate and not under_launcher():
        from benchmarks.netemu import EmulatedCluster
        with EmulatedCluster(n=args.np, rate=args.rate) as cl:
            res = cl.run_mpi([sys.executable, str(Path(__file__).resolve())] + sys.argv[1:],
                             env={"HVD_BENCH_NETWORK": cl.network, "OMP_NUM_THREADS": "1"}, timeout=3600)
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr[-4000:])
        sys.exit(res.returncode)
    relaunch_under_mpirun(args.np, [str(Path(__file__).resolve())] + sys.argv[1:])
    rank_main(args)


if __name__ == "__main__":
    main()
