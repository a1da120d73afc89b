"""Sparse compression under Keras Adam (docs/adaptive-optimizers.md), in-process ranks: the Keras host
reports the optimizer family through the typed seam, and under Adam the sparse reducer's default
dense warm-up makes the first steps Keras Adam's S-SGD bit for bit."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import keras  # noqa: E402

import tf_plugin as hco  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.host import ADAPTIVE  # noqa: E402
from tf_plugin.host import KerasScheduleHost  # noqa: E402
from tests.tf.test_tf_adapter import D_IN, D_OUT, data  # noqa: E402


def test_keras_host_reports_the_family():
    for opt in (keras.optimizers.Adam(), keras.optimizers.AdamW(), keras.optimizers.RMSprop()):
        assert KerasScheduleHost(opt, [], []).optimizer_family() == ADAPTIVE
    assert KerasScheduleHost(keras.optimizers.SGD(0.1), [], []).optimizer_family() == "sgd"


def _train(compression, steps=3):
    def body(comm):
        rng = np.random.default_rng(0)
        w = tf.Variable(rng.standard_normal((D_IN, D_OUT)).astype(np.float32))
        opt = hco.DistributedOptimizer(keras.optimizers.Adam(0.01), compression=compression(),
                                       communicator=comm)
        for s in range(steps):
            x, y = data(comm.rank, seed=s)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.matmul(x, w)))
            opt.apply_gradients([(tape.gradient(loss, w), w)])
        return w.numpy()
    return run_ranks(2, body)


def test_keras_adam_warmup_is_dense_ssgd_bit_for_bit():
    ref = _train(lambda: Compression.none)
    got = _train(lambda: Compression.topk(0.05))
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)
