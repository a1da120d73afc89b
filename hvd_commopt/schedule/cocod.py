"""CoCoD-SGD: computation and communication decoupled (docs/cocod-sgd.md#cocod-sgd).

Paper: Shen, Xu, Liu, Liang, Cheng, "Faster Distributed Deep Net Training: Computation and
Communication Decoupled Stochastic Gradient Descent", IJCAI 2019, arXiv:1906.12043. The paper's
Algorithm 1 could not be read; the update follows the third-party reference
JYWa/Overlap_Local_SGD ``distoptim/CoCoDSGD.py`` (docs/cocod-sgd.md#update-rule), with the blocking thread replaced by an
asynchronous allreduce on the communicator's progress thread (docs/cocod-sgd.md#collective).

Every step is a local step of the user's optimizer on the model x. Every ``period`` (tau) local
steps, a sync:

    wait for the average z = mean_j x_j(previous sync)        (it ran during the last tau steps)
    x <- x + (z - s)        own displacement since the last sync, on top of that average
    s <- x                   snapshot
    launch allreduce_sum(x / P) into z                          (runs during the next tau steps)

i.e. ``x_i^{n+} = xbar^{n-1} + (x_i^n - x_i^{(n-1)+})`` (docs/cocod-sgd.md#closed-form).

Choices:

* ``x + (z - s)`` instead of the reference's ``(z + x) - s``: the same in real arithmetic, but
  with identical models z == s exactly, so the update is exactly x and identical data reproduces
  single-worker SGD bit-for-bit (T-CoCoD-1; for P a power of two, where x/P summed P times is x).
* First sync (docs/cocod-sgd.md#invariants): no average exists yet, so x is unchanged and only the averaging is
  launched (T-CoCoD-4).
* Syncs happen after local steps tau, 2tau, ... (counting from the end of warm-up). The
  reference syncs first after tau + 1 steps (its ``itr`` counts calls, and it skips ``itr == 0``),
  an off-by-one listed in docs/cocod-sgd.md#pitfalls; we do not copy it.
* ``finalize()`` waits for the pending average and then averages the current models (blocking),
  so every rank ends with the same model, the mean of the workers' models.
* Checkpoints wait for the pending average first and store it (z) with the snapshot (s).
* With ``compression=`` the exchange carries the pseudo-gradient ``anchor - x`` (compressed, with
  error feedback; docs/diloco.md#compressed); on arrival ``anchor -= mean(...)`` is the new
  average z. ``finalize()`` still ends with one full-precision average.
"""
from __future__ import annotations

from ..reduce.base import Pending
from .averaging import AveragingScheduler
from .base import RoundPort
from .config import AveragingConfig

__all__ = ["CoCoDScheduler"]


class CoCoDScheduler(AveragingScheduler):
    """CoCoD-SGD: the average of sync n is computed while the next tau local steps run."""

    rank_local_state = ("s",)  # this worker's snapshot; z (the average) is shared

    def __init__(self, config: AveragingConfig, port: RoundPort):
        super().__init__(config, port)
        self._pending: list[Pending] | None = None  # the average in flight
        self._z: list | None = None   # a completed average, not yet applied (after a drain)
        self._s: list | None = None   # the snapshot s, per bucket
        self._x: list | None = None   # scratch for the packed model

    def _sync(self) -> None:
        ops = self.ops
        x = self._x = self.pack(self.host.weights(), self._x)
        if self._pending is not None or self._z is not None:
            z = self._wait()
            if self.pseudo is not None:  # z holds the mean pseudo-gradient: anchor - z is the average
                a = self.anchor
                assert a is not None
                for n, d in self.views(z).items():
                    a[n] = ops.sub(a[n], d)
                z = self.pack(a)
            for i in range(len(x)):
                x[i] = ops.add(x[i], ops.sub(z[i], self._s[i]))  # x + (z - s)
            self._z = None
            self.assign_model(x)
        if self._s is None:
            self._s = [ops.clone(f) for f in x]
        else:
            self._s = [ops.copy_(s, f) for s, f in zip(self._s, x)]
        if self.pseudo is not None:
            self._pending = self.start_exchange(self.pack_pseudo(self.port.buckets), "cocod", self.port.buckets)
        else:
            send = [ops.clone(f) for f in x]  # consumed by the collective (scaled by 1/P in place)
            self._pending = self.start_average(send, "cocod")
        self.syncs += 1

    def _wait(self) -> list:
        if self._pending is not None:
            self._z = self.finish_exchange(self._pending)
            self._pending = None
        return self._z

    @property
    def outstanding(self) -> int:
        return 1 if self._pending is not None else 0

    def drain(self) -> None:
        if self._pending is not None:
            self._wait()  # keep the completed average for the next sync (value-neutral)

    def finalize(self) -> None:
        self.drain()
        self.average_model_now("cocod.final")
        self._z = self._s = self.anchor = None  # training may continue: the next sync is a first sync again

    def abandon(self) -> None:
        if self._pending is not None:
            self.finish_exchange(self._pending)
            self._pending = None

    def state_dict(self) -> dict:
        self.drain()
        return {"kind": self.name, "syncs": self.syncs,
                "z": None if self._z is None else self.views(self._z),
                "s": None if self._s is None else self.views(self._s), **self.pseudo_state()}

    def load_state_dict(self, state: dict, step: int) -> None:
        super().load_state_dict(state, step)
        self.abandon()
        self.syncs = int(state.get("syncs", 0))
        z, s = state.get("z"), state.get("s")
        if s is None:  # per-rank state reset (docs/wrapper.md#checkpoints): the next sync is a first one
            z = None
        w = self.host.weights()  # new buffers go where the model is (a checkpoint may be on the CPU)
        self._z = None if z is None else self.pack(z, like=w)
        self._s = None if s is None else self.pack(s, like=w)
        self.load_pseudo_state(state)
