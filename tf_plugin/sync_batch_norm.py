"""``SyncBatchNormalization``: Keras 3 batch normalization whose training-time moments are
computed over the global batch (every rank's samples), Horovod's ``hvd.SyncBatchNormalization``.

The per-rank sums ``Σx``, ``Σx²`` and the sample count go through one differentiable
``allreduce(op=Sum)`` (:func:`tf_plugin.functions.allreduce`), so the gradient of a rank's loss
reaches every rank's inputs. ``mean = Σx / n``, ``var = Σx² / n - mean²`` (Horovod's form),
accumulated in float32 for half-precision inputs. Inference uses the moving statistics, which
are then the same on every rank (updated from the same global moments).
"""
from __future__ import annotations

import keras
import tensorflow as tf

from hvd_commopt.errors import ConfigError
from hvd_commopt.reduce import Sum

from ._compat import batch_norm_moments_hook, batch_norm_reduction_axes
from .functions import _comm, allreduce

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with moments over all ranks (same arguments, plus
    ``process_set``/``communicator``; TF1's ``fused=`` is accepted and ignored)."""

    def __init__(self, *args, process_set=None, communicator=None, **kwargs):
        if not batch_norm_moments_hook():
            raise ConfigError("SyncBatchNormalization: this Keras BatchNormalization does not take its moments from "
                              "the method SyncBatchNormalization overrides (Keras 3's _moments); use Keras 3 "
                              "(docs/versions.md#supported-versions)")
        kwargs.pop("fused", None)
        super().__init__(*args, **kwargs)
        self._hco_process_set = process_set
        self._hco_communicator = communicator

    def _moments(self, inputs, mask):  # Keras' hook: its presence is checked in __init__ (_compat)
        comm = _comm(self._hco_communicator, self._hco_process_set)
        if comm.size == 1:
            return super()._moments(inputs, mask)
        if mask is not None:
            raise ConfigError("SyncBatchNormalization does not support masks")
        x = tf.convert_to_tensor(inputs)
        dtype = tf.float32 if x.dtype in (tf.float16, tf.bfloat16) else x.dtype
        x = tf.cast(x, dtype)
        axes = batch_norm_reduction_axes(self, x)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), dtype)
        s = tf.reshape(tf.reduce_sum(x, axes), [-1])
        sq = tf.reshape(tf.reduce_sum(tf.square(x), axes), [-1])
        k = tf.shape(s)[0]
        total = allreduce(tf.concat([s, sq, tf.reshape(count, [1])], 0), op=Sum, communicator=comm,
                          name=f"{self.name}.moments")
        n = total[-1]
        mean = total[:k] / n
        var = total[k:2 * k] / n - tf.square(mean)
        return tf.cast(mean, inputs.dtype), tf.cast(var, inputs.dtype)
