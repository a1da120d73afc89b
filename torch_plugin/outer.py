"""A ``torch.optim`` class as DiLoCo's outer optimizer (docs/diloco.md#outer).

``Schedule.diloco(H, outer=torch.optim.AdamW, outer_kwargs={"lr": 1e-3})``: the core names the
class; this module builds it over the scheduler's global weights (the tensors it owns, leaves
without autograd history) at the first outer step, gives each one its pseudo-gradient as
``.grad`` and steps. Parameters of fragments that are not synchronised this step have no
gradient, so torch's optimizers leave them and their state alone. Registered for every
``torch.optim.Optimizer`` subclass when the adapter is imported.
"""
from __future__ import annotations

from typing import Any

import torch

from hvd_commopt.errors import ConfigError
from hvd_commopt.schedule.outer import register_outer

__all__ = ["TorchOuter"]


class TorchOuter:
    """:class:`~hvd_commopt.schedule.outer.OuterOptimizer` over a ``torch.optim`` class."""

    def __init__(self, cls: type, kwargs: dict, ops: Any = None):
        self.cls, self.kwargs = cls, dict(kwargs)
        self.opt: torch.optim.Optimizer | None = None
        self.names: list[str] = []
        self._pending_state: dict | None = None

    def _build(self, weights: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
        if self.opt is None or any(weights[n] is not p for n, p in zip(self.names, self.opt.param_groups[0]["params"])):
            self.names = list(weights)
            try:
                self.opt = self.cls([weights[n] for n in self.names], **self.kwargs)
            except TypeError as e:
                raise ConfigError(f"outer={self.cls.__name__} could not be built with outer_kwargs={self.kwargs}: "
                                  f"{e}; pass the class's own arguments") from None
            if self._pending_state is not None:
                self.opt.load_state_dict(self._pending_state)
                self._pending_state = None
        return self.opt

    def step(self, weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        opt = self._build(weights)
        for n in self.names:
            weights[n].grad = grads.get(n)
        opt.step()
        for n in self.names:
            weights[n].grad = None
        return {n: weights[n] for n in grads}

    def state_dict(self) -> dict:
        if self.opt is None:
            return {"torch": self._pending_state}
        return {"torch": self.opt.state_dict()}

    def load_state_dict(self, state: dict, like: dict[str, torch.Tensor]) -> None:
        self.opt, self._pending_state = None, state.get("torch")
        if self._pending_state is not None and like:
            self._build(like)


def _build(cls: type, kwargs: dict, ops: Any) -> TorchOuter:
    return TorchOuter(cls, kwargs, ops)


register_outer(torch.optim.Optimizer, _build)
