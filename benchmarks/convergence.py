"""Accuracy of every algorithm next to S-SGD, with what users run (SGD lr 0.1 momentum 0.9, or AdamW).

One MPI job trains, on every rank, each variant from the same initial weights and data order for
the same epochs (steps, for the transformer) and schedule as S-SGD, for each seed, and rank 0
prints one ``CONV {json}`` line per (variant, seed) with the final test accuracy, or validation
loss for the transformer (of the global model: after ``finalize()``), and the curve.
docs/benchmarking.md#convergence states what the tables showed.

    mpirun -np 2 python -m benchmarks.convergence --task digits --seeds 0,1,2
    mpirun -np 4 python -m benchmarks.convergence --task rings --epochs 6 --variants ssgd,lags
    mpirun -np 2 python -m benchmarks.convergence --task transformer --optimizer adamw --steps 300
    python -m benchmarks.convergence table benchmarks/results/convergence_*.txt   # tables from saved CONV lines
    python -m benchmarks.convergence matrix --tasks digits,transformer --optimizers sgd,adamw \
        --ranks 2,4 --seeds 0,1,2 --out benchmarks/results/convergence_matrix.txt  # the whole matrix, one table

Tasks:

* ``digits``: scikit-learn's 8x8 digits (1797 images), the examples' DigitsCNN (conv1 has 144
  weights: LAGS's small-layer case), batch 16 per rank.
* ``rings``: a generated 16x16 image task that no linear model separates (docs in
  :func:`rings`): the class of an image is set by the *radius* of a noisy ring drawn at a random
  position, plus clutter; a small residual network (two residual stages, BatchNorm, 8-16
  channels) learns it in a few epochs on one core.
* ``transformer``: the GPT-style decoder of benchmarks/gpt_model.py (``--shape cpu``: GPT_CPU,
  6.4M parameters; ``tiny`` for smoke runs) on byte-level stdlib text (benchmarks/text_corpus.py),
  batch 8 x context per rank, ``--steps`` steps; the metric is the validation loss over 64 fixed
  held-out windows (lower is better), the gap to S-SGD a percentage of S-SGD's.

Optimizers (``--optimizer``): ``sgd`` (momentum 0.9, lr 0.1 by default) and ``adamw`` (weight
decay 0.01, lr 1e-3 by default), since transformers are trained with Adam. The learning rate
decays by a cosine over the run (per step), after a linear warm-up of 10 % of the steps for the
transformer, the same for every variant.
Every variant uses the library's defaults for the algorithm (the density, warm-ups and periods
below are the only settings), so the table says whether the defaults train.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import torch_plugin as hco
from hvd_commopt import Compression, Schedule
from hvd_commopt.memory.momentum import MomentumCorrection
from hvd_commopt.reduce import GTopK
from hvd_commopt.reduce.oktopk import OkTopK

from .convergence_tasks import digits, digits_mlp, rings, transformer

DENSITY = 0.01


TASKS = {"digits": digits, "digits_mlp": digits_mlp, "rings": rings, "transformer": transformer}
OPTIMIZERS = ("sgd", "adamw")
DEFAULT_LR = {"sgd": 0.1, "adamw": 1e-3}
LM_BATCH = 8


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    """The local optimizer of every variant: SGD with momentum 0.9, or AdamW (weight decay 0.01)."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


# -- variants -----------------------------------------------------------------------------------
class MaskSelected(MomentumCorrection):
    """Momentum correction with the masking rule before docs/gtopk.md#masking-delivered: the
    momentum of every selected entry is zeroed, also of those the exchange then drops (an A/B
    variant for the benchmark, not a library option)."""

    def restore_momentum(self, ops, name, step, dropped) -> None:
        return None


def variant_kwargs(name: str, steps_per_epoch: int, warmup: int) -> dict:
    """DistributedOptimizer keyword arguments of a variant: the library's defaults for it."""
    d = DENSITY
    table = {
        "ssgd": lambda: {},
        "topk": lambda: {"compression": Compression.topk(d)},
        "topk_nocorr": lambda: {"compression": Compression.topk(d, momentum_correction=False)},
        "gtopk": lambda: {"compression": Compression.gtopk(d)},
        "oktopk": lambda: {"compression": Compression.oktopk(d)},
        # momentum correction with / without DGC's momentum factor masking (docs/convergence-matrix.md#masking)
        "topk_mask": lambda: {"compression": Compression.topk(d, momentum_masking=True)},
        "gtopk_mask": lambda: {"compression": Compression.gtopk(d, momentum_masking=True)},
        "topk_nomask": lambda: {"compression": Compression.topk(d, momentum_masking=False)},
        "gtopk_nomask": lambda: {"compression": Compression.gtopk(d, momentum_masking=False)},
        "oktopk_nomask": lambda: {"compression": Compression.oktopk(d, momentum_masking=False)},
        "lags_nomask": lambda: {"compression": Compression.topk(d, momentum_masking=False), "fusion_threshold": 0},
        "randomk_nomask": lambda: {"compression": Compression.randomk(d, momentum_masking=False)},
        "dgc_nomask": lambda: {"compression": Compression.dgc(d, steps_per_epoch=steps_per_epoch,
                                                              momentum_masking=False)},
        "gtopk_nocorr": lambda: {"compression": Compression.gtopk(d, momentum_correction=False)},
        # A/B of docs/gtopk.md#masking-delivered: the rule before it, every selected entry's momentum masked
        "gtopk_mask_selected": lambda: {"compression": GTopK(d, memory=MaskSelected(), min_k=16)},
        "oktopk_mask_selected": lambda: {"compression": OkTopK(d, memory=MaskSelected(), min_k=16)},
        # a dense warm-up under SGD (docs/adaptive-optimizers.md#warmup-steps), the length of OD/SSD/CD's
        "topk_warm": lambda: {"compression": Compression.topk(d, warmup_steps=warmup)},
        "gtopk_warm": lambda: {"compression": Compression.gtopk(d, warmup_steps=warmup)},
        "lags": lambda: {"compression": Compression.topk(d), "fusion_threshold": 0},
        "lags_nocorr": lambda: {"compression": Compression.topk(d, momentum_correction=False),
                                "fusion_threshold": 0},
        "lags_k1": lambda: {"compression": Compression.topk(d, min_k=1), "fusion_threshold": 0},
        "omgs": lambda: {"compression": Compression.topk(d), "fusion": "mgwfbp",
                         "fusion_options": {"warmup_steps": 1, "profile_steps": 3, "measure_steps": 0}},
        "dgc": lambda: {"compression": Compression.dgc(d, steps_per_epoch=steps_per_epoch)},
        "randomk": lambda: {"compression": Compression.randomk(d)},
        "randomk_d03": lambda: {"compression": Compression.randomk(max(d, 0.3))},
        "randomk_nocorr": lambda: {"compression": Compression.randomk(d, momentum_correction=False)},
        "randomk_unbiased": lambda: {"compression": Compression.randomk(d, error_feedback=False, unbiased=True)},
        "randomk_noef": lambda: {"compression": Compression.randomk(d, error_feedback=False)},
        "od": lambda: {"schedule": Schedule.od(warmup_steps=warmup)},
        "ssd": lambda: {"schedule": Schedule.ssd(warmup_steps=warmup)},
        "cd": lambda: {"schedule": Schedule.cd(warmup_steps=warmup, batch_size=BATCH)},
        "cocod": lambda: {"schedule": Schedule.cocod(4)},
        "local_sgd": lambda: {"schedule": Schedule.local_sgd(4)},
        "od_topk": lambda: {"schedule": Schedule.od(warmup_steps=warmup), "compression": Compression.topk(d)},
        "ssd_topk": lambda: {"schedule": Schedule.ssd(warmup_steps=warmup), "compression": Compression.topk(d)},
        "od_dgc": lambda: {"schedule": Schedule.od(warmup_steps=warmup),
                           "compression": Compression.dgc(d, steps_per_epoch=steps_per_epoch)},
        "dgc_warm": lambda: {"compression": Compression.dgc(d, steps_per_epoch=steps_per_epoch, warmup_epochs=4)},
        "od_dgc_nomask": lambda: {"schedule": Schedule.od(warmup_steps=warmup), "compression": Compression.dgc(
            d, steps_per_epoch=steps_per_epoch, momentum_masking=False)},
        "ssd_topk_nomask": lambda: {"schedule": Schedule.ssd(warmup_steps=warmup),
                                    "compression": Compression.topk(d, momentum_masking=False)},
        "cd_flush": lambda: {"schedule": Schedule.cd(warmup_steps=warmup, batch_size=BATCH,
                                                     flush_residual_on_correction=True)},
        "cocod_warm": lambda: {"schedule": Schedule.cocod(4, warmup_steps=warmup)},
        # compression="auto" as users get it, and as it chooses on a 100 Mbit/s link's model (sparse)
        "auto": lambda: {"compression": "auto"},
        "auto_100mbit": lambda: {"compression": Compression.auto(cost_model=_link_model(1e-4, 8e-8))},
        # the same with its density floor at --density: what a floor there would train to
        "auto_100mbit_floor": lambda: {"compression": Compression.auto(cost_model=_link_model(1e-4, 8e-8),
                                                                       min_density=d)},
        # auto with Top-k/DGC allowed down to --density, priced on a 1 Mbit/s link (small models' buckets go sparse)
        "auto_sparse_1mbit": lambda: {"compression": Compression.auto(cost_model=_link_model(1e-4, 8e-6),
                                                                      allow=["topk", "dgc"], min_density=d)},
        "auto_1mbit": lambda: {"compression": Compression.auto(cost_model=_link_model(1e-4, 8e-6))},
        "auto_dgcm_1mbit": lambda: {"compression": Compression.auto(cost_model=_link_model(1e-4, 8e-6),
                                                                    allow=["dgc_masked"], min_density=d)},
        # the low-bit quantiser with its own error feedback (docs/quantize.md#exchange), as users run it
        **{f"quant{b}": (lambda b=b: {"compression": Compression.quantize(b)}) for b in (8, 4, 2)},
        # auto with only a quantiser (or the bf16 cast, docs/auto-compression.md#kinds-ranks) allowed,
        # priced on a 100 Mbit/s (or 1 Mbit/s: the small models' buckets pay for it there) link's
        # model: the method over auto's memory, as auto runs it (auto_quant8, ..., auto_bf16_1mbit)
        **{f"auto_{m}{sfx}": (lambda m=m, beta=beta: {"compression": Compression.auto(
            cost_model=_link_model(1e-4, beta), allow=[m])}) for m in ("quant8", "quant4", "quant2", "bf16")
           for sfx, beta in (("", 8e-8), ("_1mbit", 8e-6))},
        "od_reference": lambda: {"schedule": Schedule.od(warmup_steps=warmup, local="reference")},
        "ssd_reference": lambda: {"schedule": Schedule.ssd(warmup_steps=warmup, local="reference")},
        "cd_reference": lambda: {"schedule": Schedule.cd(warmup_steps=warmup, batch_size=BATCH,
                                                         local="reference")},
    }
    if name not in table:
        raise SystemExit(f"unknown variant {name!r}; choose from {sorted(table)}")
    return table[name]()


def _link_model(alpha_s: float, beta_s_per_byte: float):
    """The cost model of a link of latency ``alpha_s`` and ``beta_s_per_byte`` at this job's ranks."""
    from hvd_commopt.fusion import AlphaBeta, CostModel
    return CostModel.from_link(AlphaBeta(alpha_s, beta_s_per_byte), hco.size())


DEFAULT_VARIANTS = ["ssgd", "topk", "gtopk", "oktopk", "lags", "dgc", "randomk", "od", "ssd", "ssd_topk", "cd",
                    "od_dgc", "cocod", "local_sgd"]
BATCH = 16


def train(task, name: str, seed: int, epochs: int, lr: float, warmup: int, optimizer: str = "sgd") -> dict:
    xtr, ytr, xte, yte, model_cls = task
    P, R = hco.size(), hco.rank()
    mine = np.arange(len(xtr))[R::P]
    Xtr, Ytr = torch.from_numpy(xtr[mine]), torch.from_numpy(ytr[mine])
    Xte, Yte = torch.from_numpy(xte), torch.from_numpy(yte)
    steps = len(mine) // BATCH
    torch.manual_seed(seed)
    model = model_cls()
    opt = hco.DistributedOptimizer(make_optimizer(optimizer, model.parameters(), lr),
                                   named_parameters=model.named_parameters(),
                                   **variant_kwargs(name, steps, warmup))
    # the usual schedule: cosine decay of the lr over the run, per step (the same for every variant)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + np.cos(np.pi * min(s / (epochs * steps), 1.0))))
    g = torch.Generator().manual_seed(1000 * seed + 1 + R)
    curve = []
    t0 = time.perf_counter()
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(Xtr), generator=g)
        for i in range(steps):
            idx = order[i * BATCH:(i + 1) * BATCH]
            opt.zero_grad()
            F.cross_entropy(model(Xtr[idx]), Ytr[idx]).backward()
            opt.step()
            sched.step()
        curve.append(_accuracy(opt, model, Xte, Yte))
    opt.finalize()
    acc = _accuracy(opt, model, Xte, Yte, finalized=True)
    return {"variant": name, "seed": seed, "acc": acc, "curve": curve, "seconds": time.perf_counter() - t0,
            **_auto_choice(opt)}


def train_lm(name: str, seed: int, steps: int, lr: float, warmup: int, optimizer: str, shape: str,
             eval_every: int) -> dict:
    """The transformer task: ``steps`` steps of AdamW or SGD on byte-level text, the validation loss
    every ``eval_every`` steps and of the global model at the end."""
    from .gpt_model import GPT, GPT_CPU, GPTShape, lm_loss
    from .text_corpus import batches, eval_windows, load_text_corpus
    s = GPT_CPU if shape == "cpu" else GPTShape(layers=2, heads=2, width=64, context=32, vocab=256)
    data = batches(load_text_corpus(s.context), LM_BATCH, s.context,
                   torch.Generator().manual_seed(1000 * seed + 1 + hco.rank()))
    vx, vy = eval_windows(load_text_corpus(s.context, "val"), s.context, 64)
    torch.manual_seed(seed)
    model = GPT(s)
    opt = hco.DistributedOptimizer(make_optimizer(optimizer, model.parameters(), lr),
                                   named_parameters=model.named_parameters(),
                                   **variant_kwargs(name, eval_every, warmup))
    ramp = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: min(1.0, (t + 1) / ramp) * 0.5 * (1 + np.cos(np.pi * min(t / steps, 1.0))))
    curve = []
    t0 = time.perf_counter()
    model.train()
    for t in range(steps):
        x, y = next(data)
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
        sched.step()
        if (t + 1) % eval_every == 0 or t + 1 == steps:
            curve.append(_val_loss(opt, model, vx, vy))
    opt.finalize()
    loss = _val_loss(opt, model, vx, vy, finalized=True)
    return {"variant": name, "seed": seed, "val_loss": loss, "curve": curve, "seconds": time.perf_counter() - t0,
            **_auto_choice(opt)}


def _auto_choice(opt) -> dict:
    """For ``compression="auto"``: what its last decision chose per bucket (``{}`` for the others)."""
    rep = opt.compression_report
    if not rep:
        return {}
    return {"chosen": [b["method"] for b in rep["buckets"]], "decisions": rep.get("decisions", 1),
            "kinds": rep.get("kinds")}  # the optimizer and model kinds read (docs/auto-compression.md#kinds)


def _val_loss(opt, model, x, y, finalized: bool = False) -> float:
    from .gpt_model import lm_loss
    model.eval()
    with torch.no_grad():
        if finalized or opt.comm_engine.scheduler.global_weights() is None:
            total = sum(float(lm_loss(model(x[i:i + 16]), y[i:i + 16])) * len(x[i:i + 16]) for i in range(0, len(x), 16))
        else:
            with opt.use_global_weights():
                total = sum(float(lm_loss(model(x[i:i + 16]), y[i:i + 16])) * len(x[i:i + 16])
                            for i in range(0, len(x), 16))
    model.train()
    return round(total / len(x), 5)


def _accuracy(opt, model, x, y, finalized: bool = False) -> float:
    model.eval()
    with torch.no_grad():
        if finalized or opt.comm_engine.scheduler.global_weights() is None:
            out = model(x)
        else:
            with opt.use_global_weights():
                out = model(x)
    return round(100.0 * (out.argmax(1) == y).float().mean().item(), 3)


def table(paths: list[str]) -> str:
    """The matrix's one gap table from CONV files (benchmarks/convergence_matrix.py)."""
    from .convergence_matrix import table as gap_table
    return gap_table(paths)


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in ("table", "matrix"):
        from . import convergence_matrix  # the tables and the matrix runner
        if sys.argv[1] == "table":
            print(convergence_matrix.table(sys.argv[2:]))
            return
        sys.exit(convergence_matrix.matrix(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="digits", choices=sorted(TASKS))
    ap.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    ap.add_argument("--steps", type=int, default=300, help="transformer: training steps")
    ap.add_argument("--eval-every", type=int, default=50, help="transformer: steps between validations")
    ap.add_argument("--shape", default="cpu", choices=["cpu", "tiny"], help="transformer: GPT_CPU or a tiny one")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=None, help="default 0.1 with SGD, 1e-3 with AdamW")
    ap.add_argument("--warmup", type=int, default=50, help="warm-up steps of OD/SSD/CD")
    ap.add_argument("--density", type=float, default=0.01, help="density of the sparse variants")
    args = ap.parse_args(argv)
    global DENSITY
    DENSITY = args.density
    lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    hco.init()
    torch.set_num_threads(1)
    for seed in [int(s) for s in args.seeds.split(",")]:
        task = TASKS[args.task](seed)
        for name in args.variants.split(","):
            if args.task == "transformer":
                res = train_lm(name, seed, args.steps, lr, args.warmup, args.optimizer, args.shape, args.eval_every)
                length = {"steps": args.steps, "shape": args.shape}
            else:
                res = train(task, name, seed, args.epochs, lr, args.warmup, args.optimizer)
                length = {"epochs": args.epochs}
            if hco.rank() == 0:
                res.update(task=args.task, ranks=hco.size(), optimizer=args.optimizer, lr=lr, density=DENSITY, **length)
                print("CONV " + json.dumps(res), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
