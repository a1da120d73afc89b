"""PyTorch side of the schedules: the update primitives and the ScheduleHost (see
:mod:`hvd_commopt.schedule.base` for the division of labour).

The host's one substantial primitive is :meth:`TorchScheduleHost.apply_optimizer`: "run the
user's wrapped optimizer once on these weights with these gradients". To step the *global
replica* instead of the model, it swaps the replica's tensors into the parameters (``p.data``)
and the reduced gradients into ``p.grad`` for the duration of the wrapped ``step()``, then swaps
back. The optimizer's state, keyed by parameter, is therefore the replica's optimizer state,
and whatever the optimizer is (SGD, Adam, param groups, an LR scheduler driving its lr), the
global update U_g is exactly it. Nothing is copied: the swaps exchange tensor references.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from .ops import TORCH_DTYPES, TorchOps

__all__ = ["TorchUpdateOps", "TorchScheduleHost"]


class TorchUpdateOps(TorchOps):
    """TorchOps plus hvd_commopt.schedule.UpdateOps (the kernels torch.optim.SGD itself uses)."""

    def copy_(self, dst, src):
        with torch.no_grad():
            return dst.copy_(src)

    def axpy_(self, y, alpha, x):
        with torch.no_grad():
            return y.add_(x, alpha=alpha)

    def mul(self, a, b):
        with torch.no_grad():
            return a * b

    def ternarize_(self, r, theta, dtype):
        with torch.no_grad():
            wire = TORCH_DTYPES[dtype]
            s = (r >= theta).to(wire) - (r <= -theta).to(wire)
            r.sub_(s.to(r.dtype).mul_(theta))  # r - theta*(+-1): exactly MXNet's r -= theta / r += theta
            return r, s


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an uncopyable hyper-parameter is kept by reference
        return value


class TorchScheduleHost:
    """A wrapped optimizer and its named parameters, as the core schedulers see them."""

    def __init__(self, optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]]):
        self.opt = optimizer
        self.params = dict(named)
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.params.items()}

    def assign(self, name: str, value: torch.Tensor) -> None:
        p = self.params[name]
        if value.data_ptr() == p.data.data_ptr() and value.shape == p.shape and value.stride() == p.stride():
            return  # already computed in place into the parameter
        with torch.no_grad():
            p.data.copy_(value)

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {n: p.grad for n, p in self.params.items()}

    def hyper(self) -> list[dict]:
        return [{k: _snapshot(v) for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    def param_hyper(self, name: str, key: str, default: float | None = None) -> float | None:
        v = self._group_of[id(self.params[name])].get(key, default)
        return float(v) if isinstance(v, torch.Tensor) else v

    def apply_optimizer(self, grads: dict | None = None, weights: dict | None = None, hyper: Any = None) -> None:
        opt, params = self.opt, self.params
        saved_data: dict[str, torch.Tensor] = {}
        saved_grad: dict[str, torch.Tensor | None] = {}
        saved_hyper: list[dict] | None = None
        try:
            with torch.no_grad():
                if weights is not None:
                    for n, p in params.items():
                        saved_data[n] = p.data
                        p.data = weights[n]
                if grads is not None:
                    for n, p in params.items():
                        g = grads[n]
                        if weights is not None:  # temporarily: the local gradient is restored below
                            saved_grad[n] = p.grad
                            p.grad = g
                        elif p.grad is None:     # as the synchronous path: reduced grads stay in .grad
                            p.grad = g.detach().clone()
                        else:
                            p.grad.copy_(g)
                if hyper is not None:
                    saved_hyper = []
                    for group, h in zip(opt.param_groups, hyper):
                        saved_hyper.append({k: group[k] for k in h if k in group})
                        group.update(h)
            opt._hco_base.step(opt)
        finally:
            with torch.no_grad():
                if saved_hyper is not None:
                    for group, h in zip(opt.param_groups, saved_hyper):
                        group.update(h)
                for n, g in saved_grad.items():
                    params[n].grad = g
                for n, d in saved_data.items():
                    params[n].data = d
