"""Shared machinery of the model-averaging schedules (CoCoD-SGD, local SGD, DiLoCo).

Between averagings every worker steps the *user's* optimizer on its own model with its own
gradient (no gradient collective: the engine's hooks are told to ignore gradients), so a local
step is exactly a single-process step. Models are averaged through the engine's fusion layout
(one flat buffer per bucket) as ``allreduce_sum(x / P)`` (the references' form, docs/local-sgd.md#update-rule, docs/cocod-sgd.md#update-rule).

With ``compression=`` (any reducer: top-k, gTop-k, Ok-Topk, DGC, random-k, fp16/bf16, the low-bit
quantiser) what moves is the *pseudo-gradient* ``anchor - x`` instead of the model
(docs/diloco.md#compressed): ``anchor`` is the last model every rank agrees on, so
``anchor - mean_i(anchor - x_i) = mean_i x_i`` and the averaging is unchanged in real arithmetic
when nothing is dropped; what a lossy reducer drops stays in its error feedback, keyed by bucket.
The pseudo-gradient reducer is a :meth:`~hvd_commopt.reduce.base.Reducer.fresh` copy of the
configured one (its residuals are not the warm-up gradients'), bound to no momentum: the outer
step (or the averaging) applies none of the inner optimizer's.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..buckets import Bucket
from ..compress.cast import NoneCompressor
from ..host import GradientCapture, ScheduleHost
from ..reduce.base import Pending, ReduceContext, Reducer, RoundInfo
from ..reduce.dense import DenseAllreduce
from .base import RoundPlan, RoundPort, Scheduler
from .config import AveragingConfig

__all__ = ["AveragingScheduler", "uncompressed"]

Tensor = Any


def uncompressed(reducer: Reducer) -> bool:
    """The reducer sends buckets as they are (no compression, no memory)."""
    return (isinstance(reducer, DenseAllreduce) and isinstance(reducer.compressor, NoneCompressor)
            and reducer.memory is None)


class _NoMomentumHost(GradientCapture):
    """What a pseudo-gradient reducer is bound to: an optimizer without momentum, so a memory that
    takes the optimizer's momentum (DGC, momentum correction) keeps plain error feedback."""

    holds_weights = True


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
        # compressed pseudo-gradients (module docstring): a fresh copy of the user's reducer, the
        # mean taken after the sum as for gradients
        self.pseudo: Reducer | None = None if uncompressed(port.reducer) else port.reducer.fresh()
        self._pseudo_ctx = ReduceContext(port.comm, self.ops, prescale=1.0, postscale=1.0 / port.comm.size)
        self.anchor: dict[str, Tensor] | None = None  # the model every rank agrees on (pseudo-gradient base)
        if self.pseudo is not None:
            self.rank_local_state = tuple(self.rank_local_state) + ("pseudo",)

    def attach(self, host: ScheduleHost) -> None:
        super().attach(host)
        if self.pseudo is not None:
            self.pseudo.bind_host(_NoMomentumHost(), list(self.port.names))

    @property
    def keeps_anchor(self) -> bool:
        """Whether the local phase needs :attr:`anchor` (compressed averaging; DiLoCo always)."""
        return self.pseudo is not None

    def round_plan(self) -> RoundPlan | None:
        if self.step < self.warmup:
            return RoundPlan(self.port.reducer, None)
        return None  # local steps: gradients are not communicated

    def on_step(self, closure: Callable[[], Any] | None = None, synchronize: bool = True) -> None:
        self._no_closure(closure)
        if self.step < self.warmup:
            self._sync_step()
            return
        if self.anchor is None and self.keeps_anchor:  # the models agree here (start, or after warm-up)
            self.anchor = {n: self.ops.clone(w) for n, w in self.host.weights().items()}
        self.host.apply_optimizer()  # the user's optimizer, local gradient, on the model
        self.step += 1
        self.after_local_step(self.step - self.warmup)

    def after_local_step(self, k: int) -> None:
        """Local step ``k`` (1, 2, ... after the warm-up) is done: sync every ``period`` steps."""
        if k % self.period == 0:
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
        self.assign_weights(self.views(flats))

    def assign_weights(self, tensors: dict[str, Tensor]) -> None:
        """Copy ``tensors`` (by name, any subset) into the model."""
        host, ops = self.host, self.ops
        w = host.weights()
        for name, v in tensors.items():
            host.assign(name, ops.copy_(w[name], v))

    def average_pseudo_now(self, label: str) -> None:
        """Blocking, compressed: ``anchor -= mean_i(anchor - x_i)`` (the mean model when nothing
        is dropped) and every rank's model becomes the new anchor."""
        a, ops, bks = self.anchor, self.ops, self.port.buckets
        assert a is not None, "internal: pseudo-gradient without an anchor"
        avg = self.finish_exchange(self.start_exchange(self.pack_pseudo(bks), label, bks))
        for n, d in self.views(avg).items():
            a[n] = ops.sub(a[n], d)
        self.assign_weights(a)

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

    # -- pseudo-gradients (compressed averaging, DiLoCo) ------------------------------------------
    def pack_pseudo(self, buckets: Sequence[Bucket]) -> list:
        """``anchor - x`` of the model x, one flat per bucket of ``buckets``."""
        ops, w, a = self.ops, self.host.weights(), self.anchor
        assert a is not None, "internal: pseudo-gradient without an anchor"
        return [b.pack(ops, {n: ops.sub(ops.clone(a[n]), w[n]) for n in b.names}) for b in buckets]

    def start_exchange(self, flats: list, label: str, buckets: Sequence[Bucket]) -> list[Pending]:
        """Launch the mean of ``flats`` (pseudo-gradients, one per bucket of ``buckets``) over the
        ranks: through the compressed reducer when there is one, else ``allreduce_sum(x / P)``."""
        rnd = RoundInfo(self.step, f"{label}{self.syncs}")
        if self.pseudo is None:
            return [self._avg.start(b, rnd, f, self._avg_ctx) for b, f in zip(buckets, flats)]
        return [self.pseudo.start(b, rnd, f, self._pseudo_ctx) for b, f in zip(buckets, flats)]

    def finish_exchange(self, pending: list[Pending]) -> list:
        if self.pseudo is None:
            return self.finish_average(pending)
        return [self.pseudo.finish(p, self._pseudo_ctx) for p in pending]

    def pseudo_state(self) -> dict:
        """The compressed reducer's state (its residuals: rank-local) and the anchor (shared)."""
        out: dict[str, Any] = {}
        if self.pseudo is not None:
            out["pseudo"] = self.pseudo.state_dict()
        if self.keeps_anchor:
            out["anchor"] = None if self.anchor is None else dict(self.anchor)
        return out

    def load_pseudo_state(self, state: dict) -> None:
        if self.pseudo is not None:
            self.pseudo.load_state_dict(dict(state.get("pseudo") or {}))
        if self.keeps_anchor:
            a, w = state.get("anchor"), self.host.weights()
            self.anchor = None if a is None else {n: self.ops.copy_(self.ops.clone(w[n]), t) for n, t in a.items()}
