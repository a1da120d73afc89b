"""Shared machinery of the model-averaging schedules (CoCoD-SGD, local SGD).

Between averagings every worker steps the *user's* optimizer on its own model with its own
gradient (no gradient collective: the engine's hooks are told to ignore gradients), so a local
step is exactly a single-process step. Models are averaged through the engine's fusion layout
(one flat buffer per bucket) as ``allreduce_sum(x / P)`` (the references' form, docs/local-sgd.md#update-rule, docs/cocod-sgd.md#update-rule).
"""
from __future__ import annotations

from typing import Any, Callable

from ..reduce.base import Pending, ReduceContext, RoundInfo
from ..reduce.dense import DenseAllreduce
from .base import RoundPlan, RoundPort, Scheduler
from .config import AveragingConfig

__all__ = ["AveragingScheduler"]

Tensor = Any


class AveragingScheduler(Scheduler):
    """Warm-up, local steps, and a ``_sync()`` every ``period`` local steps (subclasses)."""

    rank_local_weights = True    # each worker's own model between averagings
    rank_local_optimizer = True  # the user's optimizer steps on local gradients

    def __init__(self, config: AveragingConfig, port: RoundPort):
        super().__init__(config, port)
        self.name = config.kind
        self.period = config.period
        self.warmup = config.warmup_steps
        self.syncs = 0  # averagings started
        self._avg = DenseAllreduce()
        # x / P before the sum, nothing after: the references' allreduce_sum(x / P).
        self._avg_ctx = ReduceContext(port.comm, self.ops, prescale=1.0 / port.comm.size, postscale=1.0)

    def round_plan(self) -> RoundPlan | None:
        if self.step < self.warmup:
            return RoundPlan(self.port.reducer, None)
        return None  # local steps: gradients are not communicated

    def on_step(self, closure: Callable[[], Any] | None = None, synchronize: bool = True) -> None:
        self._no_closure(closure)
        if self.step < self.warmup:
            self._sync_step()
            return
        self.host.apply_optimizer()  # the user's optimizer, local gradient, on the model
        self.step += 1
        if (self.step - self.warmup) % self.period == 0:
            self._sync()

    def _sync(self) -> None:
        raise NotImplementedError

    # -- helpers: model <-> per-bucket flat buffers (the engine's layout, Bucket.pack/views) -------
    def pack(self, tensors: dict[str, Tensor], flats: list | None = None, like: dict | None = None) -> list:
        """Copy ``tensors`` into one flat buffer per bucket (reusing ``flats`` when given; new
        buffers are placed like ``like[name]``, default ``tensors[name]``)."""
        like = tensors if like is None else like
        return [b.pack(self.ops, tensors, flats[b.index] if flats is not None else None, like[b.first])
                for b in self.port.buckets]

    def views(self, flats: list) -> dict[str, Tensor]:
        """Per-tensor views (original shapes) of per-bucket flats."""
        out: dict[str, Tensor] = {}
        for b, f in zip(self.port.buckets, flats):
            out.update(b.views(self.ops, f))
        return out

    def assign_model(self, flats: list) -> None:
        host, ops = self.host, self.ops
        w = host.weights()
        for name, v in self.views(flats).items():
            host.assign(name, ops.copy_(w[name], v))

    def start_average(self, flats: list, label: str) -> list[Pending]:
        """Launch ``allreduce_sum(flat / P)`` on each bucket (the flats are consumed)."""
        rnd = RoundInfo(self.step, f"{label}{self.syncs}")
        return [self._avg.start(b, rnd, f, self._avg_ctx) for b, f in zip(self.port.buckets, flats)]

    def finish_average(self, pending: list[Pending]) -> list:
        out = [self._avg.finish(p, self._avg_ctx) for p in pending]
        # T-CoCoD-3: the averaged buffer is read only once its collective has completed.
        assert all(h.poll() for p in pending for h in p.handles), "averaging read before completion"
        return out

    def average_model_now(self, label: str) -> None:
        """Blocking: every rank's model becomes the average of all ranks' models."""
        self.assign_model(self.finish_average(self.start_average(self.pack(self.host.weights()), label)))
