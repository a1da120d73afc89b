"""PyTorch side of the step: the :class:`~hvd_commopt.host.ScheduleHost` the core schedulers drive.

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

from hvd_commopt import timeline as _timeline
from hvd_commopt.host import ADAPTIVE

from ._compat import is_view
from .sparse_update import SparseSGD

__all__ = ["TorchScheduleHost", "ADAPTIVE_OPTIMIZERS"]

#: torch's optimizers that divide by a per-coordinate second moment (docs/adaptive-optimizers.md).
ADAPTIVE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
                       torch.optim.Adamax, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.SparseAdam)


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an uncopyable hyper-parameter is kept by reference
        return value


class TorchScheduleHost:
    """A wrapped optimizer and its named parameters, as the core schedulers see them."""

    holds_weights = True

    def __init__(self, optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]]):
        self.opt = optimizer
        self.params = dict(named)
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self._contiguous = {n: p.is_contiguous() for n, p in self.params.items()}
        self._replaced: list[torch.Tensor] = []  # the gradients the last set_grads replaced
        # plain SGD after a sparse exchange: the update at the exchanged positions only
        self._sparse = SparseSGD(optimizer, self.params)

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.params.items()}

    def assign(self, name: str, value: torch.Tensor) -> None:
        p = self.params[name]
        if value.data_ptr() == p.data.data_ptr() and value.shape == p.shape and value.stride() == p.stride():
            return  # already computed in place into the parameter
        with torch.no_grad():
            p.data.copy_(value)

    def swap_weights(self, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        old = {}
        with torch.no_grad():
            for n, p in self.params.items():
                old[n] = p.data
                p.data = new[n]
        return old

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {n: p.grad for n, p in self.params.items()}

    def set_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """``p.grad`` becomes the given tensor itself where it fits the parameter (the engine's
        reduced gradients are views of its fusion buffer, as DDP's ``gradient_as_bucket_view``:
        no copy; the engine does not reuse a buffer while a view of it lives,
        docs/wrapper.md#grad-views); otherwise it is copied."""
        contiguous, params = self._contiguous, self.params
        # The gradients autograd allocated are dropped at the next zero_grad() (or hand-over), not
        # now: freed inside step(), glibc gave their memory back and the next backward page-faulted
        # on all of it (measured: ~2,900 minor faults and +4 ms per step on a 3M-parameter MLP).
        # Freed where they were freed when they stayed in .grad, the next backward reuses their
        # memory, and the peak is what it was. Views of the engine's buffers are not held: that
        # would keep the buffers from being reused (docs/wrapper.md#grad-views).
        replaced: list[torch.Tensor] = []
        self._replaced = replaced
        with torch.no_grad():
            for n, g in grads.items():
                p = params[n]
                if p.grad is not None and p.grad.is_sparse:  # autograd's was sparse: so is the result
                    p.grad = g.to_sparse()
                    continue
                # the .grad setter checks shape, dtype and device; the layout is ours to check
                if contiguous[n] and g.is_contiguous() and not g.requires_grad:
                    try:
                        old = p.grad
                        p.grad = g
                        if old is not None and not is_view(old):
                            replaced.append(old)
                        continue
                    except RuntimeError:
                        pass
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad.copy_(g)

    def drop_replaced(self) -> None:
        """Free the gradients the last :meth:`set_grads` replaced (called by ``zero_grad()``)."""
        self._replaced = []

    def hyper(self) -> list[dict]:
        return [{k: _snapshot(v) for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    def hyper_without_momentum(self) -> list[dict] | None:
        """A :meth:`hyper` override that runs ``torch.optim.SGD`` without momentum (momentum
        correction applies it before selection, docs/dgc.md#optimizer-momentum); None for other
        optimizers (RMSprop's momentum, for one, is not SGD's)."""
        if not isinstance(self.opt, torch.optim.SGD):
            return None
        return [{"momentum": 0.0, "nesterov": False, "dampening": 0.0} if "momentum" in g else {}
                for g in self.opt.param_groups]

    def optimizer_family(self) -> str:
        """:data:`~hvd_commopt.host.ADAPTIVE` for torch's optimizers with a per-coordinate second
        moment (docs/adaptive-optimizers.md), "sgd" for ``torch.optim.SGD``, else "other"."""
        if isinstance(self.opt, ADAPTIVE_OPTIMIZERS):
            return ADAPTIVE
        return "sgd" if isinstance(self.opt, torch.optim.SGD) else "other"

    def param_hyper(self, name: str, key: str, default: float | None = None) -> float | None:
        v = self._group_of[id(self.params[name])].get(key, default)
        return float(v) if isinstance(v, torch.Tensor) else v

    def apply_optimizer(self, grads: dict | None = None, weights: dict | None = None, hyper: Any = None,
                        closure=None) -> Any:
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
                if grads is not None and weights is not None:
                    for n, p in params.items():  # temporarily: the local gradient is restored below
                        saved_grad[n] = p.grad
                        p.grad = grads[n]
                elif grads is not None:  # as the synchronous path: reduced grads stay in .grad
                    self.set_grads(grads)
                if hyper is not None:
                    saved_hyper = []
                    for group, h in zip(opt.param_groups, hyper):
                        saved_hyper.append({k: group[k] for k in h if k in group})
                        group.update(h)
            with _timeline.span("update", "update"):  # no-op unless a timeline is recording
                sparse = getattr(grads, "sparse", None)
                if sparse and weights is None and closure is None:
                    lr = self._sparse.lr(hyper)
                    if lr is not None and self._sparse.step(sparse, lr):
                        return None
                return opt._hco_base.step(opt, closure)
        finally:
            with torch.no_grad():
                if saved_hyper is not None:
                    for group, h in zip(opt.param_groups, saved_hyper):
                        group.update(h)
                for n, g in saved_grad.items():
                    params[n].grad = g
                for n, d in saved_data.items():
                    params[n].data = d
