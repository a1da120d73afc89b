"""Momentum correction for any sparse reducer (docs/topk.md#momentum-correction).

DGC's memory (:class:`~hvd_commopt.memory.dgc.DGCMemory`: ``u = μu + g; v += u``, send the
selection of ``v``, zero ``v`` (and with masking ``u``) where sent) is the momentum correction of
the DGC and gTop-k reference code. :class:`MomentumCorrection` is that memory as an option of
Top-k, gTop-k and LAGS (``Compression.topk/gtopk(momentum_correction=...)``), and of any reducer
built on :class:`~hvd_commopt.reduce.sparse.SparseReducer`: the reducer's ``select()`` prologue
calls ``memory.compensate`` / ``memory.update`` and ``memory.restore`` for values dropped later,
so a new sparse reducer gets the correction by taking this memory.

The momentum is the wrapped optimizer's: the reducer binds it when the optimizer is attached and
the scheduler runs the optimizer without momentum (``Reducer.bind_host``,
:func:`hvd_commopt.reduce.momentum.bind_momentum_memory`).
Unlike DGC's own memory, with no optimizer attached (``DistributedGradientTape``,
``reduce_step``) it runs with μ = 0, which is plain error feedback (the gradients are returned
to a caller who applies its own optimizer).
"""
from __future__ import annotations

from .dgc import DGCMemory

__all__ = ["MomentumCorrection"]


class MomentumCorrection(DGCMemory):
    """DGC's memory with the momentum taken from the wrapped optimizer (0 until one is attached).

    Args:
        momentum_masking: zero the momentum where values were sent (DGC's factor masking).
        auto: the correction was not asked for explicitly (``momentum_correction=None``): where the
            adapter cannot run the optimizer without its momentum (Keras), fall back to error
            feedback with the optimizer's own momentum instead of refusing.
    """

    def __init__(self, momentum_masking: bool = True, auto: bool = False, nonfinite: str = "skip"):
        super().__init__(momentum=None, momentum_masking=momentum_masking, nonfinite=nonfinite)
        self.auto = bool(auto)

    def _check_bound(self) -> None:
        """Unbound: μ = 0, error feedback (see the module docstring)."""

    def config(self) -> dict:
        return {**super().config(), "name": "momentum_correction"}

    def __repr__(self) -> str:
        return f"MomentumCorrection(momentum={self.momentum}, momentum_masking={self.momentum_masking})"
