"""CD-SGD: OD-SGD's one-step delay + ternary gradients with error feedback + k-step correction.

Paper: Yu, Dong, Xu, Ouyang, Liao, "CD-SGD: Distributed Stochastic Gradient Descent with
Compression and Delay Compensation", arXiv:2106.10796; reference Tugraph/CD-SGD (docs/cd-sgd.md#cd-sgd).

Per step t after warm-up (OD-SGD's structure, :mod:`hvd_commopt.schedule.delayed`, k = 1):
the local update uses the full-precision local gradient; round t is reduced

* in full precision when ``t % correction_every == 0`` (the "k-step correction"; the reference's
  ``count % compress_steps`` on the global iteration count), else
* as ternary signs with error feedback, summed exactly as an integer allreduce:
  ``DenseAllreduce(TernaryCompressor(theta, P), ErrorFeedback())``
  (:mod:`hvd_commopt.compress.ternary`, docs/cd-sgd.md#update-rule, docs/cd-sgd.md#collective-equivalent).

Warm-up steps are synchronous and uncompressed (the reference's ``count <= 1000``).

Residual on correction steps (``flush_residual_on_correction``): False (default, the reference
code): the raw gradient is sent and the residual is neither flushed nor updated; it keeps feeding
later compressed steps. True: the correction sends ``g + r`` and zeroes ``r``
(``DenseAllreduce(NoneCompressor(), memory)`` with the ternary reducer's memory), so nothing is
left behind after a correction step.

Residuals are keyed by bucket name (``Bucket.name``): every round of a bucket shares one.
"""
from __future__ import annotations

from ..compress.cast import NoneCompressor
from ..memory.error_feedback import ErrorFeedback
from ..compress.ternary import TernaryCompressor
from ..reduce.base import Reducer
from ..reduce.dense import DenseAllreduce
from .base import RoundPort
from .config import CDConfig
from .delayed import DelayedScheduler

__all__ = ["CDScheduler"]


class CDScheduler(DelayedScheduler):
    """OD-SGD's scheduler with CD-SGD's per-round choice of reducer."""

    rank_local_state = ("local", "ternary")  # + the ternary error feedback (docs/wrapper.md#checkpoints)

    def __init__(self, config: CDConfig, port: RoundPort):
        super().__init__(config, port)
        self.ternary = DenseAllreduce(TernaryCompressor(config.theta, port.comm.size), ErrorFeedback())
        # port.reducer was checked to be an uncompressed DenseAllreduce by build_scheduler
        self.correction = (DenseAllreduce(NoneCompressor(), self.ternary.memory)
                           if config.flush_residual_on_correction else port.reducer)

    def reducer_for(self, step: int) -> Reducer:
        return self.correction if step % self.config.correction_every == 0 else self.ternary

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["ternary"] = self.ternary.state_dict()
        return sd

    def load_state_dict(self, state: dict, step: int) -> None:
        super().load_state_dict(state, step)
        self.ternary.load_state_dict(state.get("ternary") or {})
