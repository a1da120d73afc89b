"""Low-communication training on the transformer workload: validation loss against tokens and
against (modelled) time, and bytes per step per rank, for S-SGD (DDP's allreduce), S-SGD with
bf16 (DDP's bf16 hook's bytes), DiLoCo at several H, Streaming DiLoCo, DiLoCo with top-k +
low-bit pseudo-gradients, local SGD and CoCoD-SGD (docs/diloco.md#diloco).

    python -m benchmarks.lowcomm_bench --ranks 2 --steps 600 --out benchmarks/results/lowcomm

Every variant trains the same GPT (byte-level, Python stdlib text, benchmarks/text_corpus.py) on
P in-process ranks (threads, one torch thread each) from the same initial weights and the same
per-rank batches; rank 0 evaluates its model on fixed validation windows every ``--eval-every``
steps (a multiple of every period, so DiLoCo and local SGD are evaluated right after a sync).
Bytes are the communicator's own count (what this rank sent). Time on a link is *modelled*:
the measured compute time plus ``bytes * 8 / bandwidth + collectives * latency`` per rank (no
overlap credited, so Streaming DiLoCo's and CoCoD's hiding is not counted); the step times on an
emulated link come from benchmarks/lowcomm_netemu.py (``--netemu``: its summary, plotted as steps
x measured step time). Ratios are against S-SGD in the same run.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import torch

from benchmarks.gpt_model import GPT, GPTShape, lm_loss
from benchmarks.text_corpus import batches, eval_windows, load_text_corpus
from hvd_commopt import Compression, Schedule, run_ranks
import torch_plugin as hco

LINKS = {"1Gbit": (1e9, 50e-6), "100Mbit": (1e8, 200e-6)}  # bandwidth bit/s, latency s per collective


def variants(h_small: int, h_mid: int, h_big: int) -> dict:
    return {
        "ddp": (Schedule.sync, lambda: None),
        "ddp_bf16": (Schedule.sync, lambda: Compression.bf16),
        f"diloco_h{h_small}": (lambda: Schedule.diloco(h_small), lambda: None),
        f"diloco_h{h_mid}": (lambda: Schedule.diloco(h_mid), lambda: None),
        f"diloco_h{h_big}": (lambda: Schedule.diloco(h_big), lambda: None),
        f"streaming_h{h_mid}_f5": (lambda: Schedule.diloco(h_mid, fragments=5, overlap=h_mid // 10), lambda: None),
        f"diloco_h{h_mid}_topk1_int4": (lambda: Schedule.diloco(h_mid), lambda: Compression.quantize(4, density=0.01)),
        # the outer step w - Delta (plain averaging every H steps: local SGD at period H)
        f"diloco_h{h_mid}_plain_outer": (lambda: Schedule.diloco(h_mid, outer_lr=1.0, outer_momentum=0.0),
                                         lambda: None),
        # SparseLoCo's setting: top-k 1 % per 4096-chunk + 2-bit with decayed error feedback, outer
        # SGD without momentum (lr 2.5 measured best at H=10, docs/quantize.md#measured)
        f"sparseloco_h{h_mid}": (lambda: Schedule.diloco(h_mid, outer_lr=1.0, outer_momentum=0.0),
                                 lambda: Compression.quantize(2, density=0.01, chunk=4096, ef_decay=0.95)),
        # SparseLoCo as its code runs it: H=10, each value averaged over the ranks that sent it
        # (mean_over="senders"), outer SGD lr 1 (docs/quantize.md#measured-senders)
        "sparseloco_h10_senders": (lambda: Schedule.diloco(10, outer_lr=1.0, outer_momentum=0.0),
                                   lambda: Compression.quantize(2, density=0.01, chunk=4096, ef_decay=0.95,
                                                                mean_over="senders")),
        f"diloco_h{h_mid}_int4": (lambda: Schedule.diloco(h_mid), lambda: Compression.quantize(4)),
        "local_sgd_4": (lambda: Schedule.local_sgd(4), lambda: None),
        "cocod_4": (lambda: Schedule.cocod(4), lambda: None),
    }


_RECIPE = re.compile(r"diloco_h(\d+)(?:_olr([\d.]+))?(?:_om([\d.]+))?"
                     r"(?:(?:_topk([\d.]+))?_int(\d)(?:_c(\d+))?(?:_ef([\d.]+))?(?:_b(\d+))?(_snd)?)?$")


def parse_variant(name: str):
    """A variant outside the table, for sweeps of the outer step and of SparseLoCo's settings:
    ``diloco_h{H}[_olr{lr}][_om{mu}][[_topk{percent}]_int{bits}[_c{chunk}][_ef{decay}][_b{block}][_snd]]``
    (Nesterov outer step with lr and momentum; top-k at percent % with bits-bit values and error
    feedback, chosen per chunk of ``chunk`` elements, the error feedback decayed by ``decay``,
    one scale per ``block`` values, ``_snd``: each value averaged over the ranks that sent it;
    ``_int{bits}`` without ``_topk``: every value of the pseudo-gradient quantised to bits bits,
    the dense quantised reduce-scatter then all-gather, ``Compression.quantize(bits)``)."""
    m = _RECIPE.match(name)
    if m is None:
        raise SystemExit(f"unknown variant {name!r}")
    h, lr, mu, pct, bits, chunk, decay, block, snd = m.groups()
    kw = {"outer_lr": float(lr or 0.7), "outer_momentum": float(mu or 0.9)}
    ckw = {"chunk": None if chunk is None else int(chunk), "ef_decay": float(decay or 1.0),
           "block": int(block or 256), "mean_over": "senders" if snd else "ranks"}
    comp = (lambda: None) if bits is None else \
        (lambda: Compression.quantize(int(bits), density=None if pct is None else float(pct) / 100, **ckw))
    return (lambda: Schedule.diloco(int(h), **kw)), comp


_INNER_LR = re.compile(r"(.+)_ilr([\d.]+)$")


def split_inner_lr(name: str) -> tuple[str, float]:
    """``V_ilr{f}``: variant V with its inner learning rate (the peak of the schedule) f times
    ``--lr``, for sweeps of the inner step against the per-worker batch (docs/diloco.md#measured-inner-lr)."""
    m = _INNER_LR.match(name)
    return (name, 1.0) if m is None else (m.group(1), float(m.group(2)))


def inner_lr_factor(step: int, args) -> float:
    """The inner learning rate's factor at ``step`` (0-based): linear warm-up over ``--warmup``
    steps, then cosine decay to ``--min-lr`` of the peak at ``--steps`` (DiLoCo's inner schedule),
    or constant without ``--cosine``. The same for every variant."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    if not args.cosine:
        return 1.0
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * t))


def train_variant(name, schedule, compression, args, shape, train_tok, val_xy, init_state, lr_scale=1.0):
    P = args.ranks

    def body(comm):
        torch.set_num_threads(1)
        model = GPT(shape)
        model.load_state_dict(init_state)
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr * lr_scale, betas=(0.9, 0.95), weight_decay=0.01)
        opt = hco.DistributedOptimizer(inner, named_parameters=model.named_parameters(), communicator=comm,
                                       schedule=schedule(), compression=compression())
        lr_sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda i: inner_lr_factor(i, args))
        gen = torch.Generator().manual_seed(1000 + comm.rank + 100 * args.seed)
        it = batches(train_tok, args.batch, shape.context, gen)
        curve, per_step, compute_s = [], [], 0.0
        sent0, coll0 = comm.traffic.bytes_sent, comm.traffic.collectives

        def evaluate(step):
            model.eval()
            with torch.no_grad():
                loss = float(lm_loss(model(val_xy[0]), val_xy[1]))
            model.train()
            curve.append({"step": step, "tokens": step * P * args.batch * shape.context, "compute_s": compute_s,
                          "bytes": comm.traffic.bytes_sent - sent0, "collectives": comm.traffic.collectives - coll0,
                          "val_loss": loss})
            print(f"EVAL {name} step {step} val {loss:.4f}", flush=True)  # progress of a long run
        if comm.rank == 0:
            evaluate(0)
        for step in range(1, args.steps + 1):
            x, y = next(it)
            t0 = time.perf_counter()
            before = comm.traffic.bytes_sent
            opt.zero_grad()
            lm_loss(model(x), y).backward()
            opt.step()
            lr_sched.step()
            compute_s += time.perf_counter() - t0
            per_step.append(comm.traffic.bytes_sent - before)
            if comm.rank == 0 and (step % args.eval_every == 0 and step < args.steps):
                evaluate(step)
        opt.finalize()
        if comm.rank == 0:
            evaluate(args.steps)
        return {"curve": curve, "per_step_bytes": per_step, "bytes": comm.traffic.bytes_sent - sent0,
                "collectives": comm.traffic.collectives - coll0}
    t0 = time.perf_counter()
    out = run_ranks(P, body)
    res = out[0]
    res["wall_s"] = time.perf_counter() - t0
    # training steps only (finalize's last sync of the fragments is not a step)
    res["bytes_per_step_per_rank"] = sum(sum(o["per_step_bytes"]) for o in out) / P / args.steps
    res["peak_step_bytes"] = max(max(o["per_step_bytes"]) for o in out)
    res["name"] = name
    return res


def modelled_time(point: dict, link: str, P: int) -> float:
    bw, lat = LINKS[link]
    return point["compute_s"] + point["bytes"] * 8 / bw + point["collectives"] * lat


def summarise(results: dict, P: int) -> list[dict]:
    base = results["ddp"]
    target = base["curve"][-1]["val_loss"]
    rows = []
    for name, r in results.items():
        final = r["curve"][-1]
        row = {"variant": name, "final_val_loss": final["val_loss"],
               "loss_vs_ddp": final["val_loss"] / base["curve"][-1]["val_loss"] - 1.0,
               "bytes_per_step_per_rank": r["bytes_per_step_per_rank"],
               "bytes_ratio_vs_ddp": r["bytes_per_step_per_rank"] / base["bytes_per_step_per_rank"],
               "peak_step_bytes": r["peak_step_bytes"], "wall_s": r["wall_s"]}
        for link in LINKS:
            hit = next((p for p in r["curve"] if p["val_loss"] <= target), None)
            row[f"time_to_ddp_loss_{link}_s"] = None if hit is None else modelled_time(hit, link, P)
            row[f"time_total_{link}_s"] = modelled_time(final, link, P)
        rows.append(row)
    return rows


def emulated_step_s(netemu: dict, name: str) -> float | None:
    """The step time measured on the emulated link (benchmarks/lowcomm_netemu.py) that stands for
    variant ``name``: its own, or S-SGD's for the S-SGD variants and DiLoCo H=50's for the DiLoCo
    variants at H=50 (their per-step bytes are within a few % of it); None for the others."""
    res = netemu.get("results", {})
    key = name if name in res else ("ddp" if name.startswith("ddp") else
                                     "diloco_h50" if name.startswith(("diloco_h50", "sparseloco_h50")) else None)
    if key not in res:
        return None
    return res[key].get("step_s", max(r["step_s"] for r in res[key]["ranks"]))  # the median of --repeats


def plot(results: dict, P: int, out: Path, netemu: dict | None = None, png: Path | None = None) -> None:
    """Validation loss against tokens, against time on the emulated link (steps x the step time
    measured there, when ``netemu`` is given) and against modelled time at 1 Gbit/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for name, r in results.items():
        c = r["curve"]
        line, = axes[0].plot([p["tokens"] for p in c], [p["val_loss"] for p in c], marker=".", label=name)
        step_s = None if netemu is None else emulated_step_s(netemu, name)
        if step_s is not None:
            axes[1].plot([max(p["step"], 1) * step_s for p in c], [p["val_loss"] for p in c], marker=".",
                         color=line.get_color(), label=name)
        axes[2].plot([max(modelled_time(p, "1Gbit", P), 1e-3) for p in c], [p["val_loss"] for p in c], marker=".",
                     color=line.get_color(), label=name)
    axes[0].set_xlabel("tokens (all ranks)")
    axes[1].set_xlabel(f"time on the emulated {netemu['net'] if netemu else '?'} link (s): steps x measured step time")
    axes[2].set_xlabel("modelled time at 1 Gbit/s (s): compute + bytes/bandwidth")
    for ax in axes[1:]:
        ax.set_xscale("log")
    if "ddp" in results:
        for ax in axes:
            ax.axhline(results["ddp"]["curve"][-1]["val_loss"], color="grey", lw=0.8, ls=":")
    for ax in axes:
        ax.set_ylabel("validation loss (nats/byte)")
        ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"GPT on stdlib bytes, {P} ranks (dotted: S-SGD's final loss)")
    fig.tight_layout()
    fig.savefig(out / "lowcomm_curves.png", dpi=110)
    if png is not None:
        fig.savefig(png, dpi=80)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=0, help="inner learning-rate warm-up steps (linear)")
    ap.add_argument("--cosine", action="store_true", help="cosine decay of the inner learning rate after warm-up")
    ap.add_argument("--min-lr", type=float, default=0.1, help="the cosine decay's final factor")
    ap.add_argument("--h", type=int, nargs=3, default=[20, 50, 100])
    ap.add_argument("--variants", default="all")
    ap.add_argument("--seed", type=int, default=0, help="the initial weights' and the batches' seed (0: as before)")
    ap.add_argument("--out", default="benchmarks/results/lowcomm")
    ap.add_argument("--baseline", default=None,
                    help="a JSON of an earlier run with the same arguments: take its results instead of rerunning them")
    ap.add_argument("--merge", default=None,
                    help="comma-separated JSONs of runs with the same arguments (variants split across processes): "
                         "their results are taken together, the listed variants not in them are run")
    ap.add_argument("--no-ddp", action="store_true", help="do not add the ddp baseline (a part to --merge later)")
    ap.add_argument("--netemu", default=None,
                    help="benchmarks/lowcomm_netemu.py's netemu_summary.json: plot loss against time on that link")
    ap.add_argument("--png", default=None, help="also save the plot here (e.g. benchmarks/report_lowcomm.png)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = GPTShape(layers=args.layers, heads=4, width=args.width, context=args.context, vocab=256)
    torch.manual_seed(args.seed)
    init_state = GPT(shape).state_dict()
    train_tok = load_text_corpus(shape.context, "train")
    val_xy = eval_windows(load_text_corpus(shape.context, "val"), shape.context, args.eval_windows)
    table = variants(*args.h)
    names = list(table) if args.variants == "all" else args.variants.split(",")
    results = {}
    if args.baseline:  # the same model, data and steps: the earlier run's results stand
        results = json.loads(Path(args.baseline).read_text())["results"]
        names = [n for n in names if n not in results]
    elif args.merge:
        for part in args.merge.split(","):
            results.update(json.loads(Path(part).read_text())["results"])
        names = [n for n in names if n not in results] if args.variants != "all" else []
    elif "ddp" not in names and not args.no_ddp:
        names = ["ddp"] + names
    path = out / (f"lowcomm_p{args.ranks}.json" if not args.baseline else f"lowcomm_p{args.ranks}_more.json")
    nparams = sum(t.numel() for t in init_state.values() if t.dtype.is_floating_point) - shape.vocab * shape.width
    for name in names:
        base, lr_scale = split_inner_lr(name)
        sched, comp = table[base] if base in table else parse_variant(base)
        results[name] = train_variant(name, sched, comp, args, shape, train_tok, val_xy, init_state, lr_scale)
        r = results[name]
        print(f"LOWCOMM {name}: val {r['curve'][-1]['val_loss']:.4f}  bytes/step/rank "
              f"{r['bytes_per_step_per_rank']:.0f}  wall {r['wall_s']:.0f}s", flush=True)
        path.write_text(json.dumps({"args": vars(args), "params": nparams, "results": results}))
    if "ddp" not in results:
        return
    rows = summarise(results, args.ranks)
    netemu = json.loads(Path(args.netemu).read_text()) if args.netemu else None
    if netemu is not None:  # the time to S-SGD's final loss on the emulated link: steps x measured step time
        target = results["ddp"]["curve"][-1]["val_loss"]
        for row in rows:
            step_s = emulated_step_s(netemu, row["variant"])
            hit = next((p for p in results[row["variant"]]["curve"] if p["val_loss"] <= target), None)
            row["emulated_step_s"] = step_s
            row[f"time_to_ddp_loss_emulated_{netemu['net']}_s"] = None if step_s is None or hit is None else \
                hit["step"] * step_s
    path.write_text(json.dumps({"args": vars(args), "params": nparams, "results": results, "summary": rows}))
    print(f"\n{nparams} parameters, {args.ranks} ranks, {args.steps} steps of {args.batch}x{shape.context} "
          f"tokens per rank; ratios against ddp (S-SGD allreduce) in this run")
    hdr = f"{'variant':28s} {'val':>7s} {'vs ddp':>7s} {'B/step/rank':>12s} {'x ddp':>9s} {'peak B':>10s}" + \
        "".join(f" {'t->ddp ' + k:>15s}" for k in LINKS)
    print(hdr)
    for row in rows:
        tt = "".join(f" {'-' if row[f'time_to_ddp_loss_{k}_s'] is None else format(row[f'time_to_ddp_loss_{k}_s'], '.1f'):>15s}"
                     for k in LINKS)
        print(f"{row['variant']:28s} {row['final_val_loss']:7.4f} {100 * row['loss_vs_ddp']:+6.2f}% "
              f"{row['bytes_per_step_per_rank']:12.0f} {row['bytes_ratio_vs_ddp']:9.5f} {row['peak_step_bytes']:10.0f}{tt}")
    try:
        plot(results, args.ranks, out, netemu, Path(args.png) if args.png else None)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
