"""One rank of a time-to-accuracy job: the digits CNN trained by every variant, epochs interleaved.

    (started by benchmarks/run.py) python -m benchmarks.suite.tta --variants ddp,ssgd --epochs 10 --out r.json

Real data (scikit-learn's digits, shipped with the package) and the small CNN of
examples/pytorch_digits.py, sharded over the ranks exactly as that example does, with the same
learning-rate rule (0.05 x ranks, momentum 0.9). Every variant starts from the same weights and
sees the same batches in the same order.

Why epochs are interleaved across variants (epoch 1 of every variant, then epoch 2 of every
variant, ...): noise from the shared machine then hits all variants alike, as in the throughput
job. Only training counts as wall time: each epoch's time ends after the variant's in-flight
rounds are drained (they belong to it), and evaluation (on the global weights for delayed
schedules; rank 0's local model for model averaging between syncs) is not timed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import variants as V
from .rankenv import setup

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pytorch_digits.py"


def _digits_module():
    spec = importlib.util.spec_from_file_location("hvd_commopt_example_digits", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(args: argparse.Namespace) -> dict:
    env = setup(args.progress)
    digits = _digits_module()
    torch.manual_seed(args.seed)
    x_tr, x_te, y_tr, y_te = digits.load(args.seed)
    x_tr, y_tr = torch.from_numpy(x_tr[env.rank::env.size]), torch.from_numpy(y_tr[env.rank::env.size])
    x_te_t = torch.from_numpy(x_te)
    steps = min(env.gather(len(x_tr) // args.batch_size))  # identical on every rank
    base = digits.DigitsCNN()
    ctx = V.Ctx(mode="tta", rank=env.rank, size=env.size, lr=args.lr * env.size, momentum=0.9,
                density=args.density, period=args.period, warmup_steps=args.schedule_warmup,
                steps_per_epoch=steps, powersgd_start=args.schedule_warmup, batch_size=args.batch_size,
                ddp_group=env.ddp_group, new_ddp_group=env.new_gloo_group,
                gloo_comm=env.gloo_comm, backend_comm=env.backend_comm,
                fresh_comm=env.fresh_comm if env.backend == "gloo" else None)
    runners, status = V.build_for_tta(args.variants, base, ctx, env.barrier)
    env.progress(phase="built", model="digits", total=len(runners) * args.epochs)

    curves: dict[str, list[dict[str, float]]] = {k: [] for k in runners}
    wall = {k: 0.0 for k in runners}
    gens = {k: torch.Generator().manual_seed(args.seed + env.rank) for k in runners}
    failed: dict[str, str] = {}
    for epoch in range(args.epochs):
        for name, r in list(runners.items()):
            perm = torch.randperm(len(x_tr), generator=gens[name])
            r.module.train()
            env.barrier()
            t0 = time.perf_counter()
            try:
                total = 0.0
                for i in range(steps):
                    idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
                    r.opt.zero_grad()
                    loss = F.cross_entropy(r.module(x_tr[idx]), y_tr[idx])
                    loss.backward()
                    r.opt.step()
                    total += float(loss)
                r.drain()
            except Exception as e:  # noqa: BLE001 - symmetric failures are reported, not fatal
                failed[name] = f"error: {type(e).__name__}: {e}"
                runners.pop(name)
                continue
            wall[name] += env.max_over_ranks(time.perf_counter() - t0)
            acc = _accuracy(r, x_te_t, y_te)
            curves[name].append({"epoch": epoch + 1, "wall_s": wall[name], "test_acc": acc,
                                 "train_loss": total / steps})
            env.progress(phase="epoch", epoch=epoch, variant=name, advance=1)
    finals: dict[str, float] = {}
    for name, r in runners.items():
        r.finalize()  # leaves the global model (replica / average of the workers' models)
        finals[name] = _accuracy(r, x_te_t, y_te, finalized=True)
    status.update(failed)
    out: dict[str, Any] = {}
    for name in runners:
        c = curves[name]
        hit = next((p for p in c if p["test_acc"] >= args.target), None)
        out[name] = {"curve": c, "final_acc": finals[name], "final_acc_before_finalize": c[-1]["test_acc"],
                     "time_to_target_s": hit["wall_s"] if hit else None,
                     "epochs_to_target": hit["epoch"] if hit else None, "train_wall_s": wall[name],
                     "epoch_s": wall[name] / len(c)}
    return {"mode": "tta", "model": "digits_cnn", "params": sum(p.numel() for p in base.parameters()),
            "ranks": env.size, "epochs": args.epochs, "steps_per_epoch": steps, "batch_per_rank": args.batch_size,
            "lr": ctx.lr, "target": args.target, "density": args.density, "period": args.period,
            "schedule_warmup_steps": args.schedule_warmup, "backend": env.backend, "mpi_library": env.mpi_library,
            "status": status, "results": out}


def _accuracy(r: V.Runner, x: torch.Tensor, y: np.ndarray, finalized: bool = False) -> float:
    r.module.eval()
    with torch.no_grad():
        if finalized:
            pred = r.params(x).argmax(1).numpy()
        else:
            with r.eval_weights():
                pred = r.params(x).argmax(1).numpy()
    return float((pred == y).mean())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one rank of a benchmarks.run time-to-accuracy job")
    ap.add_argument("--variants", required=True)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the number of ranks")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--period", type=int, default=4)
    ap.add_argument("--schedule-warmup", type=int, default=50,
                    help="sync steps before delayed schedules switch (50: tests/parallel/mpi_digits.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", default=None)
    args = ap.parse_args(argv)
    result = run(args)
    import torch_plugin as hco
    if hco.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    hco.shutdown()


if __name__ == "__main__":
    main()
