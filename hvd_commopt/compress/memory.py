"""The memory protocol: what a reducer keeps per bucket between steps, so nothing sent is lost.

Three stores implement it: :class:`~hvd_commopt.compress.error_feedback.ErrorFeedback` (the
residual of Top-k, random-k, gTop-k and of CD-SGD's ternary quantizer), and
:class:`~hvd_commopt.compress.dgc.DGCMemory` (DGC's momentum and velocity). Reducers call it
with the bucket's name (``Bucket.name``) as the key::

    acc = memory.compensate(ops, key, flat)          # what could be sent now (flat + residual)
    memory.update(ops, key, acc, sent_idx)           # sparse: residual = acc zeroed at sent_idx
    memory.update_quantized(ops, key, acc, sent)     # dense lossy: residual = acc - sent
    memory.restore(ops, key, idx, vals)              # selected but not delivered: add back
    x   = memory.compensate_dense(ops, key, flat)    # all of it is sent: residual -> 0
    out = memory.finish_dense(ops, key, reduced)     # post-processing of a dense result
    memory.residual(ops, key, like)                  # the stored residual (None = zero)
    memory.snapshot(ops, key, like, step)            # before a round: a copy to roll back to
    memory.skip(key)                                 # this rank's bucket is NaN/Inf: left untouched
    memory.rollback(ops, key, step)                  # the reduced bucket is NaN/Inf: undo the round
    memory.config() / memory.state_dict() / memory.load_state_dict(state)

``memory.nonfinite`` ("skip" or "raise") is the policy for NaN/Inf contributions
(docs/wrapper.md#nonfinite): non-finite values never enter a memory.

Invariant (bit-exact, docs/topk.md#invariants): after ``update``/``update_quantized``, what was sent plus
the new residual equals ``acc``.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..tensor_ops import TensorOps

__all__ = ["Memory"]

Tensor = Any


@runtime_checkable
class Memory(Protocol):
    """Per-bucket state that carries what was not sent into later steps."""

    def compensate(self, ops: TensorOps, key: str, flat: Tensor) -> Tensor:
        """The tensor to select from: ``flat`` plus what is remembered (into flat allowed)."""
        ...

    def update(self, ops: TensorOps, key: str, acc: Tensor, sent_idx: Tensor) -> None:
        """A sparse selection of ``acc`` at ``sent_idx`` was sent; remember the rest."""
        ...

    def update_quantized(self, ops: TensorOps, key: str, acc: Tensor, sent: Tensor) -> None:
        """A lossy dense encoding of ``acc`` was sent, worth ``sent`` locally; remember acc - sent."""
        ...

    def restore(self, ops: TensorOps, key: str, idx: Tensor, vals: Tensor) -> None:
        """Values that were selected but not delivered (gTop-k's dropped entries) come back."""
        ...

    def compensate_dense(self, ops: TensorOps, key: str, flat: Tensor) -> Tensor:
        """Everything is sent this step (density 1, a lossless correction): the tensor to send."""
        ...

    def finish_dense(self, ops: TensorOps, key: str, reduced: Tensor) -> Tensor:
        """Post-process the reduced result of a :meth:`compensate_dense` step."""
        ...

    nonfinite: str

    def snapshot(self, ops: TensorOps, key: str, like: Tensor, step: int) -> None:
        """Copy the state of ``key`` before round ``step`` (what :meth:`rollback` restores)."""
        ...

    def skip(self, key: str) -> None:
        """This rank's bucket was not finite this round: the state of ``key`` stays as it is."""
        ...

    def rollback(self, ops: TensorOps, key: str, step: int) -> bool:
        """Round ``step``'s reduced bucket was not finite: restore the snapshot (False when a
        later round has already replaced it)."""
        ...

    def residual(self, ops: TensorOps, key: str, like: Tensor) -> Tensor | None:
        """What is remembered for ``key`` (None = nothing), for tests and diagnostics."""
        ...

    def config(self) -> dict:
        """The configuration as plain values (compared across ranks)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
