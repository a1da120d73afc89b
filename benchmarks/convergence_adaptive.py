"""Sparse compression under Adam/AdamW: the candidates behind docs/adaptive-optimizers.md#measured.

Runs :mod:`benchmarks.convergence` (same tasks, data, schedule and ``CONV`` lines) with extra
variants that A/B the ways of training a sparse method under an adaptive optimizer; the library's
own behaviour is the plain variant (``topk``, ``dgc``, ...), which under Adam/AdamW gets the
density warm-up by default (docs/adaptive-optimizers.md#warmup).

    mpirun -np 2 python -m benchmarks.convergence_adaptive --task transformer --optimizer adamw \\
        --shape tiny --steps 400 --variants ssgd,topk,topk_nowarm,topk_w50

Extra variants (``X`` one of topk, gtopk, oktopk, dgc, randomk, lags):
  ``X_nowarm``  no density warm-up (the behaviour before it);
  ``X_wN``      the exponential warm-up over N steps;
  ``X_denseN``  dense for N steps, then the density at once (1-bit Adam's uncompressed warm-up);
  ``dgc_m09``   DGC with its own momentum 0.9 on top of Adam's (the combination warned about);
  ``..._fN``    (transformer, AdamW) the wrapped AdamW's second moment frozen from step N on
                (1-bit Adam's variance freezing; the A/B of docs/adaptive-optimizers.md#not-adopted);
  ``..._fNp``   frozen, and each gradient divided by the frozen denominator before the exchange
                (selection by Adam's preconditioned magnitude), multiplied back in the update.

The monkeypatching of :mod:`benchmarks.convergence` (its variant table, optimizer factory and
``train_lm``) keeps these A/B switches out of the library and out of that benchmark's tables.
"""
from __future__ import annotations

import re

from hvd_commopt import Compression
from hvd_commopt.compress.warmup import DensityWarmup

from . import convergence as conv

_BASE = conv.variant_kwargs


class NoWarmup(DensityWarmup):
    """No warm-up: the selector's k from step 0 (the behaviour before the adaptive default)."""

    def __init__(self) -> None:
        super().__init__(1)

    def k(self, k: int, numel: int, step: int) -> int:
        return k


def ExpWarmup(steps: int) -> DensityWarmup:
    return DensityWarmup(steps, exponential=True)


def _plain(name: str, spe: int, warmup: int) -> dict:
    d = conv.DENSITY
    extra = {
        "oktopk": lambda: {"compression": Compression.oktopk(d)},
        "dgc_m09": lambda: {"compression": Compression.dgc(d, momentum=0.9)},
        "lags": lambda: {"compression": Compression.topk(d), "fusion_threshold": 0},
    }
    return extra[name]() if name in extra else _BASE(name, spe, warmup)


def variant_kwargs(name: str, steps_per_epoch: int, warmup: int) -> dict:
    name = re.sub(r"_f\d+p?$", "", name)
    m = re.fullmatch(r"(\w+?)_(nowarm|w|dense)(\d*)", name)
    if m is None or m.group(1) in ("ssgd",):
        return _plain(name, steps_per_epoch, warmup)
    kw = _plain(m.group(1), steps_per_epoch, warmup)
    comp = kw["compression"]
    kind, n = m.group(2), int(m.group(3) or 0)
    comp.compressor.warmup = {"nowarm": NoWarmup, "w": ExpWarmup, "dense": DensityWarmup}[kind](
        *([] if kind == "nowarm" else [n]))
    return kw


import torch  # noqa: E402  (after the variant table, which needs no torch)


class FrozenAdamW(torch.optim.AdamW):
    """Experiment: AdamW whose second moment stops updating after ``freeze`` steps."""

    freeze = 10**9
    precondition = False  # the gradients arrive divided by the frozen denominator (hooks below)

    def den(self, p, g):
        s = self.state[p]
        return (s["exp_avg_sq"] / (1 - g["betas"][1] ** self.freeze)).sqrt().add_(g["eps"])

    def frozen(self, p) -> bool:
        return p in self.state and int(self.state[p]["step"]) >= self.freeze

    def install_hooks(self):
        """Precondition each gradient before the exchange (registered before the wrapper's hooks)."""
        for g in self.param_groups:
            for p in g["params"]:
                def hook(p, g=g):
                    if self.precondition and self.frozen(p):
                        p.grad.div_(self.den(p, g))
                p.register_post_accumulate_grad_hook(hook)

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            st = [self.state[p] for p in g["params"] if p in self.state]
            t = int(st[0]["step"]) if st else 0
            if t >= self.freeze:
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    s = self.state[p]
                    s["step"] += 1
                    b1, b2 = g["betas"]
                    p.mul_(1 - g["lr"] * g["weight_decay"])
                    bc1 = 1 - b1 ** int(s["step"])
                    den = self.den(p, g)
                    s["exp_avg"].lerp_(p.grad * den if self.precondition else p.grad, 1 - b1)
                    p.addcdiv_(s["exp_avg"], den, value=-g["lr"] / bc1)
                continue
            # not frozen: the base step on this group only
            others = self.param_groups
            self.param_groups = [g]
            try:
                super().step()
            finally:
                self.param_groups = others
        return None


_MAKE = conv.make_optimizer
_CURRENT = [""]  # the variant being trained (make_optimizer is called before variant_kwargs)
_TRAIN_LM = conv.train_lm


def train_lm(name, *a, **k):
    _CURRENT[0] = name
    return _TRAIN_LM(name, *a, **k)


def make_optimizer(kind, params, lr):
    m = re.search(r"_f(\d+)(p?)$", _CURRENT[0])
    if kind == "adamw" and m:
        opt = FrozenAdamW(params, lr=lr, weight_decay=0.01)
        opt.freeze = int(m.group(1))
        opt.precondition = bool(m.group(2))
        opt.install_hooks()
        return opt
    return _MAKE(kind, params, lr)


conv.variant_kwargs = variant_kwargs
conv.make_optimizer = make_optimizer
conv.train_lm = train_lm

if __name__ == "__main__":
    conv.main()
