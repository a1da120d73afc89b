"""Top-k sparsification (exact, deterministic, or approximate by the user's choice).

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
* A selector never communicates and keeps no memory (GRACE's lesson): error feedback lives in
  :mod:`hvd_commopt.memory`, the exchange in :mod:`hvd_commopt.reduce`; what every selector shares
  (density, ``k_for``, the declared capabilities) is :class:`~hvd_commopt.compress.selector.Selector`.
* ``selection="sampled"`` runs DGC's sampled threshold
  (:func:`~hvd_commopt.select.sampled.sampled_select`) with DGC's defaults and
  ``k = ceil(n·density)`` (:class:`~hvd_commopt.compress.sampling.DensitySampling`).
"""
from __future__ import annotations

from typing import Any

from ..buckets import Bucket
from ..errors import ConfigError
from ..tensor_ops import TensorOps
from ..select.sampled import sampled_select
from ..select.layerwise import LayerwiseK
from .sampling import DensitySampling
from ..select.strategies import SelectionStrategy
from .selector import Density, Selector

__all__ = ["TopKSelector"]


class TopKSelector(Selector):
    """The k largest-magnitude elements of the bucket: exactly (ties to the lower index), or
    approximately by the user's choice (docs/selection.md).

    Args:
        density: see :class:`~hvd_commopt.compress.selector.DensitySpec`.
        selection: "exact" (the same result as ``topk_abs``, fast), "threshold" (Ok-Topk's
            threshold reuse: exact every ``tau`` steps, the count within ``k·(1 ± band)``) or
            "sampled" (DGC's sampled threshold, with DGC's ``k = ceil(n·density)``).
    """

    name = "topk"
    fuses_memory = True
    selection: SelectionStrategy

    def __init__(self, density: Density = 0.001, selection: str = "exact", tau: int = 16, band: float = 0.2,
                 min_k: int = 1, dense_1d: bool = True, layerwise: bool = False):
        super().__init__(density, min_k, dense_1d)
        self.selection = SelectionStrategy(selection, tau, band, sampled=self._sampled)
        self._sampling = DensitySampling(self.density)  # "sampled": DGC's defaults, the same densities
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
        return sampled_select(self._sampling, ops, r, bucket, step, addend, out, finite)

    def k_for(self, numel: int, bucket: Bucket | None = None, step: int = 0) -> int:
        """:meth:`Selector.k_for`; layer-wise, the sum of the members' own k."""
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

    def state_dict(self) -> dict:
        return self.selection.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.selection.load_state_dict(state)

    def __repr__(self) -> str:
        lw = ", layerwise=True" if self.layerwise else ""
        return f"TopKSelector(density={self.density!r}, selection={self.selection.mode!r}{lw})"
