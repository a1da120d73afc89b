"""Sparsified / compressed allreduce: bytes per step and iteration time, plus top-k throughput.

    python benchmarks/sparse_bench.py            # top-k throughput here, then 2 and 4 ranks under mpirun
    python benchmarks/sparse_bench.py --quick    # fewer steps
    python benchmarks/sparse_bench.py --ranks 2 --density 0.01

Model: a ResNet-18-shaped CNN (BasicBlocks 2-2-2-2, widths 32-64-128-256, 2.8M parameters,
62 tensors) on 16x16 synthetic images, batch 8 per rank, SGD; one torch thread per rank.

Variants (interleaved block by block, so machine noise hits all of them alike):
  compute     no communication (the lower bound)
  dense       DistributedOptimizer, fp32 allreduce, default fusion (one bucket)
  fp16        Compression.fp16
  topk        Compression.topk(density): global top-k (one bucket), allgather, error feedback
  gtopk       Compression.gtopk(density): global top-k, recursive doubling
  dgc         Compression.dgc(density): sampled threshold, momentum correction (with the SGD momentum 0.9)
  topk-lags / gtopk-lags   the same with fusion_threshold=0 (one bucket per layer, LAGS-SGD)

Reported per variant: median step time (rank 0; max over ranks too), bytes this rank sent per
step (from optimizer.comm_stats; max over ranks) and the formula's prediction (docs/cost-models.md#closed-form-costs).

Top-k throughput (measured once, in this process, one thread, same run): GB/s of
``TorchOps.topk_abs`` (the exact, deterministic top-k the reducers use), raw ``torch.topk``,
DGC's sampled-threshold selection and a plain copy of the same tensor (the model's gradient
size), i.e. input bytes / seconds.

Writes benchmarks/results/sparse_bench.json and prints a table.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info, table, under_launcher, write_json  # noqa: E402

VARIANTS = ["compute", "dense", "fp16", "topk", "gtopk", "dgc", "topk-lags", "gtopk-lags"]


def build_model():
    """ResNet-18's layout at width 32 (2.8M parameters, 62 tensors): benchmarks/models.py's model."""
    from benchmarks.models import resnet18
    return resnet18(width=32)


# -- top-k throughput (parent process) -------------------------------------------------------------
def selection_throughput(n: int, densities: list[float], reps: int) -> list[dict]:
    import torch

    from hvd_commopt.compress import DGCSelector
    from torch_plugin.ops import TorchOps

    torch.set_num_threads(1)
    ops = TorchOps()
    t = torch.randn(n)
    nbytes = t.numel() * t.element_size()

    def med(fn):
        fn()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rows = [{"op": "copy (t.clone())", "density": None, "seconds": med(lambda: t.clone())}]
    for d in densities:
        k = max(int(n * d), 1)
        rows.append({"op": "TorchOps.topk_abs (exact, ties to lower index)", "density": d,
                     "seconds": med(lambda: ops.topk_abs(t, k))})
        rows.append({"op": "torch.topk(|t|) raw", "density": d,
                     "seconds": med(lambda: torch.topk(t.abs(), k, sorted=False))})
        dgc = DGCSelector(d)
        rows.append({"op": "DGC sampled threshold", "density": d,
                     "seconds": med(lambda: dgc.select(ops, t, None, 0))})
    copy_s = rows[0]["seconds"]
    for r in rows:
        r["GB/s"] = nbytes / r["seconds"] / 1e9
        r["vs copy"] = copy_s / r["seconds"]
        r["elements"] = n
    return rows


# -- one rank of the distributed part ------------------------------------------------------------
def rank_main(args) -> None:
    import torch
    import torch.nn.functional as F

    import torch_plugin as hco
    from hvd_commopt import Compression
    from hvd_commopt import runtime

    comm = hco.init()
    torch.set_num_threads(1)
    rank, size = hco.rank(), hco.size()
    torch.manual_seed(0)
    base = build_model()
    n = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    d = args.density
    make = {
        "dense": (None, 0.9, None), "fp16": (Compression.fp16, 0.9, None),
        "topk": (lambda: Compression.topk(d), 0.9, None), "gtopk": (lambda: Compression.gtopk(d), 0.9, None),
        "dgc": (lambda: Compression.dgc(d), 0.9, None),  # DGC takes the optimizer's momentum
        "topk-lags": (lambda: Compression.topk(d), 0.9, 0), "gtopk-lags": (lambda: Compression.gtopk(d), 0.9, 0),
    }
    variants = {}
    for name in args.variants:
        m = copy.deepcopy(base)
        if name == "compute":
            variants[name] = (m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
            continue
        comp, mom, thr = make[name]
        opt = hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=mom),
                                       named_parameters=m.named_parameters(),
                                       compression=comp() if callable(comp) else comp, fusion_threshold=thr)
        variants[name] = (m, opt)
    times = {v: [] for v in variants}
    sent = {v: 0 for v in variants}
    buckets = {v: 0 for v in variants}

    def step(m, opt):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()

    for block in range(args.blocks):
        for name, (m, opt) in variants.items():
            if block == 0:
                step(m, opt)  # warm-up (allocation, first residuals)
            comm.barrier()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(m, opt)
                times[name].append(time.perf_counter() - t0)
            if name != "compute":
                st = opt.comm_stats
                sent[name], buckets[name] = st["bytes_sent"], len(st["per_bucket"])
    mine = {v: {"median_s": statistics.median(times[v]), "bytes_sent": sent[v], "buckets": buckets[v]} for v in variants}
    everyone = comm.allgather_object(mine)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"size": size, "params": n, "ranks": everyone}))
    runtime.shutdown()


def predicted_bytes(variant: str, P: int, n: int, d: float) -> float | None:
    k = max(int(n * d), 1)
    ring = 2 * (P - 1) / P
    if variant == "dense":
        return ring * n * 4
    if variant == "fp16":
        return ring * n * 2
    if variant == "topk":
        return (P - 1) * k * 8
    if variant == "gtopk":
        return math.ceil(math.log2(P)) * k * 8  # P a power of two here
    if variant == "dgc":
        return (P - 1) * math.ceil(n * d) * 8   # upper bound (DGC sends <= k)
    return None  # per-layer k: sum of max(int(n_l·d), 1)


def launch(np_: int, args, out: str) -> None:
    from hvd_commopt import run
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", out, "--density", str(args.density),
            "--blocks", str(args.blocks), "--steps", str(args.steps), "--batch", str(args.batch),
            "--image", str(args.image), "--variants", ",".join(args.variants)]
    cmd, env = run.build_command(run._parser().parse_args(["-np", str(np_)] + argv))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if "PYTHONPATH" not in cmd:
        cmd[1:1] = ["-x", "PYTHONPATH"]
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=1800)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image", type=int, default=16)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.variants = args.variants.split(",")
    if args.quick:
        args.blocks, args.steps = 2, 2
    if args.child or under_launcher():
        rank_main(args)
        return

    n = sum(p.numel() for p in build_model().parameters())
    sel = selection_throughput(n, [0.001, 0.01], reps=7)
    print(f"Top-k selection throughput on {n} float32 elements ({n * 4 / 1e6:.1f} MB), 1 thread:")
    print(table(["op", "density", "ms", "GB/s", "x copy speed"],
                [[r["op"], r["density"] if r["density"] is not None else "-", r["seconds"] * 1e3, r["GB/s"],
                  r["vs copy"]] for r in sel]))
    runs = {}
    for np_ in [int(v) for v in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "out.json")
            launch(np_, args, out)
            runs[np_] = json.loads(Path(out).read_text())
    rows = []
    for np_, res in runs.items():
        n = res["params"]
        r0 = res["ranks"][0]
        base_t = r0.get("dense", {}).get("median_s")
        for v in args.variants:
            t0 = r0[v]["median_s"]
            tmax = max(r[v]["median_s"] for r in res["ranks"])
            b = max(r[v]["bytes_sent"] for r in res["ranks"])
            pred = predicted_bytes(v, np_, n, args.density)
            rows.append([np_, v, t0 * 1e3, tmax * 1e3, (base_t / t0) if base_t else "-", b / 1e3,
                         (pred / 1e3) if pred is not None else "-", r0[v]["buckets"]])
    print(f"\nSmallResNet ({runs[next(iter(runs))]['params']} params), batch {args.batch} of "
          f"{args.image}x{args.image}, density {args.density}; {args.blocks}x{args.steps} timed steps:")
    print(table(["ranks", "variant", "step ms (r0)", "step ms (max)", "speed vs dense", "KB sent/step",
                 "KB formula", "buckets"], rows))
    path = write_json("sparse_bench", {
        "machine": machine_info(), "density": args.density, "batch": args.batch, "image": args.image,
        "blocks": args.blocks, "steps": args.steps, "selection": sel,
        "runs": {str(k): v for k, v in runs.items()},
        "table": [dict(zip(["ranks", "variant", "step_ms_r0", "step_ms_max", "speed_vs_dense", "kb_sent",
                            "kb_formula", "buckets"], r)) for r in rows]})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
