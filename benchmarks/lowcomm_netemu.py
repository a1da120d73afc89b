"""Step times of S-SGD (DDP's allreduce) and DiLoCo on an emulated link (benchmarks/netemu.py:
one network namespace per rank, tc-shaped veth links, Open MPI or MPICH between them), for the
time-to-loss comparison of docs/diloco.md#measured.

    python -m benchmarks.lowcomm_netemu --net 100mbit --steps 100 --out benchmarks/results/lowcomm/netemu

Each variant trains benchmarks/lowcomm_bench.py's GPT (same shape, batch and inner AdamW) for
``--steps`` steps on 2 emulated hosts; rank 0 reports the mean wall time per training step (the
first ``--skip`` steps left out) and the bytes its link sent. A run this short measures the
step's cost on the link, not the loss: the time to a loss is the loss curve's step count (from
lowcomm_bench, in-process ranks, the same model and data) times the step time measured here
(:func:`time_to_loss`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VARIANTS = ("ddp", "diloco_h50")


def worker(args: argparse.Namespace) -> None:
    import torch

    import torch_plugin as hco
    from benchmarks.gpt_model import GPT, GPTShape, lm_loss
    from benchmarks.suite.rankenv import link_counter
    from benchmarks.text_corpus import batches, load_text_corpus
    from hvd_commopt import Schedule
    torch.set_num_threads(1)
    comm = hco.init()
    shape = GPTShape(layers=args.layers, heads=4, width=args.width, context=args.context, vocab=256)
    torch.manual_seed(0)
    model = GPT(shape)
    inner = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = Schedule.sync() if args.variant == "ddp" else Schedule.diloco(int(args.variant.split("_h")[1]))
    opt = hco.DistributedOptimizer(inner, named_parameters=model.named_parameters(), schedule=schedule)
    it = batches(load_text_corpus(shape.context, "train"), args.batch, shape.context,
                 torch.Generator().manual_seed(1000 + comm.rank))
    _, tx = link_counter()
    times, b0 = [], 0
    for step in range(args.steps):
        if step == args.skip:
            comm.barrier()
            b0 = int(tx.read_text()) if tx else 0
        x, y = next(it)
        t0 = time.perf_counter()
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    sent = (int(tx.read_text()) if tx else 0) - b0
    timed = times[args.skip:]
    stats = comm.allgather_object({"step_s": sum(timed) / len(timed), "link_bytes": sent})
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"variant": args.variant, "steps": len(timed), "ranks": stats}))


def time_to_loss(curve: list[dict], target: float, step_s: float) -> float | None:
    """Seconds to the first evaluation at or below ``target``: its step count times the measured
    time per step (None when the curve never gets there)."""
    hit = next((p for p in curve if p["val_loss"] <= target), None)
    return None if hit is None else hit["step"] * step_s


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="ddp")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--net", default="100mbit")
    ap.add_argument("--steps", type=int, default=110)
    ap.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the mean")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--curves", default=None, help="a lowcomm_bench JSON: time to its ddp's final loss per variant")
    ap.add_argument("--out", default="benchmarks/results/lowcomm/netemu")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    from benchmarks.netemu import EmulatedCluster
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parent.parent)
    results = {}
    with EmulatedCluster(n=2, rate=args.net) as cl:
        env = {"PYTHONPATH": root, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HVD_COMMOPT_BACKEND": "mpi"}
        for v in args.variants.split(","):
            path = out / f"{v}.json"
            path.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "benchmarks.lowcomm_netemu", "--worker", "--variant", v, "--out", str(path)]
            cmd += [f"--{k}={getattr(args, k)}" for k in ("steps", "skip", "layers", "width", "context", "batch")]
            res = cl.run_mpi(cmd, env=env, timeout=args.timeout)
            if not path.exists():
                raise SystemExit(f"{v}: no result on {cl.network}:\n{(res.stdout + res.stderr)[-3000:]}")
            results[v] = json.loads(path.read_text())
            results[v]["network"] = cl.network
            step_s = max(r["step_s"] for r in results[v]["ranks"])
            print(f"NETEMU {v} on {cl.network}: {step_s * 1e3:.1f} ms/step, link bytes/step "
                  f"{results[v]['ranks'][0]['link_bytes'] / results[v]['steps']:.0f}", flush=True)
    summary = {"net": args.net, "results": results}
    if args.curves:
        curves = json.loads(Path(args.curves).read_text())["results"]
        target = curves["ddp"]["curve"][-1]["val_loss"]
        summary["target"] = target
        for v, r in results.items():
            step_s = max(x["step_s"] for x in r["ranks"])
            name = v if v in curves else next((n for n in curves if n.startswith(v)), None)
            r["time_to_ddp_loss_s"] = None if name is None else time_to_loss(curves[name]["curve"], target, step_s)
            print(f"NETEMU {v}: time to ddp's final loss {r['time_to_ddp_loss_s']}")
    (out / "netemu_summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
