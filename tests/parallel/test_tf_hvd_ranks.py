"""tf_plugin's Horovod API under a real ``mpirun -np 2``: every rank runs this file with pytest.

Launched by tests/parallel/test_tf_hvd_mpi.py; collected on its own (no launcher, size 1) every
test skips. Each rank asserts; mpirun reports a failing rank as a non-zero exit.
"""
import hashlib

import numpy as np
import pytest

from tests.parallel.ranks import init_tf_plugin

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
hco = init_tf_plugin("tests/parallel/test_tf_hvd_mpi.py")  # skips outside mpirun; one TF thread per rank
RANK, SIZE = hco.rank(), hco.size()


def same_on_all_ranks(arrays):
    h = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()
    assert len(set(hco.allgather_object(h))) == 1


@pytest.mark.parametrize("graph", [False, True])
def test_gradients_through_collectives(graph):
    x = tf.Variable(tf.ones([4, 2]) * (RANK + 1))

    def run():
        with tf.GradientTape(persistent=True) as tape:
            s = hco.allreduce(x, op=hco.Sum)
            a, _ = hco.alltoall(x, splits=[2, 2])
            rs = hco.reducescatter(x, op=hco.Sum)
        return [tape.gradient(y, x) for y in (s, a, rs)]
    gs, ga, grs = (tf.function(run) if graph else run)()
    np.testing.assert_array_equal(gs.numpy(), np.full((4, 2), SIZE))
    np.testing.assert_array_equal(ga.numpy(), np.ones((4, 2)))
    np.testing.assert_array_equal(grs.numpy(), np.full((4, 2), SIZE))


def test_adasum_tape_training_keeps_ranks_identical():
    w = tf.Variable(np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2))
    rng = np.random.default_rng(RANK)
    for _ in range(3):
        x = tf.constant(rng.standard_normal((4, 3)).astype(np.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(x @ w))
        g = hco.DistributedGradientTape(tape, op=hco.Adasum).gradient(loss, [w])[0]
        w.assign_sub(0.01 * g)
    same_on_all_ranks([w.numpy()])


def test_adasum_exact_two_ranks():
    """T-AS-1 and T-AS-2 over MPI through the TF adapter."""
    orth = hco.allreduce(tf.constant([1.0, 0.0] if RANK == 0 else [0.0, 3.0]), op=hco.Adasum)
    np.testing.assert_array_equal(orth.numpy(), [1.0, 3.0])
    same = hco.allreduce(tf.constant([0.25, -2.0, 7.0]), op=hco.Adasum)
    np.testing.assert_array_equal(same.numpy(), [0.25, -2.0, 7.0])


def test_keras_fit_backward_passes_per_step_and_sync_batch_norm():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), hco.SyncBatchNormalization(),
                              keras.layers.Dense(1)])
    hco.broadcast_variables(model.variables, 0)
    opt = hco.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(10 + RANK)
    x, y = rng.standard_normal((32, 4)).astype(np.float32), rng.standard_normal((32, 1)).astype(np.float32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == 2
    same_on_all_ranks([v.numpy() for v in model.variables])


def test_mismatch_is_failed_precondition_on_every_rank():
    with pytest.raises(tf.errors.FailedPreconditionError):
        hco.allreduce(tf.ones([17, 6] if RANK == 0 else [17, 2, 3]))
    hco.barrier()
