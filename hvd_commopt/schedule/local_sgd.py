"""Local SGD / periodic model averaging (docs/local-sgd.md#update-rule).

Reference: JYWa/Overlap_Local_SGD ``distoptim/LocalSGD.py`` with ``gmf == 0`` (plain averaging):
every step is a local step of the user's optimizer; every ``period`` (tau) local steps the models
are averaged, blocking: ``x <- allreduce_sum(x / P)``. Optimizer state (momentum) stays local.

Choices: the averagings follow local steps tau, 2tau, ... (the reference's first one comes after
tau + 1 steps, the off-by-one of docs/local-sgd.md#update-rule); the block-momentum variant (``gmf > 0``) is not
implemented. ``finalize()`` averages once more so every rank ends with the same model.

With ``compression=`` the pseudo-gradient ``anchor - x`` is exchanged compressed, with error
feedback, and the models become ``anchor - mean(...)`` (docs/diloco.md#compressed): DiLoCo with
the outer step ``w - Delta``.

Invariants (docs/local-sgd.md#invariants): tau = 1 with plain SGD (no momentum) equals S-SGD in real arithmetic;
identical data gives identical models equal to single-worker SGD, bit-exact when P is a power of
two and the allreduce sums pairwise.
"""
from __future__ import annotations

from .averaging import AveragingScheduler

__all__ = ["LocalSGDScheduler"]


class LocalSGDScheduler(AveragingScheduler):
    """Blocking model averaging every ``period`` local steps."""

    def _sync(self) -> None:
        self._average("local_sgd")
        self.syncs += 1

    def _average(self, label: str) -> None:
        if self.pseudo is None:
            self.average_model_now(label)
        else:
            self.average_pseudo_now(label)

    def finalize(self) -> None:
        if self.pseudo is None or self.anchor is not None:
            self._average("local_sgd.final")

    def state_dict(self) -> dict:
        return {"kind": self.name, "syncs": self.syncs, **self.pseudo_state()}

    def load_state_dict(self, state: dict, step: int) -> None:
        super().load_state_dict(state, step)
        self.syncs = int(state.get("syncs", 0))
        self.load_pseudo_state(state)
