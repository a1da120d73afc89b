"""Synchronous SGD: Horovod's semantics, the default schedule.

``optimizer.step()`` reduces this step's gradients (unless ``synchronize()`` already did, inside
``skip_synchronize()``), hands them to the framework's gradient buffers and runs the wrapped
optimizer. ``optimizer.synchronize()`` reduces now and writes the result into the gradient
buffers, so gradients can be clipped before ``step()`` (Horovod's ``synchronize`` /
``skip_synchronize`` contract).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

from .base import RoundPort, Scheduler
from .config import SyncConfig

__all__ = ["SyncScheduler"]


class SyncScheduler(Scheduler):
    name = "sync"
    needs_weights = False
    drains_for_checkpoint = False

    def __init__(self, config: SyncConfig, port: RoundPort):
        super().__init__(config, port)
        self._synchronized = False  # synchronize() ran since the last step

    def synchronize(self) -> dict[str, Any]:
        out = self._reduce_now()
        self.host.set_grads(out)
        self._synchronized = True
        return out

    def on_step(self, closure: Callable[[], Any] | None = None, synchronize: bool = True) -> Any:
        if synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                              "optimizer.synchronize(): the gradients are reduced twice. Wrap step() "
                              "in `with optimizer.skip_synchronize():`.")
            loss = self._sync_step(closure)
        else:  # the framework's gradients as they are (reduced by an explicit synchronize())
            loss = self.host.apply_optimizer(closure=closure, hyper=self._hyper_override)
            self.step += 1
        self._synchronized = False
        return loss

    def abandon(self) -> None:
        self._synchronized = False  # a checkpoint load forgets a synchronize() of the old state
