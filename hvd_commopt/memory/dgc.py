"""DGC's memory: momentum correction, momentum factor masking and local gradient clipping.

Paper: Deep Gradient Compression (Lin, Han, Mao, Wang, Dally; ICLR 2018, arXiv:1712.01887),
transcribed from ``dgc/memory.py`` and ``dgc/clip_grad.py`` of synxlin/deep-gradient-compression
(docs/dgc.md#update-rule). The reducer uses it instead of plain error feedback:
**momentum correction** ``u = μu + g; v = v + u`` (Nesterov: ``u = μ(u+g); v += u + g``),
optional **local gradient clipping** by L2 norm before it, and after sending ``v[idx] = 0`` and,
with **momentum factor masking**, ``u[idx] = 0``; entries an exchange then drops (gTop-k's merge,
Ok-Topk's) get their momentum back with their value (:meth:`DGCMemory.restore_momentum`,
docs/gtopk.md#masking-delivered). What is sent is chosen by a selector
(:class:`~hvd_commopt.compress.dgc.DGCSelector`, or Top-k's for momentum correction).

Buckets whose ratio is 1 go the reference's dense way: allreduce(average) of the plain gradient,
then momentum applied to the average (``compensate(accumulate=False)``), so the result equals
momentum SGD. DGC applies momentum itself, so the wrapped optimizer must not apply it again:
``momentum=None`` takes μ (and Nesterov) from the wrapped optimizer and the reducer runs that
optimizer without momentum (``Reducer.bind_host``, docs/dgc.md#optimizer-momentum). The HKBU code
scales the clipping norm by sqrt(1/P); pass ``clip_norm`` already scaled for that variant.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

from ..buckets import Bucket
from ..select.addend import MomentumAddend
from ..select.grad_parts import GradParts
from ..select.kernels import device_route
from ..compress.nonfinite import check_policy
from ..errors import ConfigError
from ..tensor_ops import TensorOps
from .error_feedback import Generations, TensorStore
from .relayout import relayout_flats
from .sent import zero_sent

__all__ = ["DGCMemory"]


class DGCMemory:
    """DGC's momentum correction, momentum factor masking and local clipping (``dgc/memory.py``),
    a :class:`~hvd_commopt.memory.base.MomentumMemory`.

    The velocity ``v`` plays the residual's role: what is not sent stays in ``v``. Invariant
    (bit-exact): ``scatter(idx, v_before[idx]) + v_after == v_before``.

    Args:
        momentum: μ (0.9); None: the wrapped optimizer's, bound by the reducer when the optimizer
            is attached (:meth:`bind_momentum`).
        nesterov: Nesterov form ``u = μ(u+g); v += u + g``.
        momentum_masking: zero ``u`` where values were sent (the paper's momentum factor masking).
        clip_norm: clip each bucket's local gradient to this L2 norm first (None = no clipping).
        nonfinite: "skip" (default) or "raise": a NaN/Inf gradient never enters ``u`` or ``v``
            (docs/wrapper.md#nonfinite).
    """

    def __init__(self, momentum: float | None = 0.9, nesterov: bool = False, momentum_masking: bool = True,
                 clip_norm: float | None = None, nonfinite: str = "skip"):
        if momentum is not None and not 0.0 <= momentum < 1.0:
            raise ConfigError(f"DGC momentum must be in [0, 1) or None (the wrapped optimizer's), got {momentum}")
        if clip_norm is not None and not clip_norm > 0:
            raise ConfigError(f"clip_norm must be > 0 (or None for no clipping), got {clip_norm}")
        self.from_optimizer = momentum is None
        self._bound = momentum is not None
        self.momentum = 0.0 if momentum is None else float(momentum)
        self.nesterov = bool(nesterov)
        self.momentum_masking = bool(momentum_masking)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.nonfinite = check_policy(nonfinite)
        self._u = TensorStore("DGC momentum")
        self._v = TensorStore("DGC velocity")
        self._snaps = (Generations(self._u), Generations(self._v))
        self._skipped: set[str] = set()
        self._warned_no_momentum = False
        # masking's record of the last round, for the entries an exchange drops later
        # (docs/gtopk.md#masking-delivered): name -> (round, sent indices, momentum masked there)
        self._round: dict[str, int] = {}
        self._masked: dict[str, tuple[int, Any, Any]] = {}

    fuses_selection = True  # compensate_select: the fused step of select_with_memory
    auto = False  # set by MomentumCorrection: falls back to error feedback where it cannot switch

    @property
    def reads_parts(self) -> bool:
        """:meth:`compensate_select` hands a bucket's unpacked gradients (:class:`GradParts`) to the
        selection as they are: no clipping or Nesterov pass reads them first (docs/selection.md#grad-parts)."""
        return self.clip_norm is None and not self.nesterov

    def snapshot(self, ops: TensorOps, name: str, like: Any, step: int) -> None:
        """Keep ``u`` and ``v`` before round ``step`` (for :meth:`rollback`); no copy: the round
        writes its new ``u`` and ``v`` into second buffers (:class:`Generations`)."""
        self._skipped.discard(name)
        self._round[name] = step
        for s in self._snaps:
            s.take(ops, name, like, step)

    def skip(self, name: str) -> None:
        self._skipped.add(name)

    def rollback(self, ops: TensorOps, name: str, step: int) -> bool:
        """Round ``step`` came back non-finite: ``u`` and ``v`` go back to their snapshots."""
        return all([s.restore(name, step) for s in self._snaps])

    def bind_momentum(self, momentum: float, nesterov: bool = False) -> None:
        """Take μ and Nesterov from the wrapped optimizer (``momentum=None`` at construction)."""
        if not 0.0 <= momentum < 1.0:
            raise ConfigError(f"the wrapped optimizer's momentum must be in [0, 1) for momentum correction, "
                              f"got {momentum}")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)
        self._bound = True
        self._check_bound()  # warns, once, when the momentum bound here is 0

    def _check_bound(self) -> None:
        """Refuse a momentum that was never bound; warn once when the wrapped optimizer's momentum,
        taken because none was given, is 0: DGC then runs with no momentum anywhere, which its
        paper's usage (momentum inside DGC, optimizer without it) silently becomes when the
        optimizer follows the paper but the compression is left at momentum=None
        (docs/dgc.md#no-momentum). :class:`~hvd_commopt.memory.momentum.MomentumCorrection`
        overrides this: there μ = 0 is plain error feedback, by design."""
        if self._bound and self.from_optimizer and self.momentum == 0.0 and not self._warned_no_momentum:
            self._warned_no_momentum = True
            warnings.warn("Compression.dgc() takes its momentum from the wrapped optimizer (momentum=None), and "
                          "that optimizer has none (momentum 0, or no momentum hyper-parameter): DGC "
                          "runs with no momentum at all (docs/dgc.md#no-momentum). Pass the momentum to DGC, "
                          "Compression.dgc(..., momentum=0.9), or give the optimizer its momentum "
                          "(SGD(..., momentum=0.9); DGC then applies it itself); pass momentum=0.0 to train "
                          "without it on purpose. (Under Adam and kin this does not warn: their first moment is "
                          "the momentum, docs/adaptive-optimizers.md#adaptive-optimizers.)",
                          RuntimeWarning, stacklevel=2)
        if not self._bound:
            raise ConfigError("this compression takes its momentum from the wrapped optimizer (momentum=None), "
                              "but no optimizer is attached (DistributedGradientTape, reduce_step): pass the "
                              "momentum explicitly, e.g. Compression.dgc(..., momentum=0.9), and step an "
                              "optimizer without momentum")

    def _clip(self, ops: TensorOps, g: Any) -> Any:
        if self.clip_norm is None:
            return g
        if device_route(ops, g):  # the norm stays a device tensor (docs/dgc.md#clip-on-device)
            return ops.clip_to_norm_(g, self.clip_norm, 1e-6)
        coef = self.clip_norm / (ops.norm(g) + 1e-6)  # dgc/clip_grad.py: clip_grad_norm_
        return ops.scale(g, coef) if coef < 1 else g

    def _buffer(self, store: TensorStore, ops: TensorOps, name: str, like: Any) -> Any:
        t = store.get(ops, name, like)
        return ops.zeros(ops.numel(like), ops.dtype_name(like), like=like) if t is None else t

    def _momentum(self, ops: TensorOps, name: str, g: Any) -> Any:
        """``u = μu + g`` (Nesterov ``u = μ(u+g)``), written outside the snapshot, stored."""
        u_old = self._buffer(self._u, ops, name, g)
        if self.nesterov:
            u = ops.scale(ops.add(self._snaps[0].writable(ops, name, u_old), g), self.momentum)
        else:
            buf = self._snaps[0].free(ops, name, u_old)
            if buf is None:
                buf = ops.empty(ops.numel(u_old), ops.dtype_name(u_old), like=u_old)
            u = ops.scale_add_into(buf, u_old, self.momentum, g)
        self._u.set(name, u)
        return u

    def compensate(self, ops: TensorOps, name: str, flat: Any) -> Any:
        self._check_bound()
        g = self._clip(ops, flat)
        u = self._momentum(ops, name, g)
        v = self._snaps[1].writable(ops, name, self._buffer(self._v, ops, name, g))
        v = ops.add(v, u)
        if self.nesterov:
            v = ops.add(v, g)
        self._v.set(name, v)
        return v

    def compensate_select(self, ops: TensorOps, name: str, flat: Any, select: Any) -> tuple[Any, Any]:
        """:meth:`compensate` + select + :meth:`update` with ``v + u`` fused into the selection's
        candidate pass and written straight into ``v``'s second buffer (docs/selection.md#fused-ef);
        on host memory ``u = mu*u + g`` is made in that pass too (docs/selection.md#native-sweep).

        ``select(acc, addend, out=None)`` returns ``(values, indices, acc + addend)``, the sum made
        in its candidate pass, into ``out`` when given. Bit-identical to the three steps: the same
        sums in the same order (Nesterov's ``(v + u) + g`` adds ``u`` first, then fuses ``+ g``).
        """
        self._check_bound()
        g = self._clip(ops, flat if self.reads_parts or not isinstance(flat, GradParts) else flat.pack())
        like = g.buf if isinstance(g, GradParts) else g  # unpacked gradients: only the selection reads them
        v_old = self._buffer(self._v, ops, name, like)
        if self.nesterov:
            u = self._momentum(ops, name, g)
            vals, idx, v = select(ops.add(self._snaps[1].writable(ops, name, v_old), u), g)
        else:
            # u' = mu*u + g is made in the selection's pass where the host kernel can
            # (compress/addend.py), into the buffer _momentum would use
            u_old = self._buffer(self._u, ops, name, like)
            ubuf = self._snaps[0].free(ops, name, u_old)
            if ubuf is None:
                ubuf = ops.empty(ops.numel(u_old), ops.dtype_name(u_old), like=u_old)
            u = MomentumAddend(u_old, self.momentum, g, ubuf)
            buf = self._snaps[1].free(ops, name, v_old)
            if buf is v_old:
                vals, idx, v = select(v_old, u)
            else:
                if buf is None:
                    buf = ops.empty(ops.numel(v_old), ops.dtype_name(v_old), like=v_old)
                vals, idx, v = select(v_old, u, buf)
            self._u.set(name, u.make(ops))
        self.update(ops, name, v, idx)
        return vals, idx

    def update(self, ops: TensorOps, name: str, acc: Any, sent_idx: Any) -> None:
        """``acc`` is :meth:`compensate`'s ``v`` (outside the snapshot): zero the sent positions."""
        self._v.set(name, zero_sent(ops, acc, sent_idx))
        if self.momentum_masking:
            u = self._u.get(ops, name, acc)
            # what masking takes away, kept for :meth:`restore_momentum` (k values, a gather)
            self._masked[name] = (self._round.get(name, -1), sent_idx, ops.gather(u, sent_idx))
            self._u.set(name, zero_sent(ops, u, sent_idx))

    def update_quantized(self, ops: TensorOps, name: str, acc: Any, sent: Any) -> None:
        raise ConfigError("DGC's memory serves sparse selections; a dense quantizer takes ErrorFeedback()")

    def restore(self, ops: TensorOps, name: str, idx: Any, vals: Any) -> None:
        """Selected values that were not delivered go back into the velocity."""
        if ops.numel(idx) and name not in self._skipped:
            self._v.set(name, ops.scatter_add(self._v.live(name), idx, vals))

    def restore_momentum(self, ops: TensorOps, name: str, step: int, dropped: Any) -> None:
        """Masking is for what was applied (docs/gtopk.md#masking-delivered): the entries of round
        ``step``'s selection that the exchange dropped get back the momentum :meth:`update` zeroed,
        ``u[idx] = 0 + u_masked``, bit for bit the momentum they had. ``dropped``: positions in the
        selection (int64, host route) or a bool mask over its k entries (the device route). Nothing
        happens without masking, for a skipped round, or when a later round of the bucket has
        already selected (a delayed schedule's late finish: the momentum then stays masked)."""
        rec = self._masked.get(name)
        if rec is None or rec[0] != step or self._round.get(name) != step or name in self._skipped:
            return
        del self._masked[name]
        _, idx, u_sent = rec
        if ops.dtype_name(dropped) == "bool":  # every entry, +0.0 added where it was delivered
            back = ops.where(dropped, u_sent, ops.zeros(ops.numel(u_sent), ops.dtype_name(u_sent), like=u_sent))
            self._u.set(name, ops.scatter_add(self._u.live(name), idx, back))
        elif ops.numel(dropped):
            self._u.set(name, ops.scatter_add(self._u.live(name), ops.gather(idx, dropped), ops.gather(u_sent, dropped)))

    def compensate_dense(self, ops: TensorOps, name: str, flat: Any) -> Any:
        return flat  # the reference sends uncompressed tensors as they are ...

    def finish_dense(self, ops: TensorOps, name: str, reduced: Any) -> Any:
        # ... and applies clipping and momentum to the average (compensate(accumulate=False))
        self._check_bound()
        g = self._clip(ops, reduced)
        u = self._momentum(ops, name, g)
        if self.nesterov:
            return ops.add(ops.clone(u), g)
        if device_route(ops, reduced):  # the caller may still pick ``reduced`` by a device flag
            return ops.clone(u)
        # host memory: ``reduced`` is this round's own buffer, so u goes into it, a copy into warm
        # memory instead of a fresh allocation (docs/auto-compression.md#dense-path); same values
        return ops.copy_(reduced, u)

    def residual(self, ops: TensorOps, name: str, like: Any) -> Any | None:
        return self._v.get(ops, name, like)

    def residuals(self) -> dict[str, Any]:
        """The velocities in use (what was not sent yet), by bucket name, as
        ``ErrorFeedback.residuals`` (for tests and diagnostics)."""
        return {n: self._v.live(n) for n in self._v.names() if self._v.live(n) is not None}

    def relayout(self, ops: TensorOps, old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
        """A re-plan: each tensor's momentum and velocity move into its new bucket
        (docs/lags-omgs.md#replan-residuals)."""
        u = relayout_flats(ops, self._u.state_dict(), old, new)
        v = relayout_flats(ops, self._v.state_dict(), old, new)
        if u is not None or v is not None:
            self.load_state_dict({"momentums": self._u.state_dict() if u is None else u,
                                  "velocities": self._v.state_dict() if v is None else v})

    def config(self) -> dict:
        return {"name": "dgc_memory", "momentum": "optimizer" if self.from_optimizer else self.momentum,
                "nesterov": self.nesterov,
                "momentum_masking": self.momentum_masking, "clip_norm": self.clip_norm,
                "nonfinite": self.nonfinite}

    def state_dict(self) -> dict:
        return {"momentums": self._u.state_dict(), "velocities": self._v.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._masked.clear()
        for s in self._snaps:
            s.clear()
        self._u.load_state_dict(dict(state.get("momentums", {})))
        self._v.load_state_dict(dict(state.get("velocities", {})))

    def __repr__(self) -> str:
        return (f"DGCMemory(momentum={self.momentum}, nesterov={self.nesterov}, "
                f"momentum_masking={self.momentum_masking}, clip_norm={self.clip_norm})")
