"""A NumPy ScheduleHost and a tiny least-squares model, for scheduler tests without a framework."""
from __future__ import annotations

import copy
import warnings

import numpy as np

from hvd_commopt import NumpyOps, TensorSpec, build_engine

OPS = NumpyOps()
SPECS = [TensorSpec("w", (5, 3), "float32"), TensorSpec("b", (3,), "float32"), TensorSpec("v", (3, 2), "float32")]


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(seed)
    return {s.name: (rs.randn(*s.shape) * 0.3).astype(np.float32) for s in SPECS}


def batch(rank: int, step: int, n: int = 8, identical: bool = False):
    rs = np.random.RandomState(1000 * step + (0 if identical else rank + 1))
    return rs.randn(n, 5).astype(np.float32), rs.randn(n, 2).astype(np.float32)


def loss_grads(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of 0.5*mean(|tanh(x w + b) v - y|^2) (a two-layer model, so delays matter)."""
    h_pre = x @ p["w"] + p["b"]
    h = np.tanh(h_pre)
    err = (h @ p["v"] - y) / np.float32(x.shape[0])
    gv = h.T @ err
    gh = (err @ p["v"].T) * (1 - h * h)
    return {"w": (x.T @ gh).astype(np.float32), "b": gh.sum(0).astype(np.float32), "v": gv.astype(np.float32)}


class NumpyHost:
    """ScheduleHost over a dict of arrays; the "wrapped optimizer" is torch-form momentum SGD."""

    holds_weights = True

    def __init__(self, params: dict[str, np.ndarray], lr: float = 0.1, momentum: float = 0.0, wd: float = 0.0):
        self.w = {k: v.copy() for k, v in params.items()}
        self.g: dict[str, np.ndarray | None] = {k: None for k in params}
        self.group = {"lr": lr, "momentum": momentum, "weight_decay": wd}
        self.state: dict[str, np.ndarray] = {}
        self.calls: list[dict] = []   # one record per wrapped-optimizer call

    # ScheduleHost
    def weights(self): return dict(self.w)

    def assign(self, name, value):
        if value is not self.w[name]:
            np.copyto(self.w[name], value)

    def swap_weights(self, new):
        old, self.w = self.w, dict(new)
        return old

    def grads(self): return dict(self.g)

    def set_grads(self, grads):
        self.g = dict(self.g, **grads)

    def hyper(self): return dict(self.group)
    def param_hyper(self, name, key, default=None): return self.group.get(key, default)

    def apply_optimizer(self, grads=None, weights=None, hyper=None, closure=None):
        h = dict(self.group, **hyper) if hyper is not None else self.group  # laid over, as torch's host does
        W = weights if weights is not None else self.w
        G = grads if grads is not None else self.g
        self.calls.append({"replica": weights is not None, "lr": h["lr"],
                           "grads": {n: np.array(G[n], copy=True) for n in W}})
        sgd_step(W, G, self.state, h)

    # checkpoint of the "framework" side (model weights + optimizer state)
    def snapshot(self):
        return copy.deepcopy({"w": self.w, "state": self.state, "group": self.group})

    def restore(self, snap):
        snap = copy.deepcopy(snap)
        for k in self.w:
            np.copyto(self.w[k], snap["w"][k])
        self.state, self.group = snap["state"], snap["group"]


class SwitchableMomentumHost(NumpyHost):
    """A host whose optimizer can run without its momentum, as torch.optim.SGD's host can: with
    it, momentum correction takes the optimizer's momentum and switches it off in the update."""

    def hyper_without_momentum(self):
        return {"momentum": 0.0}


def sgd_step(W, G, state, h):
    """torch.optim.SGD's single-tensor arithmetic with NumpyOps (so local == global ops)."""
    for n in W:
        d = OPS.clone(G[n])
        if h["weight_decay"]:
            d = OPS.axpy_(d, h["weight_decay"], W[n])
        if h["momentum"]:
            m = state.get(n)
            m = OPS.clone(d) if m is None else OPS.axpy_(OPS.scale(m, h["momentum"]), 1.0, d)
            state[n] = m
            d = m
        OPS.axpy_(W[n], -h["lr"], d)


def make_engine(comm, schedule, host, fusion_threshold=None, compression=None):
    eng = build_engine(comm, OPS, schedule=schedule, fusion_threshold=fusion_threshold, compression=compression)
    eng.register(SPECS)
    eng.attach_host(host)
    return eng


def one_step(eng, host, rank, step, identical=False, grads=None):
    """Backward (gradients into the host and the hooks), then optimizer.step()."""
    g = grads if grads is not None else loss_grads(host.w, *batch(rank, step, identical=identical))
    host.g = g
    for name in eng.backward_names:
        eng.grad_ready(name, g[name])
    eng.run_step()
    return g


def mean_in_rank_order(per_rank: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """What the in-process allreduce + average computes: sum in rank order, times 1/P."""
    P = len(per_rank)
    out = {}
    for n in per_rank[0]:
        acc = per_rank[0][n].copy()
        for g in per_rank[1:]:
            acc += g[n]
        acc *= np.float32(1.0 / P)
        out[n] = acc
    return out


def reduce_all(eng, g: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hand every gradient of ``g`` to ``eng`` in backward order, reduce, and return copies of the
    reduced tensors (a skipped non-finite step's RuntimeWarning silenced)."""
    for name in eng.backward_names:
        eng.grad_ready(name, g[name].copy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return {n: np.array(v, copy=True) for n, v in eng.reduce_step().items()}


def reducer_memory(eng) -> dict[str, np.ndarray]:
    """Copies of the reducer's memory, keyed ``"{kind}/{bucket}"``."""
    mem = eng.reducer.state_dict()["memory"]
    return {f"{k}/{n}": np.array(t, copy=True) for k, d in mem.items() for n, t in d.items()}
