"""tf_plugin's Horovod API surface on in-process ranks (threads): gradients through the
collectives, scale factors per dtype, IndexedSlices, grouped ops, alltoall, reducescatter,
process queries, errors as Horovod's TF error classes, the partial tape, Keras local
aggregation, SyncBatchNormalization and op=Adasum (docs/adasum.md#optimizer)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import tf_plugin as hco  # noqa: E402
from hvd_commopt import run_ranks  # noqa: E402
from hvd_commopt.errors import ConfigError  # noqa: E402


def ranks(body, size=2):
    return run_ranks(size, body)


def test_gradients_through_allreduce_allgather_broadcast():
    def body(comm):
        r = comm.rank
        x = tf.Variable(tf.ones([3, 2]) * (r + 1))
        with tf.GradientTape(persistent=True) as tape:
            s = hco.allreduce(x, op=hco.Sum, communicator=comm)
            a = hco.allreduce(x, communicator=comm)
            g = hco.allgather(x[:r + 1], communicator=comm)
            b = hco.broadcast(x, 1, communicator=comm)
        return [tape.gradient(y, x).numpy() for y in (s, a, g, b)]
    for r, (gs, ga, gg, gb) in enumerate(ranks(body)):
        np.testing.assert_array_equal(gs, np.full((3, 2), 2.0))  # Sum: the sum of the ones
        np.testing.assert_array_equal(ga, np.ones((3, 2)))        # Average: their average
        expect = np.zeros((3, 2))
        expect[:r + 1] = 1.0                                      # only the rows this rank sent
        np.testing.assert_array_equal(gg, expect)
        np.testing.assert_array_equal(gb, np.ones((3, 2)) * (r == 1))  # root only


def test_integer_and_half_scale_factors_as_horovod():
    def body(comm):
        i = hco.allreduce(tf.constant([3, 5, -7], tf.int32), op=hco.Sum, prescale_factor=0.5, communicator=comm)
        j = hco.allreduce(tf.constant([3, 5, -7], tf.int64), op=hco.Sum, postscale_factor=0.3, communicator=comm)
        h = hco.allreduce(tf.constant([0.1, 3.3], tf.float16), op=hco.Sum, prescale_factor=0.7, communicator=comm)
        return i.numpy(), j.numpy(), h.numpy()
    for i, j, h in ranks(body):
        np.testing.assert_array_equal(i, [2, 4, -6])  # trunc(x * 0.5) summed
        np.testing.assert_array_equal(j, np.trunc(np.array([6, 10, -14]) * 0.3).astype(np.int64))
        one = (np.float32(np.float16([0.1, 3.3])) * np.float32(0.7)).astype(np.float16)
        np.testing.assert_array_equal(h, one + one)   # scaled in float32, rounded once


def test_indexed_slices_allreduce_is_an_allgather():
    def body(comm):
        r = comm.rank
        sl = tf.IndexedSlices(tf.ones([2, 3]) * (r + 1), tf.constant([r, r + 1]))
        out = hco.allreduce(sl, communicator=comm)
        errors = []
        for kw in (dict(op=hco.Max), dict(op=hco.Adasum), dict(op=hco.Sum, prescale_factor=2.0)):
            try:
                hco.allreduce(sl, communicator=comm, **kw)
            except NotImplementedError:
                errors.append(True)
        return out, errors
    for out, errors in ranks(body):
        assert isinstance(out, tf.IndexedSlices)
        np.testing.assert_array_equal(out.indices.numpy(), [0, 1, 1, 2])
        np.testing.assert_array_equal(out.values.numpy(), np.repeat([[0.5], [0.5], [1.0], [1.0]], 3, axis=1))
        assert errors == [True, True, True]


def test_grouped_alltoall_reducescatter_with_gradients():
    def body(comm):
        r = comm.rank
        x = tf.Variable(tf.reshape(tf.range(8, dtype=tf.float32), [4, 2]) + 10 * r)
        with tf.GradientTape(persistent=True) as tape:
            g = hco.grouped_allreduce([x, 2 * x], op=hco.Sum, communicator=comm)
            a, rows = hco.alltoall(x, splits=[1 + r, 3 - r], communicator=comm)
            rs = hco.reducescatter(x, op=hco.Sum, communicator=comm)
            ga = hco.grouped_allgather([x, x[:1]], communicator=comm)
        grads = [tape.gradient(y, x).numpy() for y in (g, a, rs, ga)]
        mx = hco.grouped_allreduce([tf.constant([r, 5 - r])], op=hco.Max, communicator=comm)[0]
        return g[0].numpy(), a.numpy(), rows.numpy(), rs.numpy(), [t.shape[0] for t in ga], grads, mx.numpy()
    base = np.arange(8, dtype=np.float32).reshape(4, 2)
    out = ranks(body)
    for r, (g, a, rows, rs, ga_rows, grads, mx) in enumerate(out):
        np.testing.assert_array_equal(g, 2 * base + 10)
        if r == 0:
            np.testing.assert_array_equal(a, np.concatenate([base[:1], base[:2] + 10]))
            np.testing.assert_array_equal(rows, [1, 2])
        else:
            np.testing.assert_array_equal(a, np.concatenate([base[1:], base[2:] + 10]))
            np.testing.assert_array_equal(rows, [3, 2])
        np.testing.assert_array_equal(rs, (2 * base + 10)[2 * r:2 * r + 2])
        assert ga_rows == [8, 2]
        np.testing.assert_array_equal(grads[0], np.full((4, 2), 6.0))   # 2 ranks x (1 + 2)
        np.testing.assert_array_equal(grads[1], np.ones((4, 2)))        # every row was sent once
        np.testing.assert_array_equal(grads[2], np.full((4, 2), 2.0))   # Sum: gathered x size
        expect = np.ones((4, 2))
        expect[0] += 1.0                                                # x[:1] gathered too
        np.testing.assert_array_equal(grads[3], expect)
        np.testing.assert_array_equal(mx, [1, 5])


def test_mismatch_and_argument_errors_are_horovods_tf_errors():
    def body(comm):
        r = comm.rank
        got = []
        try:  # same number of elements, different shape
            hco.allreduce(tf.ones([17, 6] if r == 0 else [17, 2, 3]), communicator=comm)
        except tf.errors.FailedPreconditionError as e:
            got.append(isinstance(e, hco.RankMismatchError))
        try:
            hco.broadcast(tf.ones([2]), root_rank=r, communicator=comm)
        except tf.errors.FailedPreconditionError:
            got.append(True)
        try:
            hco.alltoall(tf.ones([3]), communicator=comm)
        except tf.errors.InvalidArgumentError as e:
            got.append(isinstance(e, ConfigError))
        return got
    assert ranks(body) == [[True, True, True]] * 2


def test_process_queries_objects_and_build_info():
    def body(comm):
        hco.barrier(communicator=comm)
        return (hco.allgather_object({"r": comm.rank}, communicator=comm), int(hco.join(communicator=comm)))
    for objs, last in ranks(body):
        assert objs == [{"r": 0}, {"r": 1}]
        assert last in (0, 1)
    hco.init()
    try:
        assert int(hco.rank_op()) == hco.rank() and int(hco.size_op()) == hco.size()
        assert int(hco.local_rank_op()) == hco.local_rank() and int(hco.local_size_op()) == hco.local_size()
        assert hco.rank_op().dtype == tf.int32
        assert hco.nccl_built() == 0 and hco.gloo_built() is False and hco.ccl_built() is False
        assert hco.util._executing_eagerly() and hco._executing_eagerly()
        with pytest.raises(RuntimeError, match="broadcast_variables"):
            hco.broadcast_global_variables(0)
        v = tf.Variable([1.0, 2.0])
        assert hco.broadcast_([v], 0)[0] is v
        c, ctx = hco.Compression.fp16.compress(tf.constant([1.5, 2.0]))  # Horovod's compressor interface
        assert c.dtype == tf.float16 and hco.Compression.fp16.decompress(c, ctx).dtype == tf.float32
    finally:
        hco.shutdown()


def test_partial_tape_and_sparse_as_dense_false():
    def body(comm):
        r = comm.rank
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
        for v in model.trainable_weights:
            v.assign(tf.ones(v.shape) * (r + 1))
        x = np.ones((1, 3), np.float32) * (r + 1)
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(model(x))
        plain = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
        t = hco.PartialDistributedGradientTape(tape, local_layers=model.layers[0], communicator=comm)
        part = [g.numpy() for g in t.gradient(loss, model.trainable_weights)]
        local, glob = t.get_local_and_global_gradients(loss, model.trainable_weights)
        emb = tf.Variable(tf.ones([5, 2]))
        with tf.GradientTape() as tape2:
            y = tf.reduce_sum(tf.gather(emb, [r, r + 1]))
        ge = hco.DistributedGradientTape(tape2, sparse_as_dense=False, communicator=comm).gradient(y, [emb])[0]
        return plain, part, len(local), len(glob), ge
    out = ranks(body)
    for r, (plain, part, nl, ng, ge) in enumerate(out):
        np.testing.assert_allclose(part[0], plain[0] / 2)  # local layer: scaled by 1/size only
        np.testing.assert_allclose(part[1], plain[1] / 2)
        np.testing.assert_allclose(part[2], (out[0][0][2] + out[1][0][2]) / 2)  # averaged
        assert (nl, ng) == (2, 2)
        assert isinstance(ge, tf.IndexedSlices)
        np.testing.assert_array_equal(ge.indices.numpy(), [0, 1, 1, 2])


@pytest.mark.parametrize("graph", [False, True])
def test_keras_backward_passes_per_step_aggregates_locally(graph):
    def body(comm):
        r = comm.rank
        v = keras.Variable(np.zeros(2, np.float32))
        opt = hco.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                                       average_aggregated_gradients=True, communicator=comm)
        fn = tf.function(lambda g: opt.apply([g], [v])) if graph else (lambda g: opt.apply([g], [v]))
        hist = []
        for i in range(4):
            fn(tf.constant([float(r + 1), float(i)]))
            hist.append(v.numpy().copy())
        return hist, int(opt.iterations.numpy())
    for hist, iterations in ranks(body):
        # micro-steps 0+1 sum to [2, 1] (rank 0) and [4, 1] (rank 1); /N=2, averaged over ranks: [1.5, 0.5]
        np.testing.assert_array_equal(hist[0], [0.0, 0.0])
        np.testing.assert_array_equal(hist[1], [-1.5, -0.5])
        np.testing.assert_array_equal(hist[2], [-1.5, -0.5])
        np.testing.assert_array_equal(hist[3], [-3.0, -3.0])
        assert iterations == 2


def test_sync_batch_normalization_equals_global_batch():
    X = np.random.default_rng(0).standard_normal((4, 3, 2)).astype(np.float32)

    def body(comm):
        bn = hco.SyncBatchNormalization(axis=-1, communicator=comm, fused=False)
        x = tf.constant(X[2 * comm.rank:2 * comm.rank + 2])
        with tf.GradientTape() as t:
            t.watch(x)
            y = bn(x, training=True)
            loss = tf.reduce_sum(y * X[:2])
        return y.numpy(), t.gradient(loss, x).numpy()
    res = ranks(body)
    ref = keras.layers.BatchNormalization(axis=-1)
    xx = tf.constant(X)
    with tf.GradientTape() as t:
        t.watch(xx)
        y = ref(xx, training=True)
        loss = tf.reduce_sum(y[:2] * X[:2]) + tf.reduce_sum(y[2:] * X[:2])
    np.testing.assert_allclose(np.concatenate([res[0][0], res[1][0]]), y.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.concatenate([res[0][1], res[1][1]]), t.gradient(loss, xx).numpy(), atol=1e-5)


def test_adasum_tensor_allreduce_and_tape():
    """T-AS-1/T-AS-2 through the TF adapter: orthogonal gradients summed, identical averaged."""
    def body(comm):
        r = comm.rank
        orth = hco.allreduce(tf.constant([1.0, 0.0] if r == 0 else [0.0, 2.0]), op=hco.Adasum, communicator=comm)
        w = tf.Variable([1.0, 1.0, 1.0])
        with tf.GradientTape() as tape:
            z = tf.reduce_sum(w * tf.constant([1.0, 0.0, 3.0] if r == 0 else [0.0, 1.0, 3.0]))
        g = hco.DistributedGradientTape(tape, op=hco.Adasum, communicator=comm).gradient(z, [w])[0]
        with pytest.raises(ConfigError):
            hco.allreduce(tf.constant([1, 2]), op=hco.Adasum, communicator=comm)
        return orth.numpy(), g.numpy()
    for orth, g in ranks(body):
        np.testing.assert_array_equal(orth, [1.0, 2.0])
        # one tensor: a=(1,0,3), b=(0,1,3): a·b=9, |a|²=|b|²=10 -> 0.55a + 0.55b
        np.testing.assert_allclose(g, 0.55 * np.array([1.0, 1.0, 6.0]), rtol=1e-6)


def test_keras_optimizer_op_adasum():
    """DistributedOptimizer(op=Adasum): SGD steps by -lr·adasum(gradients) (docs/adasum.md#optimizer)."""
    def body(comm):
        v = keras.Variable(np.zeros(2, np.float32))
        opt = hco.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hco.Adasum, communicator=comm)
        opt.apply([tf.constant([1.0, 0.0] if comm.rank == 0 else [0.0, 2.0])], [v])
        opt.apply([tf.constant([1.0, 1.0])], [v])
        return v.numpy()
    for v in ranks(body):
        np.testing.assert_array_equal(v, [-2.0, -3.0])  # orthogonal: summed; identical: averaged
