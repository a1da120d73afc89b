"""Error feedback (residual memory) keyed by bucket name: what was not sent is sent later.

Reference: GRACE's ``ResidualMemory`` (sands-lab/grace) and the HKBU Top-k code (docs/topk.md#update-rule:
``acc = grad + residual; ...; residual = acc; residual[idx] = 0``); the invariant test is the
epfml/powersgd one. Implements :class:`~hvd_commopt.memory.base.Memory`, for sparse
selections (Top-k, random-k, gTop-k) and for lossy dense encodings (CD-SGD's ternary signs,
``residual = acc - theta*s``, MXNet's ``r -= theta`` / ``r += theta``, docs/cd-sgd.md#update-rule).

With ``decay=beta`` (SparseLoCo's error feedback, docs/quantize.md#ef-decay) the residual is
scaled by beta before it is added: ``acc = flat + beta*r`` (``beta*r`` rounded to float32 first,
then the sum), the form ``e_t = beta e_(t-1) + Delta_t``; beta = 1 (the default) adds it as it is.

Invariant (docs/topk.md#invariants, docs/lags-omgs.md#invariants), bit-exact: ``scatter(sent_idx, acc[sent_idx]) + residual ==
acc``. It holds because the residual is a copy of ``acc`` with the sent positions set to zero,
so the two parts partition the same array; nothing is recomputed.

Checkpoint format (a decision): ``state_dict()`` holds **the adapter's own tensors**
(``ops.clone`` copies: torch tensors under torch_plugin), so ``torch.save`` /
``torch.load(weights_only=True)`` round-trip it (NumPy arrays would need
``weights_only=False``). ``load_state_dict`` accepts native tensors *or* NumPy arrays (a
framework-neutral form, e.g. from another adapter) and converts each lazily, the first time its
bucket is seen, onto that bucket's device and dtype, since the memory does not know devices
before then.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..buckets import Bucket
from ..compress.nonfinite import check_policy
from ..errors import ConfigError
from ..tensor_ops import TensorOps
from .relayout import relayout_flats
from .sent import zero_sent

__all__ = ["TensorStore", "ErrorFeedback", "check_decay"]


class TensorStore:
    """Per-name flat tensors with lazy loading from a checkpoint (shared by EF and DGC)."""

    def __init__(self, what: str = "residual"):
        self.what = what
        self._live: dict[str, Any] = {}
        self._loaded: dict[str, Any] = {}  # from load_state_dict, not yet converted
        self._ops: TensorOps | None = None

    def get(self, ops: TensorOps, name: str, like: Any) -> Any | None:
        """The tensor stored for ``name`` (None when there is none), shaped like ``like``."""
        self._ops = ops
        if name in self._loaded:
            v = self._loaded.pop(name)
            arr = v if isinstance(v, np.ndarray) else _host(ops, v)
            t = ops.from_numpy(np.array(arr, copy=True).reshape(-1), like=like)
            if ops.dtype_name(t) != ops.dtype_name(like):
                t = ops.cast(t, ops.dtype_name(like))
            self._live[name] = t
        t = self._live.get(name)
        if t is not None and ops.numel(t) != ops.numel(like):
            raise ConfigError(f"the stored {self.what} for bucket {name!r} has {ops.numel(t)} elements but the "
                              f"bucket has {ops.numel(like)}: the fusion plan changed under the same bucket "
                              f"name, or a checkpoint from another model was loaded. Reset the reducer's state.")
        return t

    def live(self, name: str) -> Any | None:
        """The tensor stored for ``name`` if it is already in use (no loading, no checks)."""
        return self._live.get(name)

    def set(self, name: str, t: Any) -> None:
        self._live[name] = t

    def pop(self, name: str) -> None:
        self._live.pop(name, None)
        self._loaded.pop(name, None)

    def names(self) -> list[str]:
        return sorted(set(self._live) | set(self._loaded))

    def state_dict(self) -> dict[str, Any]:
        out = dict(self._loaded)
        if self._ops is not None:
            out.update({n: self._ops.clone(t) for n, t in self._live.items()})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._live.clear()
        self._loaded = dict(state)


def _host(ops: TensorOps, v: Any) -> np.ndarray:
    try:
        return np.asarray(ops.to_numpy(v))
    except Exception:  # noqa: BLE001 - not this adapter's tensor type: let NumPy convert it
        return np.asarray(v)


class Generations:
    """Rollback without copies for a :class:`TensorStore` (docs/wrapper.md#nonfinite): a round's
    snapshot keeps the stored tensor itself, and the round writes its new value into a second
    buffer (:meth:`free`), so each bucket has two buffers that swap roles; nothing is copied."""

    def __init__(self, store: TensorStore):
        self.store = store
        self._saved: dict[str, tuple[int, Any]] = {}  # name -> (step, tensor before the round or None)
        self._spare: dict[str, Any] = {}

    def take(self, ops: TensorOps, name: str, like: Any, step: int) -> None:
        t = self.store.get(ops, name, like)
        prev = self._saved.get(name)
        if prev is not None and prev[1] is not None and prev[1] is not t:
            self._spare[name] = prev[1]  # two rounds old: free for the next write
        self._saved[name] = (step, t)

    def free(self, ops: TensorOps, name: str, like: Any) -> Any | None:
        """A buffer for the new value that no snapshot holds: the stored tensor itself when it is
        not saved (in place), else the spare one; None: allocate."""
        t = self.store.get(ops, name, like)
        saved = self._saved.get(name)
        if t is not None and saved is not None and saved[1] is t:
            t = self._spare.pop(name, None)
            if t is not None and (ops.numel(t) != ops.numel(like) or ops.dtype_name(t) != ops.dtype_name(like)):
                t = None
        return t

    def writable(self, ops: TensorOps, name: str, value: Any) -> Any:
        """``value``'s values in a buffer that no snapshot holds (``value`` itself when none
        does): the buffer :meth:`free` gives, else a fresh clone."""
        buf = self.free(ops, name, value)
        if buf is value:
            return value
        return ops.clone(value) if buf is None else ops.copy_into(buf, 0, value)

    def restore(self, name: str, step: int) -> bool:
        """Put back the tensor saved for ``step``; False when a later round has replaced it."""
        saved = self._saved.get(name)
        if saved is None or saved[0] != step:
            return False
        del self._saved[name]
        cur = self.store.live(name)
        if cur is not None and cur is not saved[1]:
            self._spare[name] = cur
        if saved[1] is None:
            self.store.pop(name)
        else:
            self.store.set(name, saved[1])
        return True

    def clear(self) -> None:
        self._saved.clear()
        self._spare.clear()


def check_decay(decay: object) -> float:
    """``decay`` as a float in (0, 1], or a ConfigError naming the fix."""
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < float(decay) <= 1.0:
        raise ConfigError(f"error-feedback decay must be a number in (0, 1] (the factor the residual is scaled "
                          f"by each round: SparseLoCo uses 0.95; 1 keeps all of it), got {decay!r}")
    return float(decay)


class ErrorFeedback:
    """Residual memory keyed by bucket name (a :class:`~hvd_commopt.memory.base.Memory`).

    Args:
        enabled: False makes it a no-op (plain sparsification: unsent values are dropped).
        nonfinite: what a rank does when its bucket holds NaN/Inf: "skip" (default: the residual
            is left as it was and the step is skipped on every rank) or "raise"
            (docs/wrapper.md#nonfinite).
        decay: the factor beta in (0, 1] the residual is scaled by before each round adds it
            (SparseLoCo's ``e = beta e + Delta``, beta about 0.95, docs/quantize.md#ef-decay);
            1 (default) keeps all of it.
    """

    def __init__(self, enabled: bool = True, nonfinite: str = "skip", decay: float = 1.0):
        self.enabled = bool(enabled)
        self.nonfinite = check_policy(nonfinite)
        self.decay = check_decay(decay)
        self._res = TensorStore("residual")
        # Rollback without a copy: the residual before a round stays in its buffer and the
        # round's update writes into a second one, so each bucket has two buffers.
        self._gen = Generations(self._res)
        self._skipped: set[str] = set()

    reads_parts = False  # the fused step adds the packed bucket to the residual

    @property
    def fuses_selection(self) -> bool:
        """:meth:`compensate_select` stands for compensate + select + update (when enabled)."""
        return self.enabled

    def snapshot(self, ops: TensorOps, name: str, like: Any, step: int) -> None:
        """Keep the residual before round ``step`` (for :meth:`rollback`); no copy is made."""
        self._skipped.discard(name)
        if not self.enabled:
            return
        self._gen.take(ops, name, like, step)

    def skip(self, name: str) -> None:
        """This round leaves ``name`` untouched (its contribution was not finite): :meth:`restore`
        ignores the marker selection sent in its place."""
        self._skipped.add(name)

    def rollback(self, ops: TensorOps, name: str, step: int) -> bool:
        """The reduced bucket of round ``step`` was not finite: the residual goes back to its
        snapshot. False when a later round already built on it (delayed schedules)."""
        if not self.enabled:
            return True
        return self._gen.restore(name, step)

    def compensate(self, ops: TensorOps, name: str, flat: Any) -> Any:
        """``flat + residual`` (into ``flat`` where the framework allows; use the result)."""
        if not self.enabled:
            return flat
        r = self._res.get(ops, name, flat)
        return flat if r is None else ops.add(flat, self._decayed(ops, r))

    def _decayed(self, ops: TensorOps, r: Any) -> Any:
        """``beta * r`` in a new buffer (r stays intact for :meth:`rollback`); r itself at beta = 1."""
        if self.decay == 1.0:
            return r
        return ops.scale_into(ops.empty(ops.numel(r), ops.dtype_name(r), like=r), r, self.decay)

    def update(self, ops: TensorOps, name: str, acc: Any, sent_idx: Any) -> None:
        """Residual := ``acc`` with the positions ``sent_idx`` set to zero (bit-exact partition)."""
        if not self.enabled:
            return
        r = self._gen.writable(ops, name, acc)  # reuse a buffer
        self._res.set(name, zero_sent(ops, r, sent_idx))

    def compensate_select(self, ops: TensorOps, name: str, flat: Any, select: Any) -> tuple[Any, Any]:
        """compensate + select + update with the add fused into the selection's pass
        (docs/selection.md#fused-ef).

        ``select(acc, addend, out=None)`` returns ``(values, indices, acc + addend)``, the sum
        computed during its candidate pass into ``out`` (``acc`` when None). The sum goes straight
        into the residual's spare buffer (``out``), so the residual before the round stays intact
        for :meth:`rollback` and no copy is made; without a snapshot it goes into the residual
        itself. Only the sent positions are then zeroed. Bit-identical to :meth:`compensate`,
        select, :meth:`update` (the sum is the same either way round).
        """
        r = self._res.get(ops, name, flat)
        if r is None:
            vals, idx, acc = select(flat, None)
            self.update(ops, name, acc, idx)
            return vals, idx
        if self.decay != 1.0:  # beta*r is a new buffer: the sum goes into it
            d = self._decayed(ops, r)
            vals, idx, acc = select(d, flat)
            self._res.set(name, zero_sent(ops, acc, idx))
            return vals, idx
        buf = self._gen.free(ops, name, flat)
        if buf is r:  # no snapshot holds r: accumulate in place
            vals, idx, acc = select(r, flat)
        else:
            if buf is None:
                buf = ops.empty(ops.numel(flat), ops.dtype_name(flat), like=flat)
            vals, idx, acc = select(flat, r, buf)
        self._res.set(name, zero_sent(ops, acc, idx))
        return vals, idx

    def update_quantized(self, ops: TensorOps, name: str, acc: Any, sent: Any) -> None:
        """Residual := ``acc - sent``: a lossy dense encoding of ``acc`` was sent, worth ``sent``.

        ``acc`` may be the round's fusion buffer (reused by a later round), so the difference is
        computed in the residual's own buffer, as :meth:`update` does.
        """
        if not self.enabled:
            return
        r = self._gen.writable(ops, name, acc)
        self._res.set(name, ops.sub(r, sent))

    def restore(self, ops: TensorOps, name: str, idx: Any, vals: Any) -> None:
        """Give back values that were selected but not delivered: ``residual[idx] += vals``.

        gTop-k calls it when the exchange is over for the local top-k entries that did not
        survive the merges (docs/gtopk.md#recursive-doubling, docs/gtopk.md#t-gt-5); :meth:`update` had zeroed them, so the
        addition is ``0 + v = v``, exact, and the invariant still holds bit for bit.
        """
        if not self.enabled or ops.numel(idx) == 0 or name in self._skipped:
            return
        r = self._res.live(name)
        if r is None:
            raise RuntimeError(f"internal: restore() for {name!r} without a preceding update()")
        self._res.set(name, ops.scatter_add(r, idx, vals))

    def compensate_dense(self, ops: TensorOps, name: str, flat: Any) -> Any:
        """The whole bucket is sent this step: return ``flat + residual``; the residual becomes 0."""
        acc = self.compensate(ops, name, flat)
        self._res.pop(name)
        return acc

    def finish_dense(self, ops: TensorOps, name: str, reduced: Any) -> Any:
        return reduced

    def residual(self, ops: TensorOps, name: str, like: Any) -> Any | None:
        """The current residual of ``name`` (None = zero), for tests and diagnostics."""
        return self._res.get(ops, name, like)

    def residuals(self) -> dict[str, Any]:
        """The residuals in use, by bucket name (for tests and diagnostics)."""
        return {n: self._res.live(n) for n in self._res.names() if self._res.live(n) is not None}

    def relayout(self, ops: TensorOps, old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
        """A re-plan: each tensor's residual moves into its new bucket (docs/lags-omgs.md#replan-residuals)."""
        moved = relayout_flats(ops, self._res.state_dict(), old, new)
        if moved is not None:
            self.load_state_dict({"residuals": moved})

    def config(self) -> dict:
        return {"name": "error_feedback", "enabled": self.enabled, "nonfinite": self.nonfinite, "decay": self.decay}

    def state_dict(self) -> dict:
        return {"residuals": self._res.state_dict()} if self.enabled else {}

    def load_state_dict(self, state: dict) -> None:
        self._gen.clear()
        self._res.load_state_dict(dict(state.get("residuals", {})))

    def __repr__(self) -> str:
        dec = "" if self.decay == 1.0 else f", decay={self.decay!r}"
        return f"ErrorFeedback(enabled={self.enabled}, nonfinite={self.nonfinite!r}{dec})"
