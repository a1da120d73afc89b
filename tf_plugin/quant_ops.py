"""TFOps' low-bit quantisation kernels (docs/quantize.md#device): ``quantize_blocks``,
``dequantize_blocks``, ``pack_bits``, ``unpack_bits`` of :class:`hvd_commopt.tensor_ops.TensorOps`
as TF ops, on the tensor's device. A mixin, so that tf_plugin/ops.py stays under 400 lines.

Bit-exact with the NumPy reference (:class:`hvd_commopt.numpy_ops.NumpyOps`): float32 division
and products, ``tf.round`` rounds half to even as ``numpy.rint`` does, and the packing is one bit
stream, least significant bit first (for 2 and 4 bits the reference's whole codes per byte).
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["QuantKernels"]


def _levels(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _blocks(t: Any, n: int, block: int) -> tf.Tensor:
    """t's n float32 values zero-padded to whole blocks, as (blocks, block)."""
    nb = -(-n // block)
    return tf.reshape(tf.pad(tf.reshape(t, [-1]), [[0, nb * block - n]]), [nb, block])


class QuantKernels:
    """The quantisation kernels of :class:`tf_plugin.ops.TFOps`."""

    flatten: Any

    def quantize_blocks(self, t, bits, block):
        t = self.flatten(t)  # a fusion buffer's value (TFOps.flatten)
        n, q = int(t.shape[0]), _levels(bits)
        xp = _blocks(t, n, block)
        scale = tf.reduce_max(tf.abs(xp), axis=1) / tf.constant(q, tf.float32)
        safe = tf.where(scale > 0, scale, tf.ones_like(scale))
        codes = tf.clip_by_value(tf.round(xp / safe[:, None]), -float(q), float(q))
        dec = tf.reshape(codes * scale[:, None], [-1])[:n]
        return scale, tf.cast(tf.reshape(codes, [-1])[:n] + float(q), tf.uint8), dec

    def dequantize_blocks(self, scales, codes, bits, block):
        codes = tf.reshape(codes, [-1])
        n = int(codes.shape[0])
        c = _blocks(tf.cast(codes, tf.float32) - tf.constant(_levels(bits), tf.float32), n, block)
        return tf.reshape(c * scales[:, None], [-1])[:n]

    def pack_bits(self, codes, bits):
        codes = tf.reshape(codes, [-1])
        if bits == 8:
            return codes
        n = int(codes.shape[0])
        shifts = tf.range(bits, dtype=tf.int32)
        stream = tf.reshape(tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.cast(codes, tf.int32)[:, None], shifts), 1), [-1])
        stream = tf.pad(stream, [[0, -(n * bits) % 8]])
        out = tf.reduce_sum(tf.bitwise.left_shift(tf.reshape(stream, [-1, 8]), tf.range(8, dtype=tf.int32)), axis=1)
        return tf.cast(out, tf.uint8)  # disjoint bits: the sum is the or

    def unpack_bits(self, buf, n, bits):
        buf = tf.reshape(buf, [-1])
        if bits == 8:
            return buf[:n]
        stream = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.cast(buf, tf.int32)[:, None], tf.range(8, dtype=tf.int32)), 1)
        planes = tf.reshape(tf.reshape(stream, [-1])[:n * bits], [n, bits])
        return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(planes, tf.range(bits, dtype=tf.int32)), axis=1), tf.uint8)

    def topk_abs_rows(self, t, width, k):
        t = self.flatten(t)
        rows = int(t.shape[0]) // width
        keys = tf.minimum(tf.cast(tf.bitcast(tf.abs(t), tf.int32), tf.int64), 0x7F800001)
        comp = tf.reshape(keys, [rows, width]) * width + tf.range(width - 1, -1, -1, dtype=tf.int64)
        return tf.reshape(tf.cast(tf.math.top_k(comp, k=k, sorted=True).indices, tf.int64), [-1])  # unique keys
