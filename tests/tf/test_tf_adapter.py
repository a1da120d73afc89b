"""tf_plugin's contract on in-process ranks (threads) and at size 1: tape, Keras optimizer,
collectives, callbacks, eager and tf.function."""
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import tf_plugin as hco  # noqa: E402
from hvd_commopt import run_ranks  # noqa: E402
from hvd_commopt.errors import ConfigError  # noqa: E402

D_IN, HIDDEN, D_OUT = 6, 8, 3


def init_weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((D_IN, HIDDEN)).astype(np.float32) * 0.5,
            rng.standard_normal(HIDDEN).astype(np.float32) * 0.1,
            rng.standard_normal((HIDDEN, D_OUT)).astype(np.float32) * 0.5,
            rng.standard_normal(D_OUT).astype(np.float32) * 0.1]


def data(rank, n=4, seed=100):
    rng = np.random.default_rng(seed + rank)
    return rng.standard_normal((n, D_IN)).astype(np.float32), rng.integers(0, D_OUT, n).astype(np.int64)


def loss_fn(ws, x, y):
    h = tf.tanh(tf.matmul(x, ws[0]) + ws[1])
    logits = tf.matmul(h, ws[2]) + ws[3]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def sgd_step(ws, grads, lr):
    for w, g in zip(ws, grads):
        w.assign_sub(lr * g)


def train_tape(comm, batches, lr=0.2, graph=False, **kw):
    ws = [tf.Variable(w) for w in init_weights()]

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(ws, x, y)
        if comm is not None:
            tape = hco.DistributedGradientTape(tape, communicator=comm, **kw)
        grads = tape.gradient(loss, ws)
        sgd_step(ws, grads, lr)
        return loss

    fn = tf.function(step) if graph else step
    for x, y in batches:
        fn(tf.constant(x), tf.constant(y))
    return [w.numpy() for w in ws]


@pytest.mark.parametrize("graph", [False, True])
def test_size_one_tape_equals_plain_tape_bit_for_bit(graph):
    batches = [data(0, seed=s) for s in range(4)]
    ref = train_tape(None, batches, graph=graph)
    out = run_ranks(1, lambda comm: train_tape(comm, batches, graph=graph))[0]
    for a, b in zip(ref, out):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("threshold", [0, None])
def test_two_ranks_equal_single_process_on_concatenated_batch(graph, threshold):
    steps = 4

    def body(comm):
        return train_tape(comm, [data(comm.rank, seed=10 * s) for s in range(steps)], graph=graph,
                          fusion_threshold=threshold)

    out = run_ranks(2, body)
    ref_batches = []
    for s in range(steps):
        xs, ys = zip(*[data(r, seed=10 * s) for r in range(2)])
        ref_batches.append((np.concatenate(xs), np.concatenate(ys)))
    ref = train_tape(None, ref_batches)
    for r in range(2):
        for a, b in zip(ref, out[r]):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(out[0], out[1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("compression,tol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_half_precision_compression_is_close_to_dense(compression, tol):
    comp = getattr(hco.Compression, compression)

    def body(comm, kw):
        return train_tape(comm, [data(comm.rank, seed=10 * s) for s in range(3)], graph=True, **kw)

    dense = run_ranks(2, body, {})
    half = run_ranks(2, body, {"compression": comp})
    for a, b in zip(dense[0], half[0]):
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol)
    for a, b in zip(half[0], half[1]):
        np.testing.assert_array_equal(a, b)


def test_sum_op_and_predivide():
    def body(comm):
        v = tf.Variable([1.0, 2.0])
        out = []
        for kw in ({"op": hco.Sum}, {"gradient_predivide_factor": 2.0}):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(v * float(comm.rank + 1))
            out.append(hco.DistributedGradientTape(tape, communicator=comm, **kw).gradient(loss, v).numpy())
        return out
    out = run_ranks(2, body)
    np.testing.assert_allclose(out[0][0], [3.0, 3.0])  # 1 + 2
    np.testing.assert_allclose(out[0][1], [1.5, 1.5])  # average, predivided


def test_none_and_indexed_slices_gradients():
    def body(comm):
        emb = tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3))
        used = tf.Variable([1.0, 1.0, 1.0])
        unused = tf.Variable([5.0])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [comm.rank, 3]) * used)
        g = hco.DistributedGradientTape(tape, communicator=comm).gradient(loss, [emb, used, unused])
        return g
    out = run_ranks(2, body)
    for g in out:
        assert g[2] is None
        assert isinstance(g[0], tf.Tensor)  # IndexedSlices reduced densely
        np.testing.assert_allclose(g[0].numpy()[:, 0], [0.5, 0.5, 0.0, 1.0])
    np.testing.assert_array_equal(out[0][1].numpy(), out[1][1].numpy())


def test_step_state_survives_tracing_and_tapes_share_one_engine():
    def body(comm):
        v = tf.Variable([1.0, 2.0])

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(v * v)
            tape = hco.DistributedGradientTape(tape, communicator=comm)
            g = tape.gradient(loss, [v])
            v.assign_sub(0.1 * g[0])
            return tape.comm_engine

        for _ in range(5):
            step()
        from tf_plugin.reducer import GradientReducer
        eng = GradientReducer(communicator=comm).engine_for_variables([v])  # the cached one
        return eng.step, v.numpy()
    out = run_ranks(2, body)
    assert out[0][0] == 5 and out[1][0] == 5  # the engine's counter advanced every executed step
    np.testing.assert_allclose(out[0][1], np.array([1.0, 2.0]) * 0.8 ** 5, rtol=1e-6)


def test_collectives_eager_and_in_tf_function():
    def body(comm):
        r = comm.rank
        res = {}
        res["avg"] = hco.allreduce(tf.constant([1.0, 2.0]) * (r + 1), communicator=comm).numpy()
        res["sum"] = hco.allreduce(tf.constant([1, 2]) * (r + 1), op=hco.Sum, communicator=comm).numpy()
        res["gather"] = hco.allgather(tf.fill([r + 1, 2], float(r)), communicator=comm).numpy()
        res["bcast"] = hco.broadcast(tf.constant([float(r)] * 3), root_rank=1, communicator=comm).numpy()
        res["obj"] = hco.broadcast_object({"rank": r}, root_rank=0, communicator=comm)

        @tf.function
        def graph(x):
            a = hco.allreduce(x, communicator=comm)
            g = hco.allgather(x, communicator=comm)
            b = hco.broadcast(x, root_rank=0, communicator=comm)
            return a, g, b
        a, g, b = graph(tf.constant([float(r), 1.0]))
        res["graph"] = (a.numpy(), g.numpy(), b.numpy())
        vs = [tf.Variable(np.full((2, 2), r, np.float32)), tf.Variable(np.full(3, r, np.int32)),
              tf.Variable(tf.cast(tf.fill([2], float(r) + 0.5), tf.bfloat16))]
        hco.broadcast_variables(vs, root_rank=1, communicator=comm)
        res["vars"] = [v.numpy() for v in vs]
        ws = [tf.Variable(np.full(2, r, np.float32))]
        @tf.function
        def bcast():
            hco.broadcast_variables(ws, root_rank=0, communicator=comm)
        bcast()
        res["graph_vars"] = ws[0].numpy()
        return res
    out = run_ranks(2, body)
    for r, res in enumerate(out):
        np.testing.assert_allclose(res["avg"], [1.5, 3.0])
        np.testing.assert_array_equal(res["sum"], [3, 6])
        np.testing.assert_array_equal(res["gather"], [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_array_equal(res["bcast"], [1, 1, 1])
        assert res["obj"] == {"rank": 0}
        np.testing.assert_allclose(res["graph"][0], [0.5, 1.0])
        np.testing.assert_array_equal(res["graph"][1], [0, 1, 1, 1])
        np.testing.assert_array_equal(res["graph"][2], [0, 1])
        np.testing.assert_array_equal(res["vars"][0], np.ones((2, 2)))
        np.testing.assert_array_equal(res["vars"][1], np.ones(3))
        np.testing.assert_array_equal(res["vars"][2].astype(np.float32), [1.5, 1.5])
        np.testing.assert_array_equal(res["graph_vars"], [0, 0])


def make_keras_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((D_IN,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                             keras.layers.Dense(D_OUT)])


def test_keras_fit_at_size_one_equals_plain_optimizer_bit_for_bit():
    hco.init()
    x = np.concatenate([data(0, n=32, seed=s)[0] for s in range(2)])
    y = np.concatenate([data(0, n=32, seed=s)[1] for s in range(2)])
    weights = []
    for wrap in (False, True):
        model = make_keras_model()
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        if wrap:
            opt = hco.DistributedOptimizer(opt)
            assert isinstance(opt, keras.optimizers.SGD) and type(opt).__name__ == "SGD"
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[hco.callbacks.BroadcastGlobalVariablesCallback(0), hco.callbacks.MetricAverageCallback()]
                  if wrap else [])
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def test_keras_apply_gradients_on_two_ranks_equals_concatenated_batch():
    ref_model = make_keras_model()
    ref_opt = keras.optimizers.Adam(0.01)
    steps = 3
    for s in range(steps):
        xs, ys = zip(*[data(r, seed=s) for r in range(2)])
        with tf.GradientTape() as tape:
            logits = ref_model(np.concatenate(xs))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(np.concatenate(ys), logits))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref_model.trainable_variables), ref_model.trainable_variables))
    models = [make_keras_model() for _ in range(2)]  # built here: Keras' name counters are not thread-safe

    def body(comm):
        model = models[comm.rank]
        opt = hco.DistributedOptimizer(keras.optimizers.Adam(0.01), communicator=comm)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        for s in range(steps):
            step(*data(comm.rank, seed=s))
        return [w.numpy() for w in model.trainable_variables]
    out = run_ranks(2, body)
    for r in range(2):
        for a, b in zip(ref_model.trainable_variables, out[r]):
            np.testing.assert_allclose(b, a.numpy(), rtol=1e-5, atol=1e-6)


def test_learning_rate_warmup_and_momentum_correction():
    hco.init()
    model = make_keras_model()
    opt = hco.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    x, y = data(0, n=64)
    sched = hco.callbacks.LearningRateScheduleCallback(0.4, lambda e: 0.5 ** e, staircase=False, momentum_correction=True)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[sched, Record()])
    expect = [0.4 * 0.5 ** (e + b / 4) for e in range(2) for b in range(4)]
    np.testing.assert_allclose(seen, expect, rtol=1e-6)
    # momentum correction rescales the velocity slots by new/old
    v_before = [m.numpy().copy() for m in opt.momentums]
    old = float(opt.learning_rate.numpy())
    sched._adjust(2.0)
    for m, vb in zip(opt.momentums, v_before):
        np.testing.assert_allclose(m.numpy(), vb * (0.4 * 0.25 / old), rtol=1e-6)
    warm = hco.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2, steps_per_epoch=4)
    warm.set_model(model)
    warm.on_train_begin()
    warm.on_epoch_begin(1)
    warm.on_train_batch_begin(3)  # last warm-up batch: initial_lr exactly (size 1: always)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.4)


def test_config_errors():
    with pytest.raises(ConfigError):
        hco.DistributedGradientTape(object())
    with pytest.raises(ConfigError):
        hco.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    with pytest.raises(ConfigError):
        hco.DistributedOptimizer(keras.optimizers.SGD(0.1), sparse_as_dense=False)
    with pytest.raises(ConfigError):
        hco.DistributedGradientTape(tf.GradientTape(), op="max")
    opt = hco.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ConfigError):
        hco.DistributedOptimizer(opt)


def test_xla_compiled_function_is_refused_with_the_fix():
    hco.init()
    v = tf.Variable([1.0])

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = v * v
        return hco.DistributedGradientTape(tape).gradient(loss, v)
    with pytest.raises(Exception, match="jit_compile=False"):  # autograph wraps it in a StagingError
        step()


def test_core_imports_no_framework_and_tf_plugin_no_torch():
    code = ("import sys, hvd_commopt, hvd_commopt.engine, hvd_commopt.compression\n"
            "assert not [m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules]\n"
            "import tf_plugin\n"
            "assert 'tensorflow' in sys.modules and 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- schedules (the core's OD/SSD/CD/CoCoD/local SGD through the Keras wrapper) -----------------

def _run_schedule(schedule, graph, comm=None, steps=6, momentum=0.0, batches=None):
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.standard_normal((D_IN, D_OUT)).astype(np.float32))
    b = tf.Variable(np.zeros(D_OUT, np.float32))
    opt = keras.optimizers.SGD(0.1, momentum=momentum)
    if schedule is not None or comm is not None:
        opt = hco.DistributedOptimizer(opt, schedule=schedule, communicator=comm)
    rank = 0 if comm is None else comm.rank
    batches = batches or [data(rank, seed=s) for s in range(steps)]

    def step(x, y):
        with tf.GradientTape() as tape:
            logits = tf.matmul(x, w) + b
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))

    fn = tf.function(step) if graph else step
    for x, y in batches:
        fn(tf.constant(x), tf.constant(y))
    if schedule is not None:
        opt.finalize()
    return [w.numpy(), b.numpy()], opt


@pytest.mark.parametrize("graph", [False, True])
def test_od_sgd_at_size_one_equals_sgd_bit_for_bit(graph):
    """T-OD-1 (docs/od-sgd.md#t-od-1): P = 1, no momentum, local lr = lr, s_loc = 1: OD-SGD is plain SGD."""
    from hvd_commopt import Schedule
    ref, _ = _run_schedule(None, False)
    od = Schedule.od(warmup_steps=2, local_lr=0.1, local_momentum=0.0, local_scale=1.0)
    out, opt = run_ranks(1, lambda comm: _run_schedule(od, graph, comm))[0]
    for a, b in zip(ref, out):
        np.testing.assert_array_equal(a, b)
    assert opt.comm_engine.step == 6


@pytest.mark.parametrize("kind", ["ssd", "cd", "cocod", "local_sgd"])
def test_every_schedule_runs_in_a_traced_step_and_ranks_agree_after_finalize(kind):
    from hvd_commopt import Schedule
    sched = {"ssd": Schedule.ssd(delay=2, warmup_steps=1), "cd": Schedule.cd(warmup_steps=2, correction_every=2),
             "cocod": Schedule.cocod(period=2), "local_sgd": Schedule.local_sgd(period=2)}[kind]
    out = run_ranks(2, lambda comm: _run_schedule(sched, True, comm)[0])
    for a, b in zip(out[0], out[1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_od_sgd_use_global_weights_and_tape_refuses_delayed_schedules():
    from hvd_commopt import Schedule
    od = Schedule.od(warmup_steps=1, local_lr=0.05, local_momentum=0.1)

    def body(comm):
        rng = np.random.default_rng(1)
        w = tf.Variable(rng.standard_normal((D_IN, D_OUT)).astype(np.float32))
        opt = hco.DistributedOptimizer(keras.optimizers.SGD(0.1), schedule=od, communicator=comm)
        for s in range(4):
            x, y = data(comm.rank, seed=s)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, tf.matmul(x, w)))
            opt.apply_gradients([(tape.gradient(loss, w), w)])
        local = w.numpy()
        with opt.use_global_weights():
            glob = w.numpy()
        np.testing.assert_array_equal(w.numpy(), local)  # restored after the block
        opt.finalize()
        np.testing.assert_array_equal(w.numpy(), glob)
        return glob, local
    out = run_ranks(2, body)
    np.testing.assert_array_equal(out[0][0], out[1][0])  # the global replica is identical on all ranks
    assert not np.array_equal(out[0][1], out[1][1])     # the local weights differ (own gradients)
    with pytest.raises(ConfigError, match="DistributedOptimizer"):
        hco.DistributedGradientTape(tf.GradientTape(), schedule=od)
