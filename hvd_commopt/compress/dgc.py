"""DGC: Deep Gradient Compression (Lin, Han, Mao, Wang, Dally; ICLR 2018, arXiv:1712.01887).

Transcribed from the paper's repository, synxlin/deep-gradient-compression
(``dgc/compression.py``, ``dgc/memory.py``, ``dgc/clip_grad.py``), docs/dgc.md#update-rule. Two parts:

* :class:`DGCCompressor` chooses what to send: a **sampled threshold** (the top
  ``ceil(num_samples·ratio)`` of strided samples with a random start) selects ``|v| >= thr``;
  if more than 1.3·k are selected the exact top-k among them is taken (``resample``), if fewer
  than 0.8·k the threshold is multiplied by 0.8, at most 10 times; the result is truncated to
  ``k = ceil(n·ratio)`` (DGC's rule, not Top-k's ``int``). Plus the **sparsity warm-up**.
* :class:`DGCMemory` is the memory the reducer uses instead of plain error feedback:
  **momentum correction** ``u = μu + g; v = v + u`` (Nesterov: ``u = μ(u+g); v += u + g``),
  optional **local gradient clipping** by L2 norm before it, and after sending
  ``v[idx] = 0`` and, with **momentum factor masking**, ``u[idx] = 0``.

Buckets whose ratio is 1 go the reference's dense way: allreduce(average) of the plain gradient,
then momentum applied to the average (``compensate(accumulate=False)``), so the result equals
momentum SGD. DGC applies momentum itself, so the wrapped optimizer must not apply it again:
``momentum=None`` (``Compression.dgc``'s default) takes μ (and Nesterov) from the wrapped
optimizer and the scheduler runs that optimizer without momentum (docs/dgc.md#optimizer-momentum);
the reference's ``DGCSGD`` likewise adds only weight decay. The same memory is Top-k's, gTop-k's and
LAGS's momentum correction (docs/topk.md#momentum-correction).

Sparsity warm-up and the documented discrepancy (docs/dgc.md#sparsity-warm-up): the README lists the
exponential schedule ``0.25, 0.063, 0.015, 0.004, 0.001``, but the code's default (used when
``warmup_coeff`` is None) is ``ratio_e = max(r^((e+1)/(W+1)), r)``, i.e. ``0.316, 0.1, 0.0316,
0.01, 0.00316`` for r = 0.001, W = 5 (no 0.25 first). We follow the **code**; pass
``warmup_coeff=[0.25, 0.063, 0.015, 0.004, 0.001]`` for the README's schedule. A scalar
``warmup_coeff`` c gives ``max(c^(e+1), r)``, as in the code. The epoch comes from
``set_epoch(e)`` or from the round's step (the optimizer step) and ``steps_per_epoch``.

Other choices: the sample start is drawn from a generator seeded with (seed, bucket, step), so a
run is reproducible (the reference uses Python's unseeded ``random``; ranks need not agree since
DGC exchanges indices). DGC's reference compresses only ``dim > 1`` tensors; buckets here are
flat, so give biases ratio 1 with a per-layer density (``{"fc.bias": 1.0, "default": 0.001}``
or a callable). The HKBU code scales the clipping norm by sqrt(1/P); pass ``clip_norm`` already
scaled for that variant.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..buckets import Bucket
from ..errors import ConfigError
from ..tensor_ops import TensorOps
from ..select.addend import MomentumAddend
from ..select.sampled import sampled_select
from .error_feedback import Generations, TensorStore
from ..select.grad_parts import GradParts
from .nonfinite import check_policy
from ..select.strategies import SelectionStrategy as Selection
from .topk import Density, SparseCompressor, check_density

__all__ = ["DGCCompressor", "DGCMemory", "warmup_ratio"]


def warmup_ratio(base: float, epoch: int, warmup_epochs: int,
                 warmup_coeff: float | Sequence[float] | None = None) -> float:
    """DGC's compress ratio at ``epoch`` (``dgc/compression.py: warmup_compress_ratio``)."""
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return base
    if isinstance(warmup_coeff, (list, tuple)):
        return float(warmup_coeff[epoch])
    coeff = base ** (1.0 / (warmup_epochs + 1)) if warmup_coeff is None else float(warmup_coeff)  # type: ignore[arg-type]  # a Sequence was taken above
    return max(coeff ** (epoch + 1), base)


class DGCCompressor(SparseCompressor):
    """DGC's selection: sampled threshold with adaptation, and the sparsity warm-up.

    Args:
        density: the final compress ratio r (float, per-layer dict or callable), in (0, 1].
        sample_ratio: fraction of elements sampled for the threshold (clamped to [0.01, 1]).
        strided_sample: strided samples with a random start (True) or uniform random samples.
        compress_upper_bound / compress_lower_bound: the 1.3 / 0.8 adaptation bounds.
        max_adaptation_iters: at most this many threshold adaptations (10).
        resample: above the upper bound, take the exact top-k of the selected elements.
        warmup_epochs: epochs of sparsity warm-up (0 = none).
        warmup_coeff: None (the code's schedule), a scalar, or one ratio per warm-up epoch.
        steps_per_epoch: derive the epoch from the bucket's step number (else call set_epoch).
        seed: seeds the sample start.
        selection: "sampled" (DGC's own, above), "exact" or "threshold" (docs/selection.md),
            with ``k = ceil(n·ratio)`` in every mode; ``tau``/``band`` for "threshold".
    """

    name = "dgc"

    def __init__(self, density: Density = 0.001, sample_ratio: float = 0.01, strided_sample: bool = True,
                 compress_upper_bound: float = 1.3, compress_lower_bound: float = 0.8,
                 max_adaptation_iters: int = 10, resample: bool = True, warmup_epochs: int = 0,
                 warmup_coeff: float | Sequence[float] | None = None, steps_per_epoch: int | None = None,
                 seed: int = 0, selection: str = "sampled", tau: int = 16, band: float = 0.2,
                 dense_1d: bool = True):
        super().__init__(density, 1, dense_1d)
        self.selection = Selection(selection, tau, band, sampled=self.sampled_select)
        self.sample_ratio = min(max(float(sample_ratio), 0.01), 1.0)
        self.strided_sample = bool(strided_sample)
        self.upper, self.lower = float(compress_upper_bound), float(compress_lower_bound)
        self.max_adaptation_iters = int(max_adaptation_iters)
        self.resample = bool(resample)
        self.warmup_epochs = int(warmup_epochs)
        if isinstance(warmup_coeff, (list, tuple)):
            if len(warmup_coeff) < self.warmup_epochs:
                raise ConfigError(f"warmup_coeff lists {len(warmup_coeff)} ratios but warmup_epochs="
                                  f"{self.warmup_epochs}; give one ratio per warm-up epoch")
            warmup_coeff = [check_density(c, "warmup_coeff entry") for c in warmup_coeff]
        elif warmup_coeff is not None:
            warmup_coeff = check_density(warmup_coeff, "warmup_coeff")
        self.warmup_coeff = warmup_coeff
        if steps_per_epoch is not None and int(steps_per_epoch) < 1:
            raise ConfigError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        self.steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)
        self.seed = int(seed)
        self._epoch: int | None = None
        self.guesses: dict[str, float] = {}  # bucket -> where its next sweep starts (speed only; dgc_select)

    # -- schedule -----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Tell the warm-up which epoch starts (call it at the start of every epoch)."""
        self._epoch = int(epoch)

    def epoch(self, step: int) -> int:
        if self._epoch is not None:
            return self._epoch
        if self.steps_per_epoch is not None:
            return step // self.steps_per_epoch
        if self.warmup_epochs > 0:
            raise ConfigError("DGC sparsity warm-up needs the epoch: pass steps_per_epoch=len(loader) to "
                              "Compression.dgc(...), or call set_epoch(epoch) on it at each epoch start")
        return 0

    def ratio(self, bucket: Bucket | None, numel: int, step: int = 0) -> float:
        base = self.density(bucket, numel)
        return warmup_ratio(base, self.epoch(step), self.warmup_epochs, self.warmup_coeff)

    def count(self, numel: int, bucket: Bucket | None, step: int) -> int:
        """DGC's ``num_selects = ceil(numel * ratio)``."""
        return int(math.ceil(numel * self.ratio(bucket, numel, step)))

    def sampling(self, numel: int, ratio: float) -> tuple[int, int, int]:
        """(sample_stride, num_samples, top_k_samples) as ``DGCCompressor.initialize`` computes them."""
        if self.sample_ratio >= 1.0:
            stride, num_samples = 1, numel
        else:
            pct_numel = int(math.ceil(numel * self.sample_ratio))
            cpr_numel = int(math.ceil(2 / ratio))
            if numel <= cpr_numel:
                stride, num_samples = 1, numel
            else:
                want = max(pct_numel, cpr_numel)
                stride = int(math.ceil(numel / want / 32)) * 32 + 1
                num_samples = numel // stride
                while num_samples < want:
                    stride -= 8
                    num_samples = numel // stride
        return stride, num_samples, int(math.ceil(num_samples * ratio))

    # -- selection ----------------------------------------------------------------------------
    @property
    def reads_parts(self) -> bool:
        """The exact and the sampled selection read the gradient in their sweep (the sampled one
        from its second step on: docs/dgc.md#sample-from-sums; docs/selection.md#grad-parts)."""
        return self.selection.mode in ("exact", "sampled")

    def select(self, ops: TensorOps, acc: Any, bucket: Bucket | None = None, step: int = 0) -> tuple[Any, Any]:
        vals, idx, _ = self.selection.select_acc(ops, acc, self.k_for(ops.numel(acc), bucket, step), bucket, step,
                                                 None)
        return vals, idx

    @property
    def folds_finite(self) -> bool:
        """The selection can tell the sparse reducer that the bucket is finite (docs/selection.md#finite-sweep)."""
        return self.selection.folds_finite

    def select_acc(self, ops: TensorOps, r: Any, bucket: Bucket | None, step: int, addend: Any,
                   out: Any = None, finite: list | None = None) -> tuple[Any, Any, Any]:
        """(values, indices, acc) of ``acc = r + addend`` (into r, or into ``out`` with r intact):
        the fused form the memory calls (docs/selection.md#fused-ef); the verdict on acc's
        finiteness is appended to ``finite`` (docs/selection.md#finite-sweep)."""
        return self.selection.select_acc(ops, r, self.k_for(ops.numel(r), bucket, step), bucket, step, addend, out,
                                         finite)

    def selection_stats(self) -> dict:
        return self.selection.stats()

    def sampled_select(self, ops: TensorOps, acc: Any, bucket: Bucket | None, step: int, addend: Any = None,
                       out: Any = None, finite: list | None = None) -> tuple[Any, Any, Any]:
        """(values, indices, acc) of DGC's sampled-threshold selection of ``acc`` (+ ``addend``:
        the sum made during the first threshold sweep, into ``out`` with acc intact when given,
        bit-identical to adding first; docs/selection.md#fused-ef). Appends to ``finite`` whether
        the sum is finite, read off the first sweep (docs/selection.md#finite-sweep). The steps are
        in :mod:`hvd_commopt.compress.dgc_select`."""
        return sampled_select(self, ops, acc, bucket, step, addend, out, finite)

    def config(self) -> dict:
        return {**super().config(), "sample_ratio": self.sample_ratio, "strided_sample": self.strided_sample,
                "bounds": (self.upper, self.lower), "max_adaptation_iters": self.max_adaptation_iters,
                "resample": self.resample, "warmup_epochs": self.warmup_epochs,
                "warmup_coeff": self.warmup_coeff, "steps_per_epoch": self.steps_per_epoch, "seed": self.seed,
                **self.selection.config()}

    def state_dict(self) -> dict:
        return {**({} if self._epoch is None else {"epoch": self._epoch}), **self.selection.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._epoch = state.get("epoch")
        self.selection.load_state_dict(state)

    def __repr__(self) -> str:
        return (f"DGCCompressor(density={self.density!r}, sample_ratio={self.sample_ratio}, "
                f"warmup_epochs={self.warmup_epochs}, warmup_coeff={self.warmup_coeff!r})")


class DGCMemory:
    """DGC's momentum correction, momentum factor masking and local clipping (``dgc/memory.py``),
    a :class:`~hvd_commopt.compress.memory.Memory`.

    The velocity ``v`` plays the residual's role: what is not sent stays in ``v``. Invariant
    (bit-exact): ``scatter(idx, v_before[idx]) + v_after == v_before``.

    Args:
        momentum: μ (0.9); None: the wrapped optimizer's, bound by the scheduler when it attaches
            the optimizer (:meth:`bind_momentum`).
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
        # momentum correction: the scheduler reads this and keeps the optimizer's own momentum off
        self.applies_momentum = True
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

    enabled = True  # a memory that takes part in the fused selection (select_with_memory)

    @property
    def reads_parts(self) -> bool:
        """:meth:`compensate_select` hands a bucket's unpacked gradients (:class:`GradParts`) to the
        selection as they are: no clipping or Nesterov pass reads them first (docs/selection.md#grad-parts)."""
        return self.clip_norm is None and not self.nesterov

    def snapshot(self, ops: TensorOps, name: str, like: Any, step: int) -> None:
        """Keep ``u`` and ``v`` before round ``step`` (for :meth:`rollback`); no copy: the round
        writes its new ``u`` and ``v`` into second buffers (:class:`Generations`)."""
        self._skipped.discard(name)
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

    def _check_bound(self) -> None:
        if not self._bound:
            raise ConfigError("this compression takes its momentum from the wrapped optimizer (momentum=None), "
                              "but no optimizer is attached (DistributedGradientTape, reduce_step): pass the "
                              "momentum explicitly, e.g. Compression.dgc(..., momentum=0.9), and step an "
                              "optimizer without momentum")

    def _clip(self, ops: TensorOps, g: Any) -> Any:
        if self.clip_norm is None:
            return g
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
        self._v.set(name, ops.index_fill(acc, sent_idx, 0.0))
        if self.momentum_masking:
            u = self._u.get(ops, name, acc)
            self._u.set(name, ops.index_fill(u, sent_idx, 0.0))

    def update_quantized(self, ops: TensorOps, name: str, acc: Any, sent: Any) -> None:
        raise ConfigError("DGC's memory serves sparse selections; a dense quantizer takes ErrorFeedback()")

    def restore(self, ops: TensorOps, name: str, idx: Any, vals: Any) -> None:
        """Selected values that were not delivered go back into the velocity."""
        if ops.numel(idx) and name not in self._skipped:
            self._v.set(name, ops.scatter_add(self._v.live(name), idx, vals))

    def compensate_dense(self, ops: TensorOps, name: str, flat: Any) -> Any:
        return flat  # the reference sends uncompressed tensors as they are ...

    def finish_dense(self, ops: TensorOps, name: str, reduced: Any) -> Any:
        # ... and applies clipping and momentum to the average (compensate(accumulate=False))
        self._check_bound()
        g = self._clip(ops, reduced)
        u = self._momentum(ops, name, g)
        if self.nesterov:
            return ops.add(ops.clone(u), g)
        return ops.clone(u)

    def residual(self, ops: TensorOps, name: str, like: Any) -> Any | None:
        return self._v.get(ops, name, like)

    def residuals(self) -> dict[str, Any]:
        """The velocities in use (what was not sent yet), by bucket name, as
        ``ErrorFeedback.residuals`` (for tests and diagnostics)."""
        return {n: self._v.live(n) for n in self._v.names() if self._v.live(n) is not None}

    def config(self) -> dict:
        return {"name": "dgc_memory", "momentum": "optimizer" if self.from_optimizer else self.momentum,
                "nesterov": self.nesterov,
                "momentum_masking": self.momentum_masking, "clip_norm": self.clip_norm,
                "nonfinite": self.nonfinite}

    def state_dict(self) -> dict:
        return {"momentums": self._u.state_dict(), "velocities": self._v.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for s in self._snaps:
            s.clear()
        self._u.load_state_dict(dict(state.get("momentums", {})))
        self._v.load_state_dict(dict(state.get("velocities", {})))

    def __repr__(self) -> str:
        return (f"DGCMemory(momentum={self.momentum}, nesterov={self.nesterov}, "
                f"momentum_masking={self.momentum_masking}, clip_norm={self.clip_norm})")
