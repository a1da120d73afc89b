"""Accuracy of every algorithm next to S-SGD, with what users run (SGD lr 0.1, momentum 0.9).

One MPI job trains, on every rank, each variant from the same initial weights and data order for
the same epochs and schedule as S-SGD, for each seed, and rank 0 prints one ``CONV {json}`` line
per (variant, seed) with the final test accuracy (of the global model: after ``finalize()``) and
the per-epoch curve. docs/benchmarking.md#convergence states what the tables showed.

    mpirun -np 2 python -m benchmarks.convergence --task digits --seeds 0,1,2
    mpirun -np 4 python -m benchmarks.convergence --task rings --epochs 6 --variants ssgd,lags
    python -m benchmarks.convergence table benchmarks/results/convergence_*.txt   # tables from saved CONV lines

Tasks:

* ``digits``: scikit-learn's 8x8 digits (1797 images), the examples' DigitsCNN (conv1 has 144
  weights: LAGS's small-layer case), batch 16 per rank.
* ``rings``: a generated 16x16 image task that no linear model separates (docs in
  :func:`rings`): the class of an image is set by the *radius* of a noisy ring drawn at a random
  position, plus clutter; a small residual network (two residual stages, BatchNorm, 8-16
  channels) learns it in a few epochs on one core.

The learning rate decays by a cosine over the run (per step), the same for every variant.
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
import torch.nn as nn
import torch.nn.functional as F

import torch_plugin as hco
from hvd_commopt import Compression, Schedule

DENSITY = 0.01


# -- tasks --------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.sc = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return F.relu(y + (x if self.sc is None else self.sc(x)))


class SmallResNet(nn.Module):
    """ResNet-style: stem, two residual stages (8 and 16 channels), global pooling."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.s1 = Block(8, 8, 1)
        self.s2 = Block(8, 16, 2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.s2(self.s1(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def digits(seed: int = 0):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    perm = np.random.RandomState(seed).permutation(len(x))
    te, tr = perm[:360], perm[360:]
    from .suite.tta import _digits_module  # examples/pytorch_digits.py's DigitsCNN
    return x[tr], y[tr].astype(np.int64), x[te], y[te].astype(np.int64), _digits_module().DigitsCNN


def rings(seed: int = 0, n_train: int = 2400, n_test: int = 1000, size: int = 16, classes: int = 4):
    """Generated images: class c is a ring of radius 2 + 1.5c (pixels) at a random centre, with
    random thickness jitter, scaled to the same total brightness for every class, plus 3 random
    clutter blobs and Gaussian pixel noise. The class depends on a radius, not on where or how
    much pixels are bright, so a linear model on the pixels does poorly (scikit-learn's
    LogisticRegression: see docs/benchmarking.md#convergence). The data depend on ``seed``."""
    rng = np.random.RandomState(1000 + seed)
    n = n_train + n_test
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    y = rng.randint(0, classes, n)
    img = np.zeros((n, size, size), np.float32)
    for i in range(n):
        r = 2.0 + 1.5 * y[i] + rng.uniform(-0.4, 0.4)
        cy, cx = rng.uniform(r - 1, size - r, 2) if r < size / 2 else (size / 2, size / 2)
        d = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)
        ring = np.exp(-((d - r) ** 2) / (2 * rng.uniform(0.3, 0.6) ** 2))
        img[i] = ring * (25.0 / ring.sum())  # the same total brightness for every class
        for _ in range(3):
            by, bx = rng.uniform(0, size, 2)
            img[i] += 0.6 * np.exp(-((yy - by) ** 2 + (xx - bx) ** 2) / (2 * 0.8 ** 2))
    img += rng.normal(0, 0.25, img.shape).astype(np.float32)
    img = img[:, None]
    return img[:n_train], y[:n_train].astype(np.int64), img[n_train:], y[n_train:].astype(np.int64), SmallResNet


TASKS = {"digits": digits, "rings": rings}


# -- variants -----------------------------------------------------------------------------------
def variant_kwargs(name: str, steps_per_epoch: int, warmup: int) -> dict:
    """DistributedOptimizer keyword arguments of a variant: the library's defaults for it."""
    d = DENSITY
    table = {
        "ssgd": lambda: {},
        "topk": lambda: {"compression": Compression.topk(d)},
        "topk_nocorr": lambda: {"compression": Compression.topk(d, momentum_correction=False)},
        "gtopk": lambda: {"compression": Compression.gtopk(d)},
        "gtopk_nocorr": lambda: {"compression": Compression.gtopk(d, momentum_correction=False)},
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
        "od_reference": lambda: {"schedule": Schedule.od(warmup_steps=warmup, local="reference")},
        "ssd_reference": lambda: {"schedule": Schedule.ssd(warmup_steps=warmup, local="reference")},
        "cd_reference": lambda: {"schedule": Schedule.cd(warmup_steps=warmup, batch_size=BATCH,
                                                         local="reference")},
    }
    if name not in table:
        raise SystemExit(f"unknown variant {name!r}; choose from {sorted(table)}")
    return table[name]()


DEFAULT_VARIANTS = ["ssgd", "topk", "gtopk", "lags", "omgs", "dgc", "randomk", "od", "ssd", "cd", "cocod",
                    "local_sgd"]
BATCH = 16


def train(task, name: str, seed: int, epochs: int, lr: float, warmup: int) -> dict:
    xtr, ytr, xte, yte, model_cls = task
    P, R = hco.size(), hco.rank()
    mine = np.arange(len(xtr))[R::P]
    Xtr, Ytr = torch.from_numpy(xtr[mine]), torch.from_numpy(ytr[mine])
    Xte, Yte = torch.from_numpy(xte), torch.from_numpy(yte)
    steps = len(mine) // BATCH
    torch.manual_seed(seed)
    model = model_cls()
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
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
    return {"variant": name, "seed": seed, "acc": acc, "curve": curve, "seconds": time.perf_counter() - t0}


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
    """Markdown table (mean ± sample std over seeds, and the gap to S-SGD's mean) from CONV lines."""
    import statistics
    rows: dict[tuple, dict[str, list[float]]] = {}
    for path in paths:
        for ln in open(path):
            if ln.startswith("CONV "):
                r = json.loads(ln[5:])
                rows.setdefault((r["task"], r["ranks"], r["epochs"]), {}).setdefault(r["variant"], []).append(r["acc"])
    out = []
    for (task, ranks, epochs), res in sorted(rows.items()):
        base = statistics.mean(res["ssgd"]) if "ssgd" in res else None
        out += [f"**{task}, {ranks} ranks, {epochs} epochs**", "",
                "| algorithm | seeds | test accuracy % (mean ± std) | min–max | vs S-SGD (pt) |", "|---|---|---|---|---|"]
        for name, accs in res.items():
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            gap = "" if base is None else f"{statistics.mean(accs) - base:+.2f}"
            out.append(f"| {name} | {len(accs)} | {statistics.mean(accs):.2f} ± {sd:.2f} | "
                       f"{min(accs):.1f}–{max(accs):.1f} | {gap} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "table":
        print(table(sys.argv[2:]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="digits", choices=sorted(TASKS))
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50, help="warm-up steps of OD/SSD/CD")
    ap.add_argument("--density", type=float, default=0.01, help="density of the sparse variants")
    args = ap.parse_args(argv)
    global DENSITY
    DENSITY = args.density
    hco.init()
    torch.set_num_threads(1)
    for seed in [int(s) for s in args.seeds.split(",")]:
        task = TASKS[args.task](seed)
        for name in args.variants.split(","):
            res = train(task, name, seed, args.epochs, args.lr, args.warmup)
            if hco.rank() == 0:
                res.update(task=args.task, ranks=hco.size(), epochs=args.epochs, lr=args.lr, density=DENSITY)
                print("CONV " + json.dumps(res), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
