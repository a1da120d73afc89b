"""DiLoCo and the quantiser through tf_plugin.DistributedOptimizer (Keras), on in-process ranks:
SGD inside, the built-in Nesterov outer step (docs/diloco.md#update-rule)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvd_commopt import Compression, Schedule, run_ranks  # noqa: E402
import tf_plugin as hco  # noqa: E402
from tests.tf.test_tf_adapter import D_IN, D_OUT, _run_schedule, data  # noqa: E402


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("sched", [Schedule.diloco(2), Schedule.diloco(2, outer_lr=1.0, outer_momentum=0.0),
                                   Schedule.diloco(2, fragments=2, overlap=1)], ids=["diloco", "plain", "streaming"])
def test_diloco_with_keras_sgd_inside_runs_and_ranks_agree(graph, sched):
    out = run_ranks(2, lambda comm: _run_schedule(sched, graph, comm)[0])
    for a, b in zip(out[0], out[1]):
        np.testing.assert_array_equal(a, b)
        assert np.isfinite(a).all()


def test_diloco_H1_plain_outer_equals_sync_sgd():
    ref = run_ranks(2, lambda comm: _run_schedule(Schedule.sync(), False, comm)[0])
    got = run_ranks(2, lambda comm: _run_schedule(Schedule.diloco(1, outer_lr=1.0, outer_momentum=0.0), False,
                                                  comm)[0])
    for r in range(2):
        for a, b in zip(ref[r], got[r]):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_diloco_with_quantized_pseudo_gradients_under_keras():
    def body(comm):
        rng = np.random.default_rng(0)
        w = tf.Variable(rng.standard_normal((D_IN, D_OUT)).astype(np.float32))
        opt = hco.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), schedule=Schedule.diloco(2),
                                       compression=Compression.quantize(4, density=0.5), communicator=comm)
        for s in range(6):
            x, y = data(comm.rank, seed=s)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.matmul(x, w)))
            opt.apply_gradients([(tape.gradient(loss, w), w)])
        opt.finalize()
        return [w.numpy()]
    out = run_ranks(2, body)
    for a, b in zip(out[0], out[1]):
        np.testing.assert_array_equal(a, b)
