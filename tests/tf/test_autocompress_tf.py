"""compression="auto" through tf_plugin's Keras optimizer on in-process ranks: rank 0's choice
on every rank, the report on ``opt.comm_engine``, identical weights (docs/auto-compression.md)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import tf_plugin as hco  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.fusion import AlphaBeta, CostModel  # noqa: E402

SLOW = CostModel(AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), ranks=2)
# 1 MB/s: the 21.5 KB bucket's 21 ms of sending dwarfs a cast's cost. Both in-process ranks time the
# candidates at once (docs/auto-compression.md#costs-every-rank), and TensorFlow's eager ops on two
# threads measured a bf16 cast of its 5 380 elements at 1.2 ms, more than the 1.1 ms it saves at 10 MB/s.
SLOWER = CostModel(AlphaBeta(1e-3, 1e-6), AlphaBeta(1e-3, 1e-6), AlphaBeta(1e-3, 1e-6), ranks=2)


def make_model():
    m = keras.Sequential([keras.layers.Input((16,)), keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(4)])
    m.set_weights([np.full(w.shape, 0.01, np.float32) * (i + 1) for i, w in enumerate(m.get_weights())])
    return m


def test_keras_optimizer_with_auto_agrees_across_ranks():
    models = [make_model() for _ in range(2)]  # built here: Keras' name counters are not thread-safe

    def body(comm):
        model = models[comm.rank]
        opt = hco.DistributedOptimizer(keras.optimizers.SGD(0.05), communicator=comm,
                                       compression=Compression.auto(cost_model=SLOWER, margin=1e3))

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        rng = np.random.default_rng(comm.rank)
        for _ in range(1 + 3 + 5 + 1 + 5):
            x = rng.standard_normal((8, 16)).astype(np.float32)
            step(x, x[:, :4].argmax(1).astype(np.int64))
        rep = opt.comm_engine.compression_report
        assert rep["decisions"] == 1 and all(b["why"] for b in rep["buckets"])
        return [w.numpy() for w in model.trainable_variables], [(b["bucket"], b["method"]) for b in rep["buckets"]]
    (w0, m0), (w1, m1) = run_ranks(2, body)
    assert m0 == m1 and any(m != "none" for _, m in m0)  # the kernel is compressed on the slow link
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)


def _kinds_after_one_step(make, optimizer, x):
    models = [make() for _ in range(2)]

    def body(comm):
        model = models[comm.rank]
        opt = hco.DistributedOptimizer(optimizer(), communicator=comm, compression=Compression.auto(cost_model=SLOW))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        red = opt.comm_engine.reducer
        return red.kinds.optimizer, red.kinds.model.kind, red.options.allow
    r0, r1 = run_ranks(2, body)
    assert r0 == r1
    return r0


def test_keras_models_get_the_candidates_of_their_kinds():
    """docs/auto-compression.md#kinds through the Keras optimizer: Conv2D kernels are 4-D, Keras'
    SGD and Adam are recognised by class."""
    def conv():
        return keras.Sequential([keras.layers.Input((8, 8, 3)), keras.layers.Conv2D(16, 3), keras.layers.Conv2D(16, 3),
                                 keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    img = np.ones((2, 8, 8, 3), np.float32)
    assert _kinds_after_one_step(conv, lambda: keras.optimizers.SGD(0.05), img) == (
        "sgd", "convolutional", ("none", "bf16", "quant8", "quant4"))
    assert _kinds_after_one_step(make_model, lambda: keras.optimizers.Adam(1e-3), np.ones((2, 16), np.float32)) == (
        "adaptive", "other", ("none", "bf16", "quant8"))  # int4 missed the 6.4M GPT under AdamW
