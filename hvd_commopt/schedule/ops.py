"""Element-wise update primitives the schedulers need beyond :class:`~hvd_commopt.tensor_ops.TensorOps`.

The delayed-update algorithms do arithmetic on whole models (the local optimizer, the replica
copy, the ternary quantizer of CD-SGD). That arithmetic is written once, in the core, against
these five primitives; each adapter implements them with native ops (``torch_plugin.schedule.
TorchUpdateOps``), and :class:`NumpyUpdateOps` implements them for host arrays (unit tests).

Why a separate protocol rather than more methods on ``TensorOps``: only the schedulers need them,
so an adapter that does not offer delayed schedules still satisfies ``TensorOps`` unchanged
(``tf_plugin.schedule.TFUpdateOps`` implements them for TensorFlow); :func:`require_update_ops`
turns a missing one into a clear ConfigError.

Functional convention (as in ``TensorOps``): every method returns its result and callers use the
returned value; in-place implementations return their (modified) first argument.

Bit-exactness: ``axpy_`` must be the framework's own fused ``y + alpha*x`` kernel (PyTorch's
``add_(x, alpha=...)``) because that is what ``torch.optim.SGD`` uses; the local optimizer then
performs the very same floating-point operations as the wrapped optimizer (spec T-OD-1).
"""
from __future__ import annotations

import hashlib
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError
from ..numpy_ops import NumpyOps, numpy_dtype

__all__ = ["UpdateOps", "NumpyUpdateOps", "require_update_ops", "digest"]

Tensor = Any


@runtime_checkable
class UpdateOps(Protocol):
    """Element-wise primitives on tensors of any (identical) shape."""

    def copy_(self, dst: Tensor, src: Tensor) -> Tensor:
        """``dst[...] = src``; returns dst."""
        ...

    def axpy_(self, y: Tensor, alpha: float, x: Tensor) -> Tensor:
        """``y + alpha*x`` with the framework's fused kernel (in place into y allowed)."""
        ...

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        """A new tensor ``a*b`` (element-wise)."""
        ...

    def ternarize_(self, r: Tensor, theta: float, dtype: str) -> tuple[Tensor, Tensor]:
        """MXNet's 2-bit quantizer on an error-feedback residual (spec §5.1).

        Returns ``(r', s)`` with ``s`` in {-1, 0, +1} of integer ``dtype``: ``s = +1`` where
        ``r >= theta``, ``-1`` where ``r <= -theta``, else 0; and ``r' = r - theta*s`` (in place
        allowed). ``r - theta*(+-1)`` is exactly MXNet's ``r -= theta`` / ``r += theta``.
        """
        ...

    def to_numpy(self, t: Tensor): ...


def require_update_ops(ops: Any, what: str) -> UpdateOps:
    """Return ``ops`` if it offers the update primitives, else raise a ConfigError naming the fix."""
    if not isinstance(ops, UpdateOps):
        raise ConfigError(
            f"{what} needs the tensor update primitives (copy_, axpy_, mul, ternarize_), which "
            f"{type(ops).__name__} lacks. Use torch_plugin.DistributedOptimizer (TorchUpdateOps) or "
            f"hvd_commopt.schedule.NumpyUpdateOps, or implement hvd_commopt.schedule.UpdateOps.")
    return ops


def digest(ops: Any, tensors: list) -> str:
    """sha256 over the tensors' bytes, in the order given (for replica consistency checks)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(np.ascontiguousarray(ops.to_numpy(t)).tobytes())
    return h.hexdigest()


class NumpyUpdateOps(NumpyOps):
    """:class:`~hvd_commopt.numpy_ops.NumpyOps` plus the update primitives (host arrays)."""

    def copy_(self, dst, src):
        np.copyto(dst, src)
        return dst

    def axpy_(self, y, alpha, x):
        y += x * y.dtype.type(alpha)
        return y

    def mul(self, a, b):
        return a * b

    def ternarize_(self, r, theta, dtype):
        th = r.dtype.type(theta)
        s = (r >= th).astype(numpy_dtype(dtype)) - (r <= -th).astype(numpy_dtype(dtype))
        r -= s.astype(r.dtype) * th  # exact: theta*s is +-theta or 0
        return r, s
