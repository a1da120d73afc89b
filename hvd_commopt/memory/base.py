"""The memory protocols: what a reducer keeps per bucket between steps, so nothing sent is lost.

Three stores implement :class:`Memory`:

* :class:`~hvd_commopt.memory.error_feedback.ErrorFeedback`: the residual of Top-k, random-k,
  gTop-k, Ok-Topk and of CD-SGD's ternary quantizer;
* :class:`~hvd_commopt.memory.dgc.DGCMemory`: DGC's momentum and velocity (a :class:`MomentumMemory`);
* :class:`~hvd_commopt.memory.momentum.MomentumCorrection`: DGC's memory with the wrapped
  optimizer's momentum, the momentum correction of Top-k, gTop-k and LAGS (a :class:`MomentumMemory`).

Reducers call it with the bucket's name (``Bucket.name``) as the key, ``name``::

    acc = memory.compensate(ops, name, flat)          # what could be sent now (flat + residual)
    memory.update(ops, name, acc, sent_idx)           # sparse: residual = acc zeroed at sent_idx
    vals, idx = memory.compensate_select(ops, name, flat, select)   # the three fused (fuses_selection)
    memory.update_quantized(ops, name, acc, sent)     # dense lossy: residual = acc - sent
    memory.restore(ops, name, idx, vals)              # selected but not delivered: add back
    x   = memory.compensate_dense(ops, name, flat)    # all of it is sent: residual -> 0
    out = memory.finish_dense(ops, name, reduced)     # post-processing of a dense result
    memory.residual(ops, name, like)                  # the stored residual (None = zero)
    memory.snapshot(ops, name, like, step)            # before a round: a copy to roll back to
    memory.skip(name)                                 # this rank's bucket is NaN/Inf: left untouched
    memory.rollback(ops, name, step)                  # the reduced bucket is NaN/Inf: undo the round
    memory.relayout(ops, old_buckets, new_buckets)    # a re-plan: the state follows the tensors
    memory.config() / memory.state_dict() / memory.load_state_dict(state)

Declared capabilities (attributes, no probing): ``fuses_selection`` (``compensate_select`` may
replace compensate, select, update: docs/selection.md#fused-ef), ``reads_parts`` (that fused step
hands a bucket's unpacked gradients to the selection as they are: docs/selection.md#grad-parts) and
``nonfinite``, "skip" or "raise", the policy for NaN/Inf contributions (docs/wrapper.md#nonfinite):
non-finite values never enter a memory.

A :class:`MomentumMemory` applies the momentum itself (momentum correction,
docs/topk.md#momentum-correction): the reducer binds the wrapped optimizer's momentum to it when
the optimizer is attached (``Reducer.bind_host``) and the optimizer then runs without momentum.

Invariant (bit-exact, docs/topk.md#invariants): after ``update``/``update_quantized``, what was sent plus
the new residual equals ``acc``.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from ..buckets import Bucket
from ..tensor_ops import TensorOps

__all__ = ["Memory", "MomentumMemory", "SelectFn"]

Tensor = Any
#: ``select(acc, addend, out=None) -> (values, indices, acc + addend)``: the selection a fused
#: memory step calls, the sum made in its candidate pass (into ``out`` when given).
SelectFn = Callable[..., tuple[Tensor, Tensor, Tensor]]


@runtime_checkable
class Memory(Protocol):
    """Per-bucket state that carries what was not sent into later steps."""

    nonfinite: str

    @property
    def fuses_selection(self) -> bool:
        """:meth:`compensate_select` may stand for compensate + select + update (False: a memory
        that remembers nothing, e.g. ``ErrorFeedback(enabled=False)``)."""
        ...

    @property
    def reads_parts(self) -> bool:
        """:meth:`compensate_select` passes a bucket's unpacked gradients to the selection as they are."""
        ...

    def compensate(self, ops: TensorOps, name: str, flat: Tensor) -> Tensor:
        """The tensor to select from: ``flat`` plus what is remembered (into flat allowed)."""
        ...

    def update(self, ops: TensorOps, name: str, acc: Tensor, sent_idx: Tensor) -> None:
        """A sparse selection of ``acc`` at ``sent_idx`` was sent; remember the rest."""
        ...

    def compensate_select(self, ops: TensorOps, name: str, flat: Tensor, select: SelectFn) -> tuple[Tensor, Tensor]:
        """:meth:`compensate`, ``select`` and :meth:`update` with the add fused into the selection's
        pass (docs/selection.md#fused-ef), bit-identical to the three steps; ``(values, indices)``."""
        ...

    def update_quantized(self, ops: TensorOps, name: str, acc: Tensor, sent: Tensor) -> None:
        """A lossy dense encoding of ``acc`` was sent, worth ``sent`` locally; remember acc - sent."""
        ...

    def restore(self, ops: TensorOps, name: str, idx: Tensor, vals: Tensor) -> None:
        """Values that were selected but not delivered (gTop-k's dropped entries) come back."""
        ...

    def compensate_dense(self, ops: TensorOps, name: str, flat: Tensor) -> Tensor:
        """Everything is sent this step (density 1, a lossless correction): the tensor to send."""
        ...

    def finish_dense(self, ops: TensorOps, name: str, reduced: Tensor) -> Tensor:
        """Post-process the reduced result of a :meth:`compensate_dense` step."""
        ...

    def snapshot(self, ops: TensorOps, name: str, like: Tensor, step: int) -> None:
        """Copy the state of ``name`` before round ``step`` (what :meth:`rollback` restores)."""
        ...

    def skip(self, name: str) -> None:
        """This rank's bucket was not finite this round: the state of ``name`` stays as it is."""
        ...

    def rollback(self, ops: TensorOps, name: str, step: int) -> bool:
        """Round ``step``'s reduced bucket was not finite: restore the snapshot (False when a
        later round has already replaced it)."""
        ...

    def residual(self, ops: TensorOps, name: str, like: Tensor) -> Tensor | None:
        """What is remembered for ``name`` (None = nothing), for tests and diagnostics."""
        ...

    def residuals(self) -> dict[str, Tensor]:
        """Everything remembered, by bucket name (for tests and diagnostics)."""
        ...

    def relayout(self, ops: TensorOps, old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
        """The bucket layout changed from ``old`` to ``new`` (a re-plan): move every tensor's part
        of the state into its new bucket (docs/lags-omgs.md#replan-residuals)."""
        ...

    def config(self) -> dict:
        """The configuration as plain values (compared across ranks)."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class MomentumMemory(Memory, Protocol):
    """A memory that applies the momentum itself (momentum correction, docs/topk.md#momentum-correction),
    so the wrapped optimizer must run without its own (docs/dgc.md#optimizer-momentum).

    Attributes:
        momentum, nesterov: μ and the Nesterov form in use.
        from_optimizer: μ is the wrapped optimizer's, bound by :meth:`bind_momentum`.
        auto: where the optimizer cannot run without its momentum (Keras), fall back to error
            feedback (μ = 0, the optimizer keeps its momentum) instead of refusing.
    """

    momentum: float
    nesterov: bool
    from_optimizer: bool
    auto: bool

    def bind_momentum(self, momentum: float, nesterov: bool = False) -> None:
        """Take μ and Nesterov from the wrapped optimizer."""
        ...

    def restore_momentum(self, ops: TensorOps, name: str, step: int, dropped: Tensor) -> None:
        """The entries of round ``step``'s selection that the exchange dropped (positions, or a
        bool mask over the selection) get back the momentum that factor masking zeroed: masking
        is for what was applied (docs/gtopk.md#masking-delivered)."""
        ...
