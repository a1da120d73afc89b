"""Top-k sparsification (exact, deterministic), plus what every sparse compressor shares.

Paper / reference: Top-k S-SGD with error feedback as in the HKBU code (OMGS-SGD and gtopkssgd
``compression.py: TopKCompressor``), spec §2.1; per-layer density for LAGS-SGD, spec §9.1.

Choices:

* ``k = max(int(n * density), 1)`` per bucket (spec §11.9), so ``k <= n`` always: a layer
  smaller than ``1/density`` still sends one element, and a bucket never asks for more than it
  has.
* Selection is ``TensorOps.topk_abs``: ties go to the lower index and indices come out ascending,
  identical on every rank and in every framework (spec §11.8; gTop-k relies on it).
* A compressor never communicates and keeps no state (GRACE's lesson): error feedback lives in
  :mod:`hvd_commopt.compress.error_feedback`, the exchange in :mod:`hvd_commopt.reduce`. The
  reducers call :meth:`SparseCompressor.select` with the bucket name and its step number; the
  plain ``compress``/``decompress`` pair of the :class:`Compressor` ABC is kept for the ABC's
  callers (payload ``(values, indices)``, decompressed by a scatter into zeros).
* Density is a float, a dict ``{name: density}`` or a callable ``(bucket_name, numel) ->
  density`` (LAGS's per-layer density). Dict keys match the bucket name first, then the name of
  the bucket's first tensor (with one bucket per layer, ``fusion_threshold=0``, that is the
  layer's parameter name), then ``"default"``.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Union

from ..errors import ConfigError
from ..tensor_ops import TensorOps
from .base import Compressor

__all__ = ["DensitySpec", "SparseCompressor", "TopKCompressor", "check_density", "tensor_name_of", "bucket_key"]

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


_ROUND_TAG = re.compile(r"@r\d+$")


def bucket_key(wire_name: str) -> str:
    """The bucket a collective belongs to: its wire name without a delayed schedule's round tag.

    Delayed schedules name each round's collectives ``{bucket}@r{step}`` (engine/rounds.py) so
    that rounds in flight together differ; per-bucket state (residuals, step counters, seeds,
    densities) must survive from round to round, so it is keyed by the bare bucket name.
    """
    return _ROUND_TAG.sub("", wire_name)


def tensor_name_of(bucket_name: str) -> str:
    """The first tensor's name in an engine bucket name ``bucket{i}:{first}[+{more}]``."""
    if ":" not in bucket_name or not bucket_name.startswith("bucket"):
        return bucket_name
    rest = bucket_key(bucket_name).split(":", 1)[1]
    head, sep, tail = rest.rpartition("+")
    return head if sep and tail.isdigit() else rest


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

    def __call__(self, name: str, numel: int) -> float:
        if self._const is not None:
            return self._const
        if self._fn is not None:
            return check_density(self._fn(name, numel), f"density({name!r}, {numel})")
        for key in (name, tensor_name_of(name)):
            if key in self._map:
                return self._map[key]
        if self._default is None:
            raise ConfigError(f"no density for bucket {name!r} (first tensor {tensor_name_of(name)!r}); "
                              f"add it to the density dict or give a 'default' entry")
        return self._default

    def __repr__(self) -> str:
        if self._const is not None:
            return repr(self._const)
        return "<callable>" if self._fn is not None else repr({**self._map, "default": self._default})


class SparseCompressor(Compressor):
    """A compressor that sends k (value, index) pairs of a flat bucket.

    Subclasses implement :meth:`select`. ``collective`` is "sparse" (the payloads are exchanged as
    (values, indices) and scatter-added) unless every rank selects the same indices, in which case
    the values alone can be allreduced ("allreduce", random-k).
    """

    collective = "sparse"

    def __init__(self, density: Density = 0.001):
        self.density = DensitySpec(density)
        self._calls = 0  # step counter for callers of the name-less compress() (see RandomK)

    def k_for(self, name: str, numel: int, step: int = 0) -> int:
        """Elements to send from a bucket of ``numel`` elements: ``max(int(numel*density), 1)``."""
        return max(int(numel * self.density(name, numel)), 1) if numel > 0 else 0

    def select(self, ops: TensorOps, acc: Any, name: str = "", step: int = 0) -> tuple[Any, Any]:
        """(values, int64 indices ascending) to send from the flat ``acc``; never modifies acc."""
        raise NotImplementedError

    # -- the Compressor ABC (name-less, stateless use) -----------------------------------------
    def compress(self, ops: TensorOps, flat: Any) -> tuple[Any, Any]:
        step, self._calls = self._calls, self._calls + 1
        vals, idx = self.select(ops, flat, "", step)
        if self.collective == "allreduce":
            return vals, (idx, ops.numel(flat), flat)
        return (vals, idx), (ops.numel(flat), flat)

    def decompress(self, ops: TensorOps, payload: Any, ctx: Any) -> Any:
        if self.collective == "allreduce":
            idx, n, like = ctx
            vals = payload
        else:
            (vals, idx), (n, like) = payload, ctx
        out = ops.zeros(n, ops.dtype_name(vals), like=like)
        return ops.scatter_add(out, idx, vals)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(density={self.density!r})"


class TopKCompressor(SparseCompressor):
    """The k largest-magnitude elements of the bucket, exactly (ties to the lower index)."""

    name = "topk"

    def select(self, ops: TensorOps, acc: Any, name: str = "", step: int = 0) -> tuple[Any, Any]:
        return ops.topk_abs(acc, self.k_for(name, ops.numel(acc), step))
