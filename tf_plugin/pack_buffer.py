"""A lazy fusion buffer for TFOps (:class:`PackBuffer`), kept apart so that tf_plugin/ops.py stays
under 400 lines.

TF tensors are immutable. :meth:`tf_plugin.ops.TFOps.empty` returns a PackBuffer: the engine packs
each gradient into its bucket with ``copy_into``; on an immutable tensor each packing would rebuild
the whole buffer (O(bucket) per tensor), and eager in-place writes into a ``tf.Variable`` were
measured at ~1 GB/s plus ~0.3 ms of dispatch per tensor (and reading a variable slice by slice
copies it each time). A PackBuffer only records ``(offset, tensor)`` parts; the first other TFOps
method that receives it materialises it with **one** ``tf.concat`` per bucket. Every TFOps method
accepts a PackBuffer wherever it accepts a tensor; nothing outside TFOps sees one.
"""
from __future__ import annotations

import tensorflow as tf

__all__ = ["PackBuffer", "value_of"]


class PackBuffer:
    """A 1-D fusion buffer of ``n`` elements assembled lazily from ``(offset, tensor)`` parts."""

    __slots__ = ("n", "dtype", "device", "parts", "base", "_value")

    def __init__(self, n: int, dtype: tf.DType, device: str | None, parts=(), base=None):
        self.n, self.dtype, self.device = int(n), dtype, device
        self.parts = list(parts)
        self.base = base          # a materialised earlier value (positions not overwritten keep it)
        self._value = None

    @property
    def shape(self) -> tf.TensorShape:
        return tf.TensorShape([self.n])

    def value(self) -> tf.Tensor:
        if self._value is None:
            self._value = self._materialise()
        return self._value

    def _materialise(self) -> tf.Tensor:
        parts = sorted(self.parts, key=lambda p: p[0])
        covered, pos = True, 0
        for off, t in parts:
            if off != pos:
                covered = False
                break
            pos += int(t.shape[0])
        with tf.device(self.device):
            if covered and pos == self.n:  # the engine's case: every member packed once
                return parts[0][1] if len(parts) == 1 else tf.concat([t for _, t in parts], axis=0)
            out = self.base if self.base is not None else tf.zeros([self.n], dtype=self.dtype)
            for off, t in self.parts:  # in write order: later writes win
                m = int(t.shape[0])
                out = tf.concat([out[:off], t, out[off + m:]], axis=0)
            return out


def value_of(x):
    """``x``, materialised if it is a PackBuffer."""
    return x.value() if isinstance(x, PackBuffer) else x
