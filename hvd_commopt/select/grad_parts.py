"""A bucket's gradient before it is packed: its tensors, read where they are (docs/selection.md#grad-parts).

The engine copies each gradient into its bucket's fusion buffer as it arrives. When the bucket's
only reader is the native top-k's pass (the exact top-k with momentum correction, on host
memory), that copy is a write and a read of the whole bucket for nothing: the pass can read the
gradients in place. The engine then hands the reducer a :class:`GradParts` instead of the packed
buffer; everything else that needs the bucket's values calls :meth:`GradParts.pack`, which makes
the copies the engine would have made (the same bytes), so every path sees the same values.
"""
from __future__ import annotations

from typing import Any

__all__ = ["GradParts", "packed", "like"]


class GradParts:
    """The gradients of one bucket, not copied into ``buf`` (its fusion buffer) yet.

    Attributes:
        buf: the fusion buffer: its size, dtype and device are the bucket's; its values are the
            gradients only once :meth:`pack` ran.
        parts: ``(offset, tensor)`` by offset, covering the bucket (empty once packed).
    """

    __slots__ = ("ops", "buf", "parts")

    def __init__(self, ops: Any, buf: Any, parts: list):
        self.ops, self.buf = ops, buf
        self.parts = tuple(sorted(parts, key=lambda p: p[0]))

    @property
    def is_packed(self) -> bool:
        return not self.parts

    def pack(self) -> Any:
        """The bucket's gradient in ``buf``, copied there now unless it already was."""
        for offset, t in self.parts:
            self.buf = self.ops.copy_into(self.buf, offset, t)
        self.parts = ()
        return self.buf


def packed(flat: Any) -> Any:
    """``flat`` as a tensor: a :class:`GradParts` packed first."""
    return flat.pack() if isinstance(flat, GradParts) else flat


def like(flat: Any) -> Any:
    """A tensor of ``flat``'s size, dtype and device (not its values): a :class:`GradParts`'s buffer."""
    return flat.buf if isinstance(flat, GradParts) else flat
