"""TFOps' DGC clipping with no host read (docs/dgc.md#clip-on-device): a mixin, so that
tf_plugin/ops.py stays under 400 lines."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["ClipToNorm"]


class ClipToNorm:
    flatten: Any

    """``TensorOps.clip_to_norm_`` for TF tensors: ``TFOps.norm``'s sum of squares, the factor
    rounded to t's dtype as ``TFOps.scale`` rounds it, all of it graph ops."""

    def clip_to_norm_(self, t, max_norm, eps):
        t = self.flatten(t)  # a fusion buffer's value (TFOps.flatten)
        acc = tf.float64 if t.dtype == tf.float64 else tf.float32
        norm = tf.cast(tf.sqrt(tf.reduce_sum(tf.square(tf.cast(t, acc)))), tf.float64)
        coef = tf.constant(max_norm, tf.float64) / (norm + tf.constant(eps, tf.float64))
        return t * tf.cast(tf.where(coef < 1, coef, tf.constant(1.0, tf.float64)), t.dtype)
