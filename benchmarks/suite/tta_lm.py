"""One rank of the transformer's time-to-accuracy job: every variant trains the GPT-style decoder on
byte-level stdlib text to a validation-loss target, training intervals interleaved.

    (started by benchmarks/run.py) python -m benchmarks.suite.tta_lm --variants ddp,ssgd --steps 200 --out r.json

The model is benchmarks/gpt_model.py's GPT (``--shape``: GPT_CPU on CPU ranks, GPT-2 small on a
GPU; benchmarks/suite/workloads.py), the data benchmarks/text_corpus.py's train split; each rank
draws its own random windows (a generator seeded with seed and rank, the same for every
variant), so a step trains on ``ranks x batch`` windows. The validation loss is the mean
next-token loss over ``--eval-windows`` fixed windows of the held-out split (whole files no
training window comes from), on the global weights for delayed schedules.

As in the digits job (benchmarks/suite/tta.py): every variant starts from the same weights; the
steps are cut into ``--eval-every`` intervals, interval i of every variant runs before interval
i + 1 of any, so the shared machine's noise hits all alike; only training counts as wall time
(each interval ends after draining rounds in flight), evaluation does not. The learning rate
warms up linearly over ``--lr-warmup`` steps, then stays constant (the same for every variant).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
from typing import Any

import torch

from benchmarks.gpt_model import GPT, lm_loss
from benchmarks.text_corpus import batches, eval_windows, load_text_corpus

from . import variants as V
from .rankenv import setup
from .workloads import TRANSFORMER_SHAPES, rank_device, transformer_shape

__all__ = ["run", "main", "val_loss"]


def val_loss(r: V.Runner, x: torch.Tensor, y: torch.Tensor, batch: int, finalized: bool = False) -> float:
    """Mean next-token loss of ``r``'s evaluation weights over the windows (x, y)."""
    r.params.eval()
    total = 0.0
    with torch.no_grad():
        with r.eval_weights() if not finalized else contextlib.nullcontext():
            for i in range(0, x.shape[0], batch):
                total += float(lm_loss(r.params(x[i:i + batch]), y[i:i + batch])) * x[i:i + batch].shape[0]
    r.params.train()
    return total / x.shape[0]


def run(args: argparse.Namespace) -> dict:
    env = setup(args.progress)
    device = rank_device(args.device, env.rank)
    shape = transformer_shape(args.shape, device, args.quick)
    train = load_text_corpus(shape.context, "train")
    vx, vy = (t.to(device) for t in eval_windows(load_text_corpus(shape.context, "val"), shape.context,
                                                 args.eval_windows))
    torch.manual_seed(args.seed)
    base = GPT(shape).to(device)
    intervals = math.ceil(args.steps / args.eval_every)
    ctx = V.Ctx(mode="tta", rank=env.rank, size=env.size, lr=args.lr, momentum=0.9, optimizer=args.optimizer,
                density=args.density, period=args.period, warmup_steps=args.schedule_warmup,
                steps_per_epoch=args.eval_every, powersgd_start=args.schedule_warmup, batch_size=args.batch_size,
                ddp_group=env.ddp_group, new_ddp_group=env.new_gloo_group,
                gloo_comm=env.gloo_comm, backend_comm=env.backend_comm,
                fresh_comm=env.fresh_comm if env.backend == "gloo" else None)
    runners, status = V.build_for_tta(args.variants, base, ctx, env.barrier)
    env.progress(phase="built", model="transformer", total=len(runners) * intervals)
    warm = max(1, args.lr_warmup)
    scheds = {k: torch.optim.lr_scheduler.LambdaLR(r.opt, lambda s: min(1.0, (s + 1) / warm))
              for k, r in runners.items()}
    data = {k: batches(train, args.batch_size, shape.context, torch.Generator().manual_seed(1000 * args.seed + env.rank))
            for k in runners}
    v0 = val_loss(next(iter(runners.values())), vx, vy, args.batch_size) if runners else None
    curves: dict[str, list[dict[str, float]]] = {k: [{"step": 0, "wall_s": 0.0, "val_loss": v0}] for k in runners}
    wall = {k: 0.0 for k in runners}
    failed: dict[str, str] = {}
    phases: dict[str, list[dict[str, Any]]] = {k: [] for k in runners}
    done = 0
    for interval in range(intervals):
        n = min(args.eval_every, args.steps - done)
        for name, r in list(runners.items()):
            env.barrier()
            t0 = time.perf_counter()
            try:
                total = 0.0
                for _ in range(n):
                    x, y = next(data[name])
                    r.opt.zero_grad()
                    loss = lm_loss(r.module(x.to(device)), y.to(device))
                    loss.backward()
                    r.opt.step()
                    scheds[name].step()
                    total += loss.item()
                r.drain()
            except Exception as e:  # noqa: BLE001 - symmetric failures are reported, not fatal
                failed[name] = f"error: {type(e).__name__}: {e}"
                runners.pop(name)
                continue
            wall[name] += env.max_over_ranks(time.perf_counter() - t0)
            rep = r.opt.compression_report if r.ours else None
            if rep is not None:  # the policy's phase and methods after each interval
                phases[name].append({"step": done + n, "phase": rep.get("phase"), "decisions": rep.get("decisions"),
                                     "methods": [b["method"] for b in rep.get("buckets", ())]})
            curves[name].append({"step": done + n, "wall_s": wall[name], "val_loss": val_loss(r, vx, vy, args.batch_size),
                                 "train_loss": total / n})
            env.progress(phase="interval", interval=interval, variant=name, advance=1)
        done += n
    finals: dict[str, float] = {}
    reports: dict[str, Any] = {}
    for name, r in runners.items():
        rep = r.opt.compression_report if r.ours else None
        if rep is not None:
            reports[name] = json.loads(json.dumps(rep, default=str))
        r.finalize()
        finals[name] = val_loss(r, vx, vy, args.batch_size, finalized=True)
    status.update(failed)
    out: dict[str, Any] = {}
    for name in runners:
        c = curves[name]
        hit = next((p for p in c[1:] if p["val_loss"] <= args.target), None)
        out[name] = {"curve": c, "final_val_loss": finals[name], "final_val_loss_before_finalize": c[-1]["val_loss"],
                     "time_to_target_s": hit["wall_s"] if hit else None,
                     "steps_to_target": hit["step"] if hit else None, "train_wall_s": wall[name],
                     "step_s": wall[name] / max(1, c[-1]["step"])}
        auto = reports.get(name)
        if auto:  # what compression="auto" chose per bucket, predicted and measured, and when it decided
            out[name]["compression_report"] = auto
            out[name]["compression_phases"] = phases[name]
    return {"mode": "tta", "task": "lm", "model": "transformer", "shape": dataclasses.asdict(shape),
            "params": sum(p.numel() for p in base.parameters()), "device": str(device),
            "ranks": env.size, "steps": args.steps, "eval_every": args.eval_every, "batch_per_rank": args.batch_size,
            "context": shape.context, "optimizer": args.optimizer, "lr": args.lr, "lr_warmup_steps": args.lr_warmup,
            "target": args.target, "eval_windows": int(vx.shape[0]), "initial_val_loss": v0,
            "density": args.density, "period": args.period, "schedule_warmup_steps": args.schedule_warmup,
            "backend": env.backend, "mpi_library": env.mpi_library, "status": status, "results": out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one rank of a benchmarks.run transformer time-to-accuracy job")
    ap.add_argument("--variants", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25, help="training steps per interval (one evaluation each)")
    ap.add_argument("--target", type=float, default=2.5, help="validation loss (nats per byte)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per rank per step")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--lr", type=float, default=None, help="default 1e-3 for AdamW, 0.1 for SGD (momentum 0.9)")
    ap.add_argument("--lr-warmup", type=int, default=20, help="linear learning-rate warm-up steps")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--period", type=int, default=4)
    ap.add_argument("--schedule-warmup", type=int, default=20, help="sync steps before delayed schedules switch")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--shape", default="auto", choices=TRANSFORMER_SHAPES)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", default=None)
    args = ap.parse_args(argv)
    if args.lr is None:
        args.lr = 1e-3 if args.optimizer == "adamw" else 0.1
    result = run(args)
    import torch_plugin as hco
    if hco.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    hco.shutdown()


if __name__ == "__main__":
    main()
