"""Our synchronous path against PyTorch DDP (Gloo), same model, same data, same ranks, one run.

    python benchmarks/ddp_compare.py            # re-launches itself on 2 local ranks
    python benchmarks/ddp_compare.py --quick    # fewer steps

Variants, interleaved block by block so machine noise hits all of them alike:
  compute       no communication at all (the lower bound)
  ddp           torch DistributedDataParallel over Gloo, its defaults (1 MiB first bucket, then 25 MiB)
  ddp-nofirst   the same with bucket_cap_mb=25 (torch then makes no first bucket)
  ours          DistributedOptimizer on Gloo on our own group, MPI as control plane (the default
                across hosts; on one host the default is MPI, i.e. ours-mpi), default fusion
  ours-nofirst  the same without DDP's 1 MiB first bucket (fusion_options first_bucket_bytes=0)
  ours-mpi      the same engine over the MPI backend (host buffers)
  ours-fp16     ours with Compression.fp16 (fp16 on Gloo's native collective)
  ours-mpi-fp16 fp16 over MPI (the half-precision ring of comm/mpi.py)
Prints median step time and the ratio to DDP (goal: ours >= 0.97x DDP's throughput, i.e. step
<= 1.03x) per model; writes JSON.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_info, relaunch_under_mpirun, table, time_blocks, train_step, write_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--blocks", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--steps", type=int, default=3, help="timed steps per block")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default="resnet18,deep_mlp")
    p.add_argument("--variants", default="compute,ddp,ddp-nofirst,ours,ours-nofirst,ours-mpi,ours-fp16,ours-mpi-fp16")
    args = p.parse_args()
    if args.quick:
        args.blocks, args.steps = 2, 2
    relaunch_under_mpirun(args.ranks, sys.argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_plugin as hco
    from benchmarks.models import deep_mlp, resnet18
    from hvd_commopt import runtime
    from hvd_commopt.comm import Communicator
    from hvd_commopt.comm.mpi import MPIBackend

    hco.init(backend="gloo")  # Gloo for CPU tensors, MPI as control plane (the multi-host default)
    torch.set_num_threads(1)
    wanted = args.variants.split(",")
    mpi = Communicator(MPIBackend(), timeout_s=300) if any("mpi" in v for v in wanted) else None
    rank, size = hco.rank(), hco.size()
    builders = {"resnet18": (resnet18, lambda: torch.randn(8, 3, 32, 32), 10),
                "deep_mlp": (deep_mlp, lambda: torch.randn(32, 64), 10)}
    results = {}
    for model_name in args.models.split(","):
        build, make_x, classes = builders[model_name]
        torch.manual_seed(0)
        base = build()
        x, y = make_x(), torch.randint(0, classes, (make_x().shape[0],))
        variants = {}

        def plain(model):
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            return model, opt

        ours = {"ours": {}, "ours-nofirst": {"fusion_options": {"first_bucket_bytes": 0}},
                "ours-mpi": {"communicator": mpi}, "ours-fp16": {"compression": hco.Compression.fp16},
                "ours-mpi-fp16": {"communicator": mpi, "compression": hco.Compression.fp16}}
        for name in wanted:
            if name == "compute":
                variants[name] = plain(copy.deepcopy(base))
            elif name in ("ddp", "ddp-nofirst"):
                # an explicit bucket_cap_mb turns DDP's 1 MiB first bucket off (torch makes it only
                # when bucket_cap_mb is None): "ddp" is DDP(model), "ddp-nofirst" the explicit cap
                ddp_model = DDP(copy.deepcopy(base), bucket_cap_mb=None if name == "ddp" else 25)
                variants[name] = (ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9))
            else:
                m = copy.deepcopy(base)
                opt = hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                               named_parameters=m.named_parameters(), **ours[name])
                variants[name] = (m, opt)

        steps = {k: train_step(*v, x, y) for k, v in variants.items()}
        samples = time_blocks(steps, args.blocks, args.steps, barrier=runtime.communicator().barrier)
        # Per block: the median step. Across blocks: the median (typical) and the minimum (the
        # least disturbed block: on a shared machine other jobs only ever add time). Each rank's
        # figure differs slightly: report the slowest rank (the job's pace).
        comm = runtime.communicator()
        med = {k: max(comm.allgather_object(sorted(v)[len(v) // 2])) for k, v in samples.items()}
        best = {k: max(comm.allgather_object(min(v))) for k, v in samples.items()}
        # Overlap: seconds the progress thread spent in collectives vs seconds synchronize() blocked.
        overlap = {}
        for k in [v for v in variants if v.startswith("ours")]:
            st = variants[k][1].comm_stats
            overlap[k] = {"comm_s": st["comm_seconds"], "wait_s": st["wait_seconds"],
                          "hidden_fraction": max(0.0, 1 - st["wait_seconds"] / st["comm_seconds"]) if st["comm_seconds"] else 0.0,
                          "buckets": len(st["per_bucket"]), "bytes_sent": st["bytes_sent"]}
        nparams = sum(p.numel() for p in base.parameters())
        results[model_name] = {"params": nparams, "median_step_s": med, "best_block_step_s": best,
                               "overlap_last_step": overlap,
                               "ratio_vs_ddp": {k: v / med["ddp"] for k, v in med.items()},
                               "best_block_ratio_vs_ddp": {k: v / best["ddp"] for k, v in best.items()},
                               "comm_to_compute_ddp": med["ddp"] / med["compute"]}
        if rank == 0:
            print(f"\n{model_name}: {nparams / 1e6:.2f}M params, {size} ranks, median of {args.blocks} blocks x {args.steps} steps")
            print(table(["variant", "median step (ms)", "vs DDP", "vs compute-only", "best block (ms)", "best vs DDP"],
                        [[k, med[k] * 1e3, med[k] / med["ddp"], med[k] / med["compute"], best[k] * 1e3,
                          best[k] / best["ddp"]] for k in med]), flush=True)
            for k, o in overlap.items():
                print(f"{k}: last step {o['buckets']} buckets, {o['bytes_sent'] / 1e6:.1f} MB sent, collectives "
                      f"{o['comm_s'] * 1e3:.1f} ms, synchronize waited {o['wait_s'] * 1e3:.1f} ms "
                      f"({o['hidden_fraction']:.0%} of communication hidden behind backward)", flush=True)
    if rank == 0:
        path = write_json("ddp_compare", {"ranks": size, "blocks": args.blocks, "steps": args.steps,
                                          "network": "loopback (Gloo: TCP over lo; MPI: shared memory)", "machine": machine_info(),
                                          "results": results})
        print(f"\nwrote {path}")
    dist.barrier()


if __name__ == "__main__":
    main()
