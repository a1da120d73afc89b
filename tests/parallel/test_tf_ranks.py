"""tf_plugin under a real ``mpirun -np 2``: every rank runs this file with pytest.

Launched by tests/parallel/test_tf_mpi.py; collected on its own (no launcher, size 1) every test
skips. Each rank asserts; mpirun reports a failing rank as a non-zero exit.
"""
import hashlib
import time

import numpy as np
import pytest

from tests.parallel.ranks import init_tf_plugin

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
hco = init_tf_plugin("tests/parallel/test_tf_mpi.py")  # skips outside mpirun; one TF thread per rank
RANK, SIZE = hco.rank(), hco.size()
from hvd_commopt import runtime  # noqa: E402

COMM = runtime.communicator()

D_IN, HIDDEN, D_OUT = 6, 8, 3


def init_weights(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((D_IN, HIDDEN)).astype(np.float32) * 0.5,
            rng.standard_normal(HIDDEN).astype(np.float32) * 0.1,
            rng.standard_normal((HIDDEN, D_OUT)).astype(np.float32) * 0.5,
            rng.standard_normal(D_OUT).astype(np.float32) * 0.1]


def data(rank, n=4, seed=100):
    rng = np.random.default_rng(seed + 1000 * rank)
    return rng.standard_normal((n, D_IN)).astype(np.float32), rng.integers(0, D_OUT, n).astype(np.int64)


def loss_fn(ws, x, y):
    h = tf.tanh(tf.matmul(x, ws[0]) + ws[1])
    logits = tf.matmul(h, ws[2]) + ws[3]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def train_tape(batches, distributed=True, graph=False, lr=0.2, **kw):
    ws = [tf.Variable(w) for w in init_weights()]

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(ws, x, y)
        if distributed:
            tape = hco.DistributedGradientTape(tape, **kw)  # hvd_commopt
        for w, g in zip(ws, tape.gradient(loss, ws)):
            w.assign_sub(lr * g)

    fn = tf.function(step) if graph else step
    for x, y in batches:
        fn(tf.constant(x), tf.constant(y))
    return [w.numpy() for w in ws]


def same_on_all_ranks(arrays):
    h = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()
    digests = COMM.allgather_object(h, name="test.digest")
    assert len(set(digests)) == 1, f"ranks differ: {digests}"


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("threshold", [0, None])
def test_ssgd_equals_single_process_on_concatenated_batch(graph, threshold):
    steps = 4
    out = train_tape([data(RANK, seed=10 * s) for s in range(steps)], graph=graph, fusion_threshold=threshold)
    ref_batches = []
    for s in range(steps):
        xs, ys = zip(*[data(r, seed=10 * s) for r in range(SIZE)])
        ref_batches.append((np.concatenate(xs), np.concatenate(ys)))
    ref = train_tape(ref_batches, distributed=False)
    for a, b in zip(ref, out):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    same_on_all_ranks(out)


@pytest.mark.parametrize("compression,tol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_half_precision_compression_over_mpi(compression, tol):
    batches = [data(RANK, seed=10 * s) for s in range(3)]
    dense = train_tape(batches, graph=True)
    half = train_tape(batches, graph=True, compression=getattr(hco.Compression, compression))
    for a, b in zip(dense, half):
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol)
    same_on_all_ranks(half)


def test_collectives_over_mpi():
    r = RANK
    np.testing.assert_allclose(hco.allreduce(tf.constant([1.0, 2.0]) * (r + 1)).numpy(), [1.5, 3.0])
    np.testing.assert_array_equal(hco.allreduce(tf.constant([1, 2]) * (r + 1), op=hco.Sum).numpy(), [3, 6])
    bf = hco.allreduce(tf.cast(tf.constant([1.0, 2.0]) * (r + 1), tf.bfloat16), op=hco.Sum)
    assert bf.dtype == tf.bfloat16
    np.testing.assert_array_equal(tf.cast(bf, tf.float32).numpy(), [3.0, 6.0])
    np.testing.assert_array_equal(hco.allgather(tf.fill([r + 1, 2], float(r))).numpy(), [[0, 0], [1, 1], [1, 1]])
    np.testing.assert_array_equal(hco.broadcast(tf.constant([float(r)] * 3), root_rank=1).numpy(), [1, 1, 1])
    assert hco.broadcast_object({"rank": r, "t": np.arange(2)}, root_rank=1)["rank"] == 1

    @tf.function
    def graph(x):
        return hco.allreduce(x), hco.allgather(x), hco.broadcast(x, root_rank=0)
    a, g, b = graph(tf.constant([float(r), 1.0]))
    np.testing.assert_allclose(a.numpy(), [0.5, 1.0])
    np.testing.assert_array_equal(g.numpy(), [0, 1, 1, 1])
    np.testing.assert_array_equal(b.numpy(), [0, 1])
    vs = [tf.Variable(np.full((2, 2), r, np.float32)), tf.Variable(np.full(3, r, np.int64)),
          tf.Variable(tf.cast(tf.fill([2], float(r) + 0.5), tf.bfloat16))]
    hco.broadcast_variables(vs, root_rank=1)
    np.testing.assert_array_equal(vs[0].numpy(), np.ones((2, 2)))
    np.testing.assert_array_equal(vs[1].numpy(), np.ones(3))
    np.testing.assert_array_equal(tf.cast(vs[2], tf.float32).numpy(), [1.5, 1.5])


def test_keras_fit_digits_with_callbacks():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    t0 = time.monotonic()
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0)
    x_tr, y_tr = x_tr[RANK::SIZE], y_tr[RANK::SIZE]  # this rank's shard
    keras.utils.set_random_seed(1234 + RANK)  # different initial weights: the broadcast must fix them
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    opt = hco.DistributedOptimizer(keras.optimizers.SGD(0.05 * SIZE, momentum=0.9))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    hist = model.fit(x_tr, y_tr, batch_size=32, epochs=8, verbose=0, shuffle=True,
                     validation_data=(x_te, y_te),
                     callbacks=[hco.callbacks.BroadcastGlobalVariablesCallback(0),
                                hco.callbacks.MetricAverageCallback(),
                                hco.callbacks.LearningRateWarmupCallback(0.05 * SIZE, warmup_epochs=2)])
    same_on_all_ranks(model.get_weights())
    acc = hist.history["val_accuracy"][-1]
    accs = COMM.allgather_object(acc, name="test.acc")
    assert accs[0] == accs[1]  # MetricAverageCallback: the same averaged value on every rank
    assert acc > 0.9, hist.history
    assert hist.history["lr"][-1] == pytest.approx(0.05 * SIZE)
    assert time.monotonic() - t0 < 240


def test_metric_average_callback_averages_logs():
    cb = hco.callbacks.MetricAverageCallback()
    logs = {"loss": float(RANK), "acc": 1.0 + RANK, "name": "x"}
    cb.on_epoch_end(0, logs)
    assert logs["loss"] == pytest.approx((SIZE - 1) / 2) and logs["acc"] == pytest.approx(1 + (SIZE - 1) / 2)
    assert logs["name"] == "x"


def _torch_model(torch, w):
    """torch's tiny model with the TF test model's weights (stored here in torch's (out, in) layout)."""
    model = torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, D_OUT))
    with torch.no_grad():
        for p, a in zip(model.parameters(), w):
            p.copy_(torch.from_numpy(a.copy()))
    return model


def _torch_layout(w):
    return [w[0].T.copy(), w[1], w[2].T.copy(), w[3]]


def tf_loss_torch_layout(ws, x, y):
    """The same model with weights in torch's (out, in) layout, so that the flat fusion buffers
    (and hence the top-k positions and their tie-breaking) are identical in both frameworks."""
    h = tf.tanh(tf.matmul(x, ws[0], transpose_b=True) + ws[1])
    logits = tf.matmul(h, ws[2], transpose_b=True) + ws[3]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


@pytest.mark.parametrize("compression", ["none", "topk", "topk_layerwise", "gtopk", "od"])
def test_cross_framework_equivalence_with_torch_plugin(compression):
    """torch_plugin and tf_plugin, same initial weights and data, same engine: same weights
    (``topk_layerwise``: each weight matrix's own top-k in one fused bucket, docs/lags-omgs.md#lags-merged)."""
    torch = pytest.importorskip("torch")
    import torch_plugin as hco_torch
    from hvd_commopt import Compression, Schedule

    def comp():
        if compression in ("none", "od"):
            return None
        if compression == "topk_layerwise":
            return Compression.topk(density=0.3, layerwise=True)
        return getattr(Compression, compression)(density=0.3)

    def sched():  # OD-SGD: 2 synchronous warm-up steps, then delayed global + local updates
        return Schedule.od(warmup_steps=2, local_lr=0.1, local_momentum=0.1) if compression == "od" else None

    torch.set_num_threads(1)
    hco_torch.init()
    steps, lr = 6, 0.2
    momentum = 0.9 if compression == "none" else 0.0
    batches = [data(RANK, n=6, seed=20 * s) for s in range(steps)]
    w = _torch_layout(init_weights(seed=7))
    model = _torch_model(torch, w)
    opt = hco_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                         named_parameters=model.named_parameters(), compression=comp(),
                                         schedule=sched())
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    local_t = [p.detach().numpy().copy() for p in model.parameters()]
    if compression == "od":
        opt.finalize()  # the model becomes the global replica w_g
    t_w = [p.detach().numpy() for p in model.parameters()]
    # TF: Keras SGD (v = m v - lr g; w += v) equals torch's (v = m v + g; w -= lr v) at constant lr.
    ws = [tf.Variable(a) for a in w]
    kopt = hco.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=momentum), compression=comp(),
                                    schedule=sched())

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf_loss_torch_layout(ws, x, y)
        kopt.apply_gradients(zip(tape.gradient(loss, ws), ws))

    for x, y in batches:
        step(tf.constant(x), tf.constant(y))
    if compression == "od":
        for a, b in zip(local_t, ws):  # the local weights w_loc agree too
            np.testing.assert_allclose(b.numpy(), a, rtol=1e-5, atol=1e-6)
        kopt.finalize()
        same_on_all_ranks([w.numpy() for w in ws])
    for a, b in zip(t_w, ws):
        np.testing.assert_allclose(b.numpy(), a, rtol=1e-5, atol=1e-6)
    moved = sum(float(np.abs(b.numpy() - a0).sum()) for a0, b in zip(w, ws))
    assert moved > 1e-3  # the run trained


@pytest.mark.parametrize("compression", ["topk", "gtopk"])
def test_sparse_tape_in_loop_keeps_one_stateful_reducer(compression):
    """The issue's idiom: a fresh Compression.topk(...) on every wrap of a fresh tape, in a
    tf.function; the error-feedback state must persist (one engine), and ranks stay identical."""
    from hvd_commopt import Compression
    ws = [tf.Variable(a) for a in init_weights(seed=3)]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(ws, x, y)
        tape = hco.DistributedGradientTape(tape, compression=getattr(Compression, compression)(density=0.1))
        for w, g in zip(ws, tape.gradient(loss, ws)):
            w.assign_sub(0.2 * g)
        return loss

    engines = set()
    for s in range(4):
        step(*map(tf.constant, data(RANK, seed=s)))
    t = hco.DistributedGradientTape(tf.GradientTape(), compression=getattr(Compression, compression)(density=0.1))
    eng = t._hco_reducer.engine_for_variables(ws)
    engines.add(id(eng))
    assert eng.step == 4
    assert eng.reducer.state_dict(), "error-feedback residuals must be kept between steps"
    same_on_all_ranks([w.numpy() for w in ws])
