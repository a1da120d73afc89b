"""OD-SGD and SSD-SGD without a parameter server: one scheduler, one code path (docs/od-sgd.md#od-sgd, docs/ssd-sgd.md#ssd-sgd).

Papers: OD-SGD, Xu, Dong, Xu, Liao, arXiv:2005.06728 (reference CynthiaProtector/OD-SGD);
SSD-SGD, arXiv:2012.05396 (reference main-520/SSD-SGD). docs/od-sgd.md#collective-equivalent and docs/ssd-sgd.md#collective-equivalent give the
collective equivalent implemented here: every rank keeps a replica of the global model w_g and
runs the (user's) global optimizer on it redundantly, with rank-identical allreduce results.

Closed form after warm-up (docs/ssd-sgd.md#update-rule), with k = ``delay`` and W = ``warmup_steps``:

    w_g(t+1)   = U_g(w_g(t), gbar(t))                        every step (round t)
    b(t)       = w_g(t)  if (t - W) % k == 0  else  w_loc(t)  (base switch)
    w_loc(t+1) = U_loc(b(t), s_loc * g_i(t))

OD-SGD is k = 1 (the same code, so T-SSD-1 holds by construction). Per step t the scheduler:

1. closes round t (its buckets were launched from the hooks during backward; the gradients were
   copied out of the framework's buffers then, so the next backward may overwrite them) and
   snapshots the optimizer hyper-parameters with it;
2. on a base-switch step, waits for and applies every round < t to the replica, in order, each
   with the hyper-parameters of *its* step (so an LR schedule acts as on a parameter server,
   and w_g does not depend on k, T-SSD-2); other steps apply nothing, so up to k+1 rounds are
   in flight, each with its own buffers and ``@r<step>`` collective names;
3. runs the local update from the base (GLU adds the global direction, below);
4. advances the step counter.

``delay=0`` disables the delay: round t is applied at step t and the model is set to the
replica, which is S-SGD bit-for-bit (T-OD-3).

Warm-up: W synchronous steps on the model. The switch (at the start of step W) copies the
model's weights into the replica; the optimizer's state (momentum, Adam moments, step counts)
becomes the replica's state as it is, because the wrapped optimizer keeps stepping with its own
state, now on the replica (the pitfall "the warm-up must copy the optimizer state", docs/od-sgd.md#pitfalls).

Which weights the model holds: w (the local weights w_loc) during training; the replica lives in
the scheduler (``global_weights()``); :meth:`finalize` drains and sets the model to w_g.
Buffers that are not parameters (BatchNorm running statistics) are not registered, so they stay
per-worker and are neither replicated nor averaged, as in the MXNet references (docs/od-sgd.md#collective-equivalent).

Conventions: the global update is the user's (PyTorch-form) optimizer and the local SGD is in
PyTorch form too; the references' MXNet form (lr inside the momentum, docs/wrapper.md#momentum-form, docs/wrapper.md#lr-conventions) is not offered.
The two agree for a constant learning rate.

GLU (SSD-SGD's "global gradient for local update"): the paper's equation could not be read and
the released kernel cannot be taken literally (docs/ssd-sgd.md#glu-reference-code), so this implements the
**recommended faithful-in-spirit form**:

    w_loc(t+1) = b(t) - lr_loc * (s_loc * g_i(t) + c * g_glob),
    g_glob     = (w_g(t_s - k) - w_g(t_s)) / (n * lr)

t_s is the last base switch, n the number of rounds applied between the two snapshots (k in
steady state) and lr the global optimizer's current lr for the tensor: the mean global step
direction of the last period, in gradient units. g_glob is 0 until two switches have happened.
"""
from __future__ import annotations

import hashlib
from collections import deque
from typing import Any, Callable

import numpy as np

from ..engine.rounds import Round
from ..errors import RankMismatchError
from ..reduce.base import Reducer
from .base import RoundPlan, RoundPort, Scheduler
from .config import DelayConfig
from .local_opt import LocalOptimizer

__all__ = ["DelayedScheduler", "digest"]

Tensor = Any


def digest(ops: Any, tensors: list) -> str:
    """sha256 over the tensors' bytes, in the order given (replica consistency checks)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(np.ascontiguousarray(ops.to_numpy(t)).tobytes())
    return h.hexdigest()


class DelayedScheduler(Scheduler):
    """OD-SGD (delay 1), SSD-SGD (delay k) and the delay-disabled replica path (delay 0)."""

    rank_local_state: tuple[str, ...] = ("local",)  # the local optimizer's momentum; the replica is shared
    rank_local_weights = True      # the model holds w_loc

    def __init__(self, config: DelayConfig, port: RoundPort):
        super().__init__(config, port)
        self.name = config.kind
        self.k = config.delay
        self.warmup = config.warmup_steps
        scale = config.local_scale if config.local_scale is not None else 1.0 / port.comm.size
        # local_momentum None mirrors the wrapped optimizer's, read per tensor at each step
        # (docs/od-sgd.md#local-defaults)
        self.local = LocalOptimizer(self.ops, config.local_optimizer, config.local_momentum or 0.0, scale,
                                    config.dc_lambda)
        self.fifo: deque[Round] = deque()
        self.replica: dict[str, Tensor] | None = None
        self.applied = 0  # rounds applied to the replica since the switch
        self._glu_prev: dict[str, Tensor] | None = None  # w_g at the previous base switch
        self._glu_dir: dict[str, Tensor] | None = None   # g_glob
        self._glu_mark = 0                               # self.applied at that switch

    # -- decisions ----------------------------------------------------------------------------
    def in_warmup(self, step: int | None = None) -> bool:
        return (self.step if step is None else step) < self.warmup

    def is_base_switch(self, step: int) -> bool:
        """b(step) = w_g(step)? (always with k <= 1)."""
        return self.k <= 1 or (step - self.warmup) % self.k == 0

    def round_plan(self) -> RoundPlan:
        if self.in_warmup():
            return RoundPlan(self.port.reducer, None)  # the synchronous path, names unchanged
        return RoundPlan(self.reducer_for(self.step), f"r{self.step}")

    def reducer_for(self, step: int) -> Reducer:
        """The reducer of round ``step`` (CD-SGD alternates ternary and full precision)."""
        return self.port.reducer

    @property
    def names(self) -> list[str]:
        return self.port.names

    # -- the step -----------------------------------------------------------------------------
    def on_step(self, closure: Callable[[], Any] | None = None, synchronize: bool = True) -> None:
        self._no_closure(closure)
        t = self.step
        if self.in_warmup(t):
            self._sync_step()
            return
        if self.replica is None:
            self._switch()
        host = self.host
        grads = host.grads()
        rnd = self.port.close_round(fetch=grads.get)
        rnd.hyper = self.step_hyper()
        self.fifo.append(rnd)
        if self.k == 0:
            self._apply_through(t)
            w = host.weights()
            for n in self.names:
                host.assign(n, self.ops.copy_(w[n], self.replica[n]))
        else:
            base = None
            if self.is_base_switch(t):
                self._apply_through(t - 1)  # the replica is now w_g(t) (T-SSD-3)
                base = self.replica
                if self.config.glu:
                    self._glu_refresh()
            self._local_update(base, grads)
        self.step += 1
        self._maybe_check_replica()

    def _switch(self) -> None:
        w = self.host.weights()
        self.replica = {n: self.ops.clone(w[n]) for n in self.names}
        self.applied = 0
        self._glu_prev = self._glu_dir = None
        self._glu_mark = 0

    def _apply_through(self, last_step: float) -> None:
        """Wait for and apply, in order, every round whose step is <= last_step."""
        while self.fifo and self.fifo[0].step <= last_step:
            rnd = self.fifo.popleft()
            grads = self.port.finish_round(rnd)
            self.host.apply_optimizer(grads, weights=self.replica, hyper=rnd.hyper)
            self.port.release_round(rnd)
            self.applied += 1

    def _local_update(self, base: dict[str, Tensor] | None, grads: dict[str, Tensor | None]) -> None:
        host, ops, cfg = self.host, self.ops, self.config
        w = host.weights()
        for n in self.names:
            g = grads.get(n)
            if g is None:  # unused parameter: zero gradient, as in the reduction
                g = ops.zeros(ops.numel(w[n]), ops.dtype_name(w[n]), like=w[n])
                g = ops.reshape(g, ops.shape(w[n]))
            lr = cfg.local_lr if cfg.local_lr is not None else host.param_hyper(n, "lr")
            wd = cfg.local_weight_decay if cfg.local_weight_decay is not None else \
                (host.param_hyper(n, "weight_decay", 0.0) or 0.0)
            glu = self._glu_dir.get(n) if self._glu_dir is not None else None
            mom: dict[str, Any] = {}
            if cfg.local_momentum is None:
                mom = dict(momentum=float(host.param_hyper(n, "momentum", 0.0) or 0.0),
                           dampening=float(host.param_hyper(n, "dampening", 0.0) or 0.0),
                           nesterov=bool(host.param_hyper(n, "nesterov", False)))
            new = self.local.update(n, w[n], None if base is None else base[n], g, lr=float(lr),
                                    weight_decay=float(wd), glu_dir=glu, glu_coef=cfg.glu, **mom)
            host.assign(n, new)

    def _glu_refresh(self) -> None:
        """At a base switch (replica = w_g(t_s)): g_glob = (w_g(prev switch) - w_g(t_s)) / (n*lr)."""
        ops, rep = self.ops, self.replica
        if self._glu_prev is None:
            self._glu_prev = {n: ops.clone(rep[n]) for n in self.names}
            self._glu_mark = self.applied
            return
        n_rounds = self.applied - self._glu_mark
        if n_rounds == 0:
            return
        new_dir = {}
        for n in self.names:
            lr = float(self.host.param_hyper(n, "lr") or 0.0)
            d = self._glu_dir[n] if self._glu_dir is not None else ops.clone(rep[n])
            d = ops.sub(ops.copy_(d, self._glu_prev[n]), rep[n])
            new_dir[n] = ops.scale(d, 1.0 / (n_rounds * lr)) if lr > 0 else ops.scale(d, 0.0)
            self._glu_prev[n] = ops.copy_(self._glu_prev[n], rep[n])
        self._glu_dir = new_dir
        self._glu_mark = self.applied

    # -- replica checks -----------------------------------------------------------------------
    def replica_digest(self) -> str | None:
        """sha256 of the replica in registration order (None before the switch)."""
        if self.replica is None:
            return None
        return digest(self.ops, [self.replica[n] for n in self.names])

    def _maybe_check_replica(self) -> None:
        every = self.config.check_replica_every
        if not every or self.step % every:
            return
        everyone = self.port.comm.allgather_object(self.replica_digest(), name=f"replica.check@{self.step}")
        if len(set(everyone)) > 1:
            bad = [r for r, d in enumerate(everyone) if d != everyone[0]]
            raise RankMismatchError(
                f"the global replica differs across ranks after step {self.step} (ranks {bad} differ from "
                f"rank 0). The allreduce results or the optimizer's arithmetic are not rank-identical "
                f"(a nondeterministic optimizer kernel, or different hyper-parameters per rank).")

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return len(self.fifo)

    def drain(self) -> None:
        if self.fifo:
            self._apply_through(float("inf"))

    def finalize(self) -> None:
        """Drain, then set the model to the global replica w_g (the local update is dropped)."""
        self.drain()
        if self.replica is not None:
            w = self.host.weights()
            for n in self.names:
                self.host.assign(n, self.ops.copy_(w[n], self.replica[n]))

    def abandon(self) -> None:
        while self.fifo:
            self.port.abandon_round(self.fifo.popleft())

    def global_weights(self) -> dict[str, Tensor] | None:
        self.drain()
        return self.replica

    def state_dict(self) -> dict:
        """Replica, local optimizer and GLU state (after a drain: no round is pending).

        Tensors are live references (as in torch's ``Optimizer.state_dict``): save or copy them.
        """
        self.drain()
        return {"kind": self.name, "replica": self.replica, "applied": self.applied,
                "local": self.local.state_dict(), "glu_prev": self._glu_prev, "glu_dir": self._glu_dir,
                "glu_mark": self._glu_mark}

    def load_state_dict(self, state: dict, step: int) -> None:
        super().load_state_dict(state, step)
        self.abandon()
        w = self.host.weights()
        ops = self.ops

        def restore(d):
            return None if d is None else {n: ops.copy_(ops.clone(w[n]), d[n]) for n in self.names}
        self.replica = restore(state.get("replica"))
        self.applied = int(state.get("applied", 0))
        self.local.load_state_dict(state.get("local") or {}, like=w)
        self._glu_prev = restore(state.get("glu_prev"))
        self._glu_dir = restore(state.get("glu_dir"))
        self._glu_mark = int(state.get("glu_mark", 0))
