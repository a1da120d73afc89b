"""Selectors: which k (value, index) pairs of a flat bucket a sparse reducer sends, and their densities.

A selector never communicates and keeps no memory (GRACE's lesson): what is not sent is remembered
by a :class:`~hvd_commopt.memory.base.Memory`, the exchange is a sparse reducer's
(:mod:`hvd_commopt.reduce.sparse`). The reducers call :meth:`Selector.select` with the bucket (a
:class:`~hvd_commopt.buckets.Bucket`, passed as data) and the round's step. The selectors are
:class:`~hvd_commopt.compress.topk.TopKSelector`, :class:`~hvd_commopt.compress.dgc.DGCSelector` and
:class:`~hvd_commopt.compress.randomk.RandomKSelector`.

What a selector can do beyond :meth:`Selector.select` is declared on it, never probed:
``fuses_memory`` (it offers :meth:`Selector.select_acc`, the form a memory's fused step calls,
docs/selection.md#fused-ef), ``folds_finite`` (docs/selection.md#finite-sweep), ``reads_parts``
(docs/selection.md#grad-parts), ``sends_k`` (docs/topk.md#equal-sizes) and ``selection`` (its
selection mode and that mode's per-bucket state, docs/selection.md).

Density is a float, a dict ``{name: density}`` or a callable ``(bucket_name, numel) -> density``
(LAGS's per-layer density). Dict keys match the bucket's name first, then the name of its first
tensor (with one bucket per layer, ``fusion_threshold=0``, that is the layer's parameter name),
then ``"default"``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

from ..buckets import Bucket
from ..errors import ConfigError
from ..tensor_ops import TensorOps

if TYPE_CHECKING:
    from ..select.strategies import SelectionStrategy
    from .warmup import DensityWarmup

__all__ = ["Density", "DensitySpec", "Selector", "check_density"]

Density = Union[float, Mapping[str, float], Callable[[str, int], float]]


def check_density(density: Any, what: str = "density") -> float:
    """``density`` as a float in (0, 1], or a ConfigError that says how to fix it."""
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise ConfigError(f"{what} must be a number in (0, 1] (the fraction of each bucket's elements "
                          f"sent per step), got {density!r}")
    d = float(density)
    if not (0.0 < d <= 1.0) or math.isnan(d):
        raise ConfigError(f"{what} must be in (0, 1] (the fraction of each bucket's elements sent per "
                          f"step), got {density!r}: use e.g. 0.001 to send 0.1 % of the gradient, or "
                          f"1.0 to send all of it (dense)")
    return d


class DensitySpec:
    """Per-bucket density: a float, a dict (per layer) or a callable ``(name, numel) -> density``.

    Every value is validated to lie in (0, 1]: dict values at construction, callable results
    when first used.
    """

    def __init__(self, density: Density, default: float | None = None):
        self._fn: Callable[[str, int], float] | None = None
        self._map: dict[str, float] = {}
        self._const: float | None = None
        if callable(density) and not isinstance(density, (int, float)):
            self._fn = density
            self._default = None if default is None else check_density(default, "default density")
        elif isinstance(density, Mapping):
            if not density:
                raise ConfigError("density dict is empty; give {layer_name: density, 'default': d}")
            self._map = {str(k): check_density(v, f"density[{k!r}]") for k, v in density.items()}
            dflt = self._map.pop("default", default)
            self._default = None if dflt is None else check_density(dflt, "default density")
        else:
            self._const = check_density(density)
            self._default = self._const

    @property
    def constant(self) -> float | None:
        """The density when it is one number for every bucket, else None."""
        return self._const

    def __call__(self, bucket: Bucket | None, numel: int) -> float:
        """The density of ``bucket`` (None: a bucket-less, standalone selection of ``numel``)."""
        if self._const is not None:
            return self._const
        name = bucket.name if bucket is not None else ""
        if self._fn is not None:
            return check_density(self._fn(name, numel), f"density({name!r}, {numel})")
        if bucket is not None:
            for key in (bucket.name, bucket.first):
                if key in self._map:
                    return self._map[key]
        if self._default is None:
            first = bucket.first if bucket is not None else None
            raise ConfigError(f"no density for bucket {name!r} (first tensor {first!r}); "
                              f"add it to the density dict or give a 'default' entry")
        return self._default

    def of_tensor(self, name: str, numel: int) -> float:
        """The density of one tensor of a bucket, by its parameter name: a layer-wise selection
        (``TopKSelector(layerwise=True)``) asks it for each member of a fused bucket."""
        if self._const is not None:
            return self._const
        if self._fn is not None:
            return check_density(self._fn(name, numel), f"density({name!r}, {numel})")
        d = self._map.get(name, self._default)
        if d is None:
            raise ConfigError(f"no density for tensor {name!r}; add it to the density dict or give a 'default' entry")
        return d

    def config(self) -> Any:
        """Plain values describing the density (a callable by its qualified name)."""
        if self._const is not None:
            return self._const
        if self._fn is not None:
            return {"callable": getattr(self._fn, "__qualname__", repr(self._fn)), "default": self._default}
        return {**self._map, "default": self._default}

    def __repr__(self) -> str:
        if self._const is not None:
            return repr(self._const)
        return "<callable>" if self._fn is not None else repr({**self._map, "default": self._default})


class Selector:
    """A selector: which k (value, index) pairs of a flat bucket to send.

    Subclasses implement :meth:`select`. ``collective`` is "sparse" (the selections are
    exchanged as (values, indices) and scatter-added) unless every rank selects the same
    indices, in which case the values alone can be allreduced ("allreduce", random-k).

    Attributes (declared capabilities; the defaults are a plain selector's):
        fuses_memory: :meth:`select_acc` is offered, so a memory may fuse its add into the
            selection's pass (docs/selection.md#fused-ef).
        selection: the selection mode (exact, threshold reuse, sampled) whose per-bucket state
            :meth:`snapshot`/:meth:`rollback` keep; None for a selector without one.
        layerwise: the top-k of each tensor of a bucket (LAGS-SGD's rule) instead of the bucket's.
    """

    collective = "sparse"
    name = "abstract"
    fuses_memory: bool = False
    selection: SelectionStrategy | None = None
    layerwise: bool = False
    #: a density warm-up (:class:`~hvd_commopt.compress.warmup.DensityWarmup`), set under an
    #: adaptive optimizer (docs/adaptive-optimizers.md#warmup); None: the density from step 0.
    warmup: DensityWarmup | None = None

    def __init__(self, density: Density = 0.001, min_k: int = 1, dense_1d: bool = True):
        self.density = DensitySpec(density)
        if isinstance(min_k, bool) or not isinstance(min_k, int) or min_k < 1:
            raise ConfigError(f"min_k must be an integer >= 1 (the fewest elements a bucket sends), got {min_k!r}")
        self.min_k = int(min_k)
        if not isinstance(dense_1d, bool):
            raise ConfigError(f"dense_1d must be True (send 1-D tensors such as biases and norm scales "
                              f"uncompressed) or False (select them with the matrices), got {dense_1d!r}")
        self.dense_1d = dense_1d

    def k_for(self, numel: int, bucket: Bucket | None = None, step: int = 0) -> int:
        """Elements to send from ``numel`` elements: all of a ``dense`` bucket's (its 1-D tensors,
        docs/topk.md#dense-1d), else ``min(max(count, min_k), numel)`` with :meth:`count`."""
        if numel <= 0:
            return 0
        if bucket is not None and bucket.dense:
            return numel
        k = min(max(self.count(numel, bucket, step), self.min_k), numel)
        return k if self.warmup is None else self.warmup.k(k, numel, step)

    @property
    def sends_k(self) -> bool:
        """True when every selection is exactly :meth:`k_for` entries (the exact top-k, of Top-k
        or DGC): k is fixed by the bucket, the density and the step, so every rank sends the same
        count and the exchange may skip its size round (docs/topk.md#equal-sizes). Threshold
        reuse and DGC's sampled threshold select a count that varies by rank."""
        return self.selection is not None and self.selection.mode == "exact"

    @property
    def reads_parts(self) -> bool:
        """The selection reads a bucket's gradient once, in the native top-k's pass, which can read
        the unpacked gradients (the exact top-k of the whole bucket; docs/selection.md#grad-parts)."""
        return self.sends_k and not self.layerwise

    @property
    def folds_finite(self) -> bool:
        """The fused selection tells the sparse reducer whether the bucket is finite
        (docs/selection.md#finite-sweep): a mode that keeps no state across steps."""
        return self.fuses_memory and self.selection is not None and self.selection.folds_finite

    def count(self, numel: int, bucket: Bucket | None, step: int) -> int:
        """The density's count before the floor: ``int(numel*density)``."""
        return int(numel * self.density(bucket, numel))

    def select(self, ops: TensorOps, acc: Any, bucket: Bucket | None = None, step: int = 0) -> tuple[Any, Any]:
        """(values, int64 indices ascending) to send from the flat ``acc``; never modifies acc."""
        raise NotImplementedError

    def select_acc(self, ops: TensorOps, r: Any, bucket: Bucket | None, step: int, addend: Any,
                   out: Any = None, finite: list | None = None) -> tuple[Any, Any, Any]:
        """(values, indices, acc) of ``acc = r + addend`` (into r where allowed, or into ``out``
        with r intact): the fused form a memory calls (docs/selection.md#fused-ef); the verdict on
        acc's finiteness is appended to ``finite`` (docs/selection.md#finite-sweep). Offered where
        ``fuses_memory`` is True."""
        raise NotImplementedError(f"{type(self).__name__} has no fused selection (fuses_memory is False)")

    def check_momentum(self, momentum: float, corrected: bool) -> None:
        """Called when the wrapped optimizer is attached, with the momentum that will be applied
        and whether the memory applies it (momentum correction): warn about a combination that
        is known not to train (random-k: docs/topk.md#randomk-momentum). Nothing by default."""

    def set_epoch(self, epoch: int) -> None:
        """An epoch starts (DGC's sparsity warm-up); nothing by default."""

    def selection_stats(self) -> dict:
        """The selection mode's statistics (threshold reuse: per-bucket k drift; docs/selection.md#reuse)."""
        return self.selection.stats() if self.selection is not None else {}

    def config(self) -> dict:
        """The configuration, as plain values: compared across ranks (they must agree)."""
        return {"name": self.name, "density": self.density.config(), "min_k": self.min_k, "dense_1d": self.dense_1d}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def snapshot(self, key: str, step: int) -> None:
        """Keep the selection state of bucket ``key`` before round ``step`` (threshold reuse's,
        in the :attr:`selection` of Top-k and DGC)."""
        if self.selection is not None:
            self.selection.snapshot(key, step)

    def rollback(self, key: str, step: int) -> None:
        """Round ``step`` of ``key`` was skipped (not finite): back to :meth:`snapshot`'s state,
        so the skipped step leaves no trace in the selection either (docs/wrapper.md#nonfinite)."""
        if self.selection is not None:
            self.selection.rollback(key, step)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(density={self.density!r})"
