"""DiLoCo and Streaming DiLoCo: inner steps, then an outer optimizer step on the averaged
pseudo-gradient (docs/diloco.md#update-rule, docs/diloco.md#streaming).

Papers: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105 (inner AdamW, outer Nesterov lr 0.7 momentum 0.9, H = 500); Douillard et al.,
"Streaming DiLoCo with overlapping communication", arXiv:2501.18512 (fragments, overlap,
low-bit outer exchange); torchft's ``DiLoCo(model_fragments, fragment_sync_delay)``.

Every rank runs the wrapped (inner) optimizer on its own model. Fragment f of F (at most
ceil(N/F) of the N parameter elements, a tensor cut only where it does not fit,
:func:`plan_fragments`) synchronises after local steps k
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


Piece = tuple  # (tensor index, first element, end element) of the flattened tensor


def plan_fragments(sizes: Sequence[int], fragments: int) -> list[list[Piece]]:
    """Split tensors (their element counts, in registration order) into ``fragments`` non-empty
    groups of pieces ``(tensor index, start, stop)`` (element ranges of the flattened tensors)
    holding at most ``ceil(N/F)`` of the N elements each, so no sync moves more than 1/F of the
    model, to within one element (docs/diloco.md#streaming). Largest tensor first, each into the
    group with the fewest elements so far (LPT; ties to the lower index), as many elements as fit
    under ``ceil(N/F)`` and the rest into the next lightest group: only tensors that do not fit
    are cut, so a fragment holds tensors from across the model, like the paper's strided pattern.
    Pieces are listed in registration order. A pure function."""
    n = len(sizes)
    if fragments > n:
        raise ConfigError(f"fragments={fragments} is more than the model's {n} parameter tensors: every fragment "
                          f"needs at least one tensor; pass fragments <= {n}")
    cap = -(-sum(int(x) for x in sizes) // fragments)
    loads = [0] * fragments
    groups: list[list[Piece]] = [[] for _ in range(fragments)]
    for i in sorted(range(n), key=lambda i: (-sizes[i], i)):
        start, size = 0, int(sizes[i])
        while True:  # the lightest group has room while elements remain (its load < N/F <= cap)
            g = min(range(fragments), key=lambda g: (loads[g], g))
            stop = min(size, start + cap - loads[g])
            groups[g].append((i, start, stop))
            loads[g] += stop - start
            start = stop
            if start >= size:
                break
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
        self._pieces: dict[str, tuple[str, int, int, tuple]] = {}  # piece key -> (tensor, start, stop, shape)
        self._gp: tuple[list, dict[str, Tensor]] | None = None  # (global tensors, their members)

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
        fragment boundaries. A member is a whole tensor (its name) or, for a tensor cut across
        fragments, a piece of its flattened elements (``name[start:stop]``, 1-D)."""
        if self._frags is None:
            specs = {n: TensorSpec(n, s, b.dtype) for b in self.port.buckets for n, s in zip(b.names, b.shapes)}
            names = [n for n in self.port.names if n in specs]
            groups = plan_fragments([specs[n].numel for n in names], self.cfg.fragments)
            where: dict[str, list[tuple[int, TensorSpec]]] = {}
            for f, g in enumerate(groups):
                for i, start, stop in g:
                    sp = specs[names[i]]
                    if (start, stop) != (0, sp.numel):
                        key = f"{sp.name}[{start}:{stop}]"
                        self._pieces[key] = (sp.name, start, stop, tuple(sp.shape))
                        sp = TensorSpec(key, (stop - start,), sp.dtype)
                    where.setdefault(names[i], []).append((f, sp))
            self._frags = [[] for _ in groups]
            for b in self.port.buckets:
                for f, msgs in enumerate(self._frags):
                    members = [sp for n in b.names for g, sp in where[n] if g == f]
                    if members:
                        msgs.append(Bucket.of(len(msgs), members, name=f"diloco{f}.{len(msgs)}:{members[0].name}"))
        return self._frags

    def fragment_names(self, f: int) -> list[str]:
        """Fragment f's members: tensor names, and ``name[start:stop]`` for pieces of cut tensors."""
        return [n for b in self.fragments[f] for n in b.names]

    def _piece(self, tensors: dict[str, Tensor], key: str) -> Tensor:
        """Member ``key`` of ``tensors`` (by tensor name): the tensor, or a 1-D slice of it (a view
        where the framework's slices are views)."""
        if key not in self._pieces:
            return tensors[key]
        name, start, stop, _ = self._pieces[key]
        return self.ops.slice(self.ops.flatten(tensors[name]), start, stop)

    def _put(self, tensors: dict[str, Tensor], key: str, value: Tensor) -> Tensor:
        """``tensors`` with member ``key`` set to ``value``; returns the whole tensor it belongs to."""
        if key not in self._pieces:
            tensors[key] = value
            return value
        name, start, stop, shape = self._pieces[key]
        ops = self.ops
        if ops.slices_are_views:  # in place: the tensor stays the same object (the outer optimizer's)
            ops.copy_(self._piece(tensors, key), value)
        else:
            tensors[name] = ops.reshape(ops.copy_into(ops.flatten(tensors[name]), start, value), shape)
        return tensors[name]

    def _global_pieces(self) -> dict[str, Tensor]:
        """The global weights by member (what the outer optimizer steps): the same objects from
        step to step while the global tensors are (a torch outer optimizer keeps them as params)."""
        g = self.anchor
        assert g is not None
        src = [g[n] for n in self.port.names if n in g]
        if self._gp is None or len(src) != len(self._gp[0]) or any(a is not b for a, b in zip(src, self._gp[0])) \
                or not self.ops.slices_are_views:
            keys = [k for f in range(self.cfg.fragments) for k in self.fragment_names(f)]
            self._gp = (src, {k: self._piece(g, k) for k in keys})
        return self._gp[1]

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
            snap = {k: self.ops.clone(self._piece(w, k)) for k in self.fragment_names(f)}
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
        new = self.outer.step(self._global_pieces(), delta)
        for k in delta:
            self._put(g, k, new[k])
        w = self.host.weights()
        for k in delta:
            gk = self._piece(g, k)
            if fl.snap is not None:  # x + (global - s): the tau inner steps taken meanwhile are kept
                x = ops.clone(self._piece(w, k)) if k in self._pieces else w[k]
                gk = ops.add(x, ops.sub(ops.clone(gk), fl.snap[k]))
            if k in self._pieces:
                self.host.assign(self._pieces[k][0], self._put(w, k, gk))
            else:
                self.host.assign(k, gk if fl.snap is not None else ops.copy_(w[k], gk))

    def pack_pseudo(self, buckets: Sequence[Bucket]) -> list:
        """``global - x`` of the model x, one flat per message of ``buckets`` (members may be pieces)."""
        ops, w, a = self.ops, self.host.weights(), self.anchor
        assert a is not None, "internal: pseudo-gradient without an anchor"
        return [b.pack(ops, {k: ops.sub(ops.clone(self._piece(a, k)), self._piece(w, k)) for k in b.names})
                for b in buckets]

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
            self.outer.load_state_dict(state["outer"], self._global_pieces() if self.anchor else w)
        snaps = state.get("snapshots") or {}
        for key, fl in (state.get("flights") or {}).items():
            f = int(key)
            avg = [b.pack(ops, fl["avg"], like=self._piece(w, b.first)) for b in self.fragments[f]]
            snap = snaps.get(key)
            snap = None if snap is None else {k: ops.copy_(ops.clone(self._piece(w, k)), t) for k, t in snap.items()}
            self._flights[f] = _Flight(None, avg, snap, int(fl["arrive"]))
