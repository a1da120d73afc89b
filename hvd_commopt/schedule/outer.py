"""The outer optimizer of DiLoCo (docs/diloco.md#outer): it steps the global weights with the
averaged pseudo-gradient ``Delta = mean_i (global - local_i)`` as their gradient.

* :class:`NesterovOuter`, built in: SGD with (Nesterov) momentum in PyTorch's form, through
  :class:`~hvd_commopt.schedule.local_opt.LocalOptimizer` (the same kernel as the local optimizer
  of OD/SSD-SGD), DiLoCo's lr 0.7 / momentum 0.9 by default.
* A framework optimizer class (``outer=torch.optim.AdamW``): the core imports no framework, so
  an adapter registers a builder for its optimizer base class (:func:`register_outer`) and
  :func:`build_outer` picks it by ``issubclass``, the way :func:`~hvd_commopt.tensor_ops.ops_for`
  picks tensor ops.

Every rank steps the outer optimizer with the same averaged pseudo-gradient from the same state,
so the global weights stay identical across ranks; the state is shared in checkpoints.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from ..errors import ConfigError
from ..tensor_ops import TensorOps
from .local_opt import LocalOptimizer

__all__ = ["OuterOptimizer", "NesterovOuter", "register_outer", "build_outer"]

Tensor = Any


@runtime_checkable
class OuterOptimizer(Protocol):
    """Steps global weights with pseudo-gradients (the conformance test: tests/unit/test_diloco.py)."""

    def step(self, weights: dict[str, Tensor], grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """Update ``weights[name]`` for every name in ``grads`` (a fragment may be a subset);
        returns the new tensors by name (the same objects where the framework updates in place)."""
        ...

    def state_dict(self) -> dict:
        ...

    def load_state_dict(self, state: dict, like: dict[str, Tensor]) -> None:
        """Restore, placing tensors like ``like[name]`` (the global weights)."""
        ...


class NesterovOuter:
    """Built-in outer step: ``m = mu*m + Delta; w -= lr*(Delta + mu*m)`` (Nesterov) or ``w -= lr*m``.

    With ``momentum=0`` and ``lr=1`` it is ``w - Delta``, the plain model average (local SGD).
    """

    def __init__(self, ops: TensorOps, lr: float, momentum: float, nesterov: bool):
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), bool(nesterov and momentum)
        self._opt = LocalOptimizer(ops, "sgd", momentum=self.momentum, scale=1.0)

    def step(self, weights: dict[str, Tensor], grads: dict[str, Tensor]) -> dict[str, Tensor]:
        return {n: self._opt.update(n, weights[n], None, g, lr=self.lr, nesterov=self.nesterov)
                for n, g in grads.items()}

    def state_dict(self) -> dict:
        return self._opt.state_dict()

    def load_state_dict(self, state: dict, like: dict[str, Tensor]) -> None:
        self._opt.load_state_dict(state, like)


OuterBuilder = Callable[[type, dict, TensorOps], OuterOptimizer]
_BUILDERS: list[tuple[type, OuterBuilder]] = []


def register_outer(base: type, builder: OuterBuilder) -> None:
    """An adapter's builder for outer optimizers that subclass ``base`` (called at its import)."""
    if all(b is not base for b, _ in _BUILDERS):
        _BUILDERS.append((base, builder))


def build_outer(ops: TensorOps, cls: Any, kwargs: dict, lr: float, momentum: float, nesterov: bool) -> OuterOptimizer:
    """The outer optimizer: built in for ``cls`` None, else the registered adapter's wrapper."""
    if cls is None:
        return NesterovOuter(ops, lr, momentum, nesterov)
    for base, builder in _BUILDERS:
        if isinstance(cls, type) and issubclass(cls, base):
            return builder(cls, kwargs, ops)
    known = ", ".join(b.__module__ + "." + b.__qualname__ for b, _ in _BUILDERS) or "none registered"
    raise ConfigError(f"outer={cls!r} is not an optimizer class this adapter can build (subclasses of: {known}); "
                      f"pass a framework optimizer class such as torch.optim.SGD (import torch_plugin), or "
                      f"outer=None for the built-in Nesterov outer step")
