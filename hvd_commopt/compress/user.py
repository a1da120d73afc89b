"""User-written compressors with Horovod's interface, accepted wherever a Compressor is.

Horovod's custom compressors are classes (or objects) with ``compress(tensor) -> (tensor, ctx)``
and ``decompress(tensor, ctx) -> tensor``, no ops argument. :class:`UserCompressor` wraps one so
that the dense reducer calls it like ours; as in Horovod, the compressed payloads are summed
element-wise by the allreduce, so the user's compression must commute with the sum (a cast does,
a quantiser with per-rank scales does not). See docs/horovod_api.md#compressors.
"""
from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

from ..tensor_ops import TensorOps
from .base import Compressor

__all__ = ["HorovodCompressor", "UserCompressor", "as_user_compressor"]


@runtime_checkable
class HorovodCompressor(Protocol):
    """Horovod's compressor interface (an object, or a class with static methods)."""

    def compress(self, tensor: Any) -> tuple[Any, Any]: ...

    def decompress(self, tensor: Any, ctx: Any) -> Any: ...


def _positional(fn: Any) -> int | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return sum(1 for p in sig.parameters.values()
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


class UserCompressor(Compressor):
    """A Horovod-style compressor object (or class with static methods) as a core Compressor."""

    lossless = False  # unknown: an error-feedback memory keeps whatever it loses

    def __init__(self, user: Any):
        self.user = user
        self.name = f"user:{getattr(user, '__name__', type(user).__name__)}"

    def compress(self, ops: TensorOps, flat: Any) -> tuple[Any, Any]:
        return self.user.compress(flat)

    def decompress(self, ops: TensorOps, payload: Any, ctx: Any) -> Any:
        return self.user.decompress(payload, ctx)

    def __repr__(self) -> str:
        return f"UserCompressor({self.user!r})"


def as_user_compressor(obj: Any) -> UserCompressor | None:
    """A UserCompressor when ``obj`` has Horovod's ``compress(tensor)`` / ``decompress(tensor,
    ctx)`` (one and two required arguments), else None."""
    if not isinstance(obj, HorovodCompressor) or not (callable(obj.compress) and callable(obj.decompress)):
        return None
    if _positional(obj.compress) != 1 or _positional(obj.decompress) != 2:
        return None
    return UserCompressor(obj)
