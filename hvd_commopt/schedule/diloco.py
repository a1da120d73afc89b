"""DiLoCo and Streaming DiLoCo: inner steps, then an outer optimizer step on the averaged
pseudo-gradient (docs/diloco.md#update-rule, docs/diloco.md#streaming).

Papers: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105 (inner AdamW, outer Nesterov lr 0.7 momentum 0.9, H = 500); Douillard et al.,
"Streaming DiLoCo with overlapping communication", arXiv:2501.18512 (fragments, overlap,
low-bit outer exchange); torchft's ``DiLoCo(model_fragments, fragment_sync_delay)``.

Every rank runs the wrapped (inner) optimizer on its own model. Fragment f of F (parameter
tensors of near-equal total size, :func:`plan_fragments`) synchronises after local steps k
with ``k % H == offset_f``, ``offset_f = (f + 1) * H / F mod H`` (F = 1: after H, 2H, ...):

    Delta_f = mean_i (global_f - x_i,f)                (allreduce, or compressed with EF)
    global_f <- outer.step(global_f, Delta_f)           (the same on every rank)
    x_i,f <- global_f                                   (overlap 0)
    x_i,f <- global_f + (x_i,f - s_i,f)                 (overlap tau: arrives tau steps later)

where s_i,f is the local fragment when its exchange was launched: with overlap the tau inner
steps taken meanwhile are kept on top of the new global fragment (the CoCoD merge,
docs/cocod-sgd.md#closed-form, at the outer level; torchft overwrites them instead).

Choices: the global weights are taken from the model at the first local step (the ranks agree
there: broadcast or warm-up); ``finalize()`` applies what is in flight, syncs every fragment that
took local steps since its last sync, and leaves the model at the global weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..buckets import Bucket, TensorSpec
from ..errors import ConfigError
from ..host import ScheduleHost
from ..reduce.base import Pending
from .averaging import AveragingScheduler
from .base import RoundPort
from .config import DiLoCoConfig
from .outer import OuterOptimizer, build_outer

__all__ = ["DiLoCoScheduler", "plan_fragments", "fragment_offsets"]

Tensor = Any


def plan_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Split tensors (their element counts, in registration order) into ``fragments`` non-empty
    groups of near-equal size, so each sync moves about 1/F of the model: largest tensor first,
    each into the group with the fewest elements so far (LPT; ties to the lower index), every
    group listed in registration order. Whole tensors only, so a group may exceed 1/F by less
    than its largest tensor. A pure function."""
    n = len(sizes)
    if fragments > n:
        raise ConfigError(f"fragments={fragments} is more than the model's {n} parameter tensors: every fragment "
                          f"needs at least one tensor; pass fragments <= {n}")
    loads = [0] * fragments
    groups: list[list[int]] = [[] for _ in range(fragments)]
    for i in sorted(range(n), key=lambda i: (-sizes[i], i)):
        g = min(range(fragments), key=lambda g: (loads[g], g))
        groups[g].append(i)
        loads[g] += sizes[i]
    return [sorted(g) for g in groups]


def fragment_offsets(period: int, fragments: int) -> list[int]:
    """Local-step residue (mod ``period``) at which each fragment synchronises."""
    return [((f + 1) * period // fragments) % period for f in range(fragments)]


@dataclass
class _Flight:
    """One fragment's exchange: launched (pending) or finished and not applied yet (avg)."""

    pending: list[Pending] | None
    avg: list | None
    snap: dict[str, Tensor] | None  # the local fragment at launch (overlap > 0)
    arrive: int                     # the local step at which it is applied


class DiLoCoScheduler(AveragingScheduler):
    """Inner steps of the wrapped optimizer, outer steps on averaged pseudo-gradients."""

    rank_local_state = ("snapshots",)  # the local fragments at launch; global, outer, averages are shared

    def __init__(self, config: DiLoCoConfig, port: RoundPort):
        super().__init__(config, port)
        self.cfg = config
        self.offsets = fragment_offsets(config.period, config.fragments)
        self.outer: OuterOptimizer | None = None
        self._frags: list[list[Bucket]] | None = None
        self._flights: dict[int, _Flight] = {}
        self._last = [0] * config.fragments  # local step of each fragment's last sync

    @property
    def keeps_anchor(self) -> bool:
        return True  # the anchor is the global model

    def attach(self, host: ScheduleHost) -> None:
        super().attach(host)
        c = self.cfg
        self.outer = build_outer(self.ops, c.outer, dict(c.outer_kwargs), c.outer_lr, c.outer_momentum, c.nesterov)
        plan_fragments([1] * len(self.port.names), c.fragments)  # refuse too many fragments now, not at a sync

    # -- layout -------------------------------------------------------------------------------
    @property
    def fragments(self) -> list[list[Bucket]]:
        """Each fragment's messages: the engine's buckets (the fusion planner's sizes) cut at
        fragment boundaries."""
        if self._frags is None:
            specs = {n: TensorSpec(n, s, b.dtype) for b in self.port.buckets for n, s in zip(b.names, b.shapes)}
            names = [n for n in self.port.names if n in specs]
            groups = plan_fragments([specs[n].numel for n in names], self.cfg.fragments)
            where = {names[i]: f for f, g in enumerate(groups) for i in g}
            self._frags = [[] for _ in groups]
            for b in self.port.buckets:
                for f, msgs in enumerate(self._frags):
                    members = [specs[n] for n in b.names if where[n] == f]
                    if members:
                        msgs.append(Bucket.of(len(msgs), members, name=f"diloco{f}.{len(msgs)}:{members[0].name}"))
        return self._frags

    def fragment_names(self, f: int) -> list[str]:
        return [n for b in self.fragments[f] for n in b.names]

    # -- steps --------------------------------------------------------------------------------
    def after_local_step(self, k: int) -> None:
        for f in sorted(f for f, fl in self._flights.items() if fl.arrive == k):
            self._apply(f)
        for f, off in enumerate(self.offsets):
            if k % self.period == off:
                self._launch(f, k)
                if self.cfg.overlap == 0:
                    self._apply(f)

    def _launch(self, f: int, k: int) -> None:
        bks = self.fragments[f]
        snap = None
        if self.cfg.overlap:
            w = self.host.weights()
            snap = {n: self.ops.clone(w[n]) for n in self.fragment_names(f)}
        pending = self.start_exchange(self.pack_pseudo(bks), f"diloco{f}.", bks)
        self._flights[f] = _Flight(pending, None, snap, k + self.cfg.overlap)
        self._last[f] = k
        self.syncs += 1

    def _finish(self, fl: _Flight) -> list:
        if fl.pending is not None:
            fl.avg, fl.pending = self.finish_exchange(fl.pending), None
        assert fl.avg is not None
        return fl.avg

    def _apply(self, f: int) -> None:
        ops, g = self.ops, self.anchor
        assert g is not None and self.outer is not None
        fl = self._flights.pop(f)
        avg = self._finish(fl)
        delta: dict[str, Tensor] = {}
        for b, flat in zip(self.fragments[f], avg):
            delta.update(b.views(ops, flat))
        g.update(self.outer.step(g, delta))
        if fl.snap is None:
            self.assign_weights({n: g[n] for n in delta})
            return
        w = self.host.weights()  # x + (global - s): the tau inner steps taken meanwhile are kept
        for n in delta:
            self.host.assign(n, ops.add(w[n], ops.sub(ops.clone(g[n]), fl.snap[n])))

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return sum(1 for fl in self._flights.values() if fl.pending is not None)

    def drain(self) -> None:
        for fl in self._flights.values():  # value-neutral: applied at its arrival step as before
            self._finish(fl)

    def finalize(self) -> None:
        if self.anchor is None:
            return  # no local step taken: the model is the global model
        for f in sorted(self._flights):
            self._apply(f)
        k = self.step - self.warmup
        for f in range(self.cfg.fragments):
            if self._last[f] < k:
                self._launch(f, k)
                self._flights[f].snap = None
                self._apply(f)
        self.assign_weights(self.anchor)

    def abandon(self) -> None:
        for fl in self._flights.values():
            if fl.pending is not None:
                self.finish_exchange(fl.pending)
        self._flights = {}

    def global_weights(self) -> dict[str, Tensor] | None:
        return None if self.anchor is None else dict(self.anchor)

    def state_dict(self) -> dict:
        self.drain()
        views = {}
        for f, fl in self._flights.items():
            v: dict[str, Tensor] = {}
            for b, flat in zip(self.fragments[f], fl.avg or []):
                v.update(b.views(self.ops, flat))
            views[str(f)] = {"avg": v, "arrive": fl.arrive}
        return {"kind": self.name, "syncs": self.syncs, "last": list(self._last), "flights": views,
                "snapshots": {str(f): fl.snap for f, fl in self._flights.items()},
                "outer": None if self.outer is None else self.outer.state_dict(), **self.pseudo_state()}

    def load_state_dict(self, state: dict, step: int) -> None:
        super().load_state_dict(state, step)
        self.abandon()
        ops, w = self.ops, self.host.weights()
        self.syncs = int(state.get("syncs", 0))
        self._last = [int(x) for x in state.get("last", [0] * self.cfg.fragments)]
        self.load_pseudo_state(state)  # the global weights (the anchor) and the compressed reducer's residuals
        if self.outer is not None and state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"], self.anchor or w)
        snaps = state.get("snapshots") or {}
        for key, fl in (state.get("flights") or {}).items():
            f = int(key)
            avg = [b.pack(ops, fl["avg"], like=w[b.first]) for b in self.fragments[f]]
            snap = snaps.get(key)
            snap = None if snap is None else {n: ops.copy_(ops.clone(w[n]), t) for n, t in snap.items()}
            self._flights[f] = _Flight(None, avg, snap, int(fl["arrive"]))
