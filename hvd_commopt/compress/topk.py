"""Top-k sparsification (exact, deterministic), plus what every sparse compressor shares.

Paper / reference: Top-k S-SGD with error feedback as in the HKBU code (OMGS-SGD and gtopkssgd
``compression.py: TopKCompressor``), docs/topk.md#update-rule; per-layer density for LAGS-SGD, docs/lags-omgs.md#lags-update.

Choices:

* ``k = min(max(int(n * density), min_k), n)`` per bucket (docs/wrapper.md#k-per-bucket), so ``k <= n``
  always: a layer smaller than ``1/density`` still sends ``min_k`` elements (1 by default), and a
  bucket never asks for more than it has. ``min_k`` is the per-layer floor that keeps LAGS's small
  layers from starving (docs/topk.md#density-floor).
* ``dense_1d`` (default on): 1-D tensors (biases, normalisation scales and shifts) are sent whole,
  in buckets of their own, as DGC's and PowerSGD's reference code do; inside a fused bucket they
  got about one entry per step at 4 ranks (docs/topk.md#dense-1d).
* Selection is ``TensorOps.topk_abs``: ties go to the lower index and indices come out ascending,
  identical on every rank and in every framework (docs/wrapper.md#topk-ties; gTop-k relies on it).
* A selector never communicates and keeps no state (GRACE's lesson): error feedback lives in
  :mod:`hvd_commopt.compress.error_feedback`, the exchange in :mod:`hvd_commopt.reduce`. The
  reducers call :meth:`SparseCompressor.select` with the bucket (a
  :class:`~hvd_commopt.buckets.Bucket`, passed as data) and the round's step.
* Density is a float, a dict ``{name: density}`` or a callable ``(bucket_name, numel) ->
  density`` (LAGS's per-layer density). Dict keys match the bucket's name first, then the name
  of its first tensor (with one bucket per layer, ``fusion_threshold=0``, that is the layer's
  parameter name), then ``"default"``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

from ..buckets import Bucket
from ..errors import ConfigError
from ..tensor_ops import TensorOps
from ..select.layerwise import LayerwiseK
from ..select.strategies import SelectionStrategy as Selection

if TYPE_CHECKING:
    from .dgc import DGCCompressor  # dgc imports this module

__all__ = ["DensitySpec", "SparseCompressor", "TopKCompressor", "check_density"]

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
        (``TopKCompressor(layerwise=True)``) asks it for each member of a fused bucket."""
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


class SparseCompressor:
    """A selector: which k (value, index) pairs of a flat bucket to send.

    Subclasses implement :meth:`select`. ``collective`` is "sparse" (the selections are
    exchanged as (values, indices) and scatter-added) unless every rank selects the same
    indices, in which case the values alone can be allreduced ("allreduce", random-k).
    """

    collective = "sparse"
    name = "abstract"

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
        return min(max(self.count(numel, bucket, step), self.min_k), numel)

    @property
    def sends_k(self) -> bool:
        """True when every selection is exactly :meth:`k_for` entries (the exact top-k, of Top-k
        or DGC): k is fixed by the bucket, the density and the step, so every rank sends the same
        count and the exchange may skip its size round (docs/topk.md#equal-sizes). Threshold
        reuse and DGC's sampled threshold select a count that varies by rank."""
        sel = getattr(self, "selection", None)
        return sel is not None and sel.mode == "exact"

    @property
    def reads_parts(self) -> bool:
        """The selection reads a bucket's gradient once, in the native top-k's pass, which can read
        the unpacked gradients (the exact top-k of the whole bucket; docs/selection.md#grad-parts)."""
        return self.sends_k and not getattr(self, "layerwise", False)

    def count(self, numel: int, bucket: Bucket | None, step: int) -> int:
        """The density's count before the floor: ``int(numel*density)``."""
        return int(numel * self.density(bucket, numel))

    def select(self, ops: TensorOps, acc: Any, bucket: Bucket | None = None, step: int = 0) -> tuple[Any, Any]:
        """(values, int64 indices ascending) to send from the flat ``acc``; never modifies acc."""
        raise NotImplementedError

    def config(self) -> dict:
        """The configuration, as plain values: compared across ranks (they must agree)."""
        return {"name": self.name, "density": self.density.config(), "min_k": self.min_k, "dense_1d": self.dense_1d}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def snapshot(self, key: str, step: int) -> None:
        """Keep the selection state of bucket ``key`` before round ``step`` (threshold reuse's,
        in the :class:`~hvd_commopt.compress.selection.Selection` of Top-k and DGC)."""
        sel = getattr(self, "selection", None)
        if sel is not None:
            sel.snapshot(key, step)

    def rollback(self, key: str, step: int) -> None:
        """Round ``step`` of ``key`` was skipped (not finite): back to :meth:`snapshot`'s state,
        so the skipped step leaves no trace in the selection either (docs/wrapper.md#nonfinite)."""
        sel = getattr(self, "selection", None)
        if sel is not None:
            sel.rollback(key, step)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(density={self.density!r})"


class TopKCompressor(SparseCompressor):
    """The k largest-magnitude elements of the bucket: exactly (ties to the lower index), or
    approximately by the user's choice (docs/selection.md).

    Args:
        density: see :class:`DensitySpec`.
        selection: "exact" (the same result as ``topk_abs``, fast), "threshold" (Ok-Topk's
            threshold reuse: exact every ``tau`` steps, the count within ``k·(1 ± band)``) or
            "sampled" (DGC's sampled threshold, with DGC's ``k = ceil(n·density)``).
    """

    name = "topk"

    def __init__(self, density: Density = 0.001, selection: str = "exact", tau: int = 16, band: float = 0.2,
                 min_k: int = 1, dense_1d: bool = True, layerwise: bool = False):
        super().__init__(density, min_k, dense_1d)
        self.selection = Selection(selection, tau, band, sampled=self._sampled)
        self._dgc: DGCCompressor | None = None
        if not isinstance(layerwise, bool):
            raise ConfigError(f"layerwise must be True (the top-k of each tensor of a bucket, LAGS-SGD's rule) or "
                              f"False (the top-k of the whole bucket), got {layerwise!r}")
        if layerwise and self.selection.mode != "exact":
            raise ConfigError(f"layerwise=True selects each tensor exactly; selection={selection!r} keeps its state "
                              f"per bucket. Use selection='exact', or fusion_threshold=0 (one bucket per layer, "
                              f"where every selection mode applies)")
        self.layerwise = layerwise
        self._layers = LayerwiseK(self)

    def _sampled(self, ops: TensorOps, r: Any, bucket: Bucket | None, step: int, addend: Any = None,
                 out: Any = None, finite: list | None = None) -> tuple[Any, Any, Any]:
        if self._dgc is None:
            from .dgc import DGCCompressor  # dgc imports this module
            self._dgc = DGCCompressor()
            self._dgc.density = self.density  # the same per-bucket densities
        return self._dgc.sampled_select(ops, r, bucket, step, addend, out, finite)

    @property
    def folds_finite(self) -> bool:
        """The selection can tell the sparse reducer that the bucket is finite (docs/selection.md#finite-sweep)."""
        return self.selection.folds_finite

    def k_for(self, numel: int, bucket: Bucket | None = None, step: int = 0) -> int:
        """:meth:`SparseCompressor.k_for`; layer-wise, the sum of the members' own k."""
        segs = self._layers.of(bucket, numel)
        return super().k_for(numel, bucket, step) if segs is None else sum(k for _, _, k in segs)

    def select_acc(self, ops: TensorOps, r: Any, bucket: Bucket | None, step: int, addend: Any,
                   out: Any = None, finite: list | None = None) -> tuple[Any, Any, Any]:
        """(values, indices, acc) of ``acc = r + addend`` (into r where allowed, or into ``out``
        with r intact): the fused form the memories call (docs/selection.md#fused-ef); the
        verdict on acc's finiteness is appended to ``finite`` (docs/selection.md#finite-sweep)."""
        n = ops.numel(r)
        segs = self._layers.of(bucket, n)
        if segs is not None and len(segs) > 1:
            return self._layers.select_acc(ops, segs, r, bucket, step, addend, out, finite)
        if self.selection.mode == "threshold":
            self.selection.check_k(n * self.density(bucket, n), n, bucket.name if bucket is not None else "")
        k = segs[0][2] if segs is not None else self.k_for(n, bucket, step)
        return self.selection.select_acc(ops, r, k, bucket, step, addend, out, finite)

    def select(self, ops: TensorOps, acc: Any, bucket: Bucket | None = None, step: int = 0) -> tuple[Any, Any]:
        vals, idx, _ = self.select_acc(ops, acc, bucket, step, None)
        return vals, idx

    def config(self) -> dict:
        return {**super().config(), **self.selection.config(), "layerwise": self.layerwise}

    def selection_stats(self) -> dict:
        return self.selection.stats()

    def state_dict(self) -> dict:
        return self.selection.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.selection.load_state_dict(state)

    def __repr__(self) -> str:
        lw = ", layerwise=True" if self.layerwise else ""
        return f"TopKCompressor(density={self.density!r}, selection={self.selection.mode!r}{lw})"
