"""tf_plugin/_compat.py: each private TF/Keras API's route and its public fallback, the fallback
forced by monkeypatching the private handle to None (docs/versions.md#private-apis)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import tf_plugin as hco  # noqa: E402
from hvd_commopt import run_ranks  # noqa: E402
from hvd_commopt.errors import ConfigError  # noqa: E402
from tf_plugin import _compat, callbacks  # noqa: E402
from tf_plugin.bridge import host_call  # noqa: E402


# -- Keras optimizer._learning_rate -----------------------------------------------------------------

@pytest.mark.parametrize("private", [True, False])
def test_learning_rate_variable(monkeypatch, private):
    if not private:
        monkeypatch.setattr(_compat, "_LEARNING_RATE", None)
    opt = keras.optimizers.SGD(0.25)
    var = _compat.learning_rate_variable(opt)
    assert var is not None and float(var.numpy()) == 0.25
    var.assign(0.5)  # the variable itself: the optimizer steps with the new value
    assert float(opt.learning_rate.numpy()) == 0.5 and callbacks._lr_variable(opt) is var
    sched = keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))
    assert _compat.learning_rate_variable(sched) is None
    with pytest.raises(ValueError, match="LearningRateSchedule"):
        callbacks._lr_variable(sched)


# -- Keras optimizer._trainable_variables -------------------------------------------------------------

def apply_without_variables(comm):
    v = keras.Variable(np.zeros(2, np.float32))
    opt = hco.DistributedOptimizer(keras.optimizers.SGD(1.0), communicator=comm)
    opt.apply([tf.constant([1.0, 2.0])], [v])  # builds the optimizer for [v]
    opt.apply([tf.constant([1.0, 2.0])])       # Keras' form: the variables it was built for
    return v.numpy()


def test_built_variables_and_the_fallback_error(monkeypatch):
    assert all(np.array_equal(v, [-2.0, -4.0]) for v in run_ranks(2, apply_without_variables))
    monkeypatch.setattr(_compat, "_TRAINABLE_VARIABLES", None)
    with pytest.raises(ConfigError, match="pass them"):
        _compat.built_variables(keras.optimizers.SGD(1.0))


def test_without_the_variable_list_an_apply_with_variables_still_works(monkeypatch):
    monkeypatch.setattr(_compat, "_TRAINABLE_VARIABLES", None)

    def body(comm):
        v = keras.Variable(np.zeros(2, np.float32))
        opt = hco.DistributedOptimizer(keras.optimizers.SGD(1.0), communicator=comm)
        opt.apply_gradients([(tf.constant([1.0, 2.0]) * (comm.rank + 1), v)])
        return v.numpy()
    assert all(np.array_equal(v, [-1.5, -3.0]) for v in run_ranks(2, body))


# -- tensorflow.python.ops.control_flow_util ---------------------------------------------------------

def traced(jit):
    seen = []

    @tf.function(jit_compile=jit)
    def f(x):
        seen.append(_compat.in_xla_context())
        return x + 1
    f.get_concrete_function(tf.TensorSpec([2], tf.float32))  # trace only
    return seen[0]


def test_in_xla_context_private_route_and_fallback(monkeypatch):
    assert not _compat.in_xla_context()  # eager
    assert traced(jit=True) and not traced(jit=False)
    monkeypatch.setattr(_compat, "_CONTROL_FLOW_UTIL", None)
    assert not traced(jit=True)  # no public query: assume not


def test_a_collective_under_xla_names_the_fix():
    @tf.function(jit_compile=True, autograph=False)
    def f(x):
        return host_call(lambda a: [a], [x], [tf.float32], [x.shape], "t")[0]
    with pytest.raises(ConfigError, match="jit_compile=False"):
        f.get_concrete_function(tf.TensorSpec([2], tf.float32))


# -- keras.layers.BatchNormalization: _reduction_axes, _moments ---------------------------------------

@pytest.mark.parametrize("axis,shape", [(-1, (4, 3, 2)), (1, (4, 3, 2)), (-1, (4, 5)), (3, (2, 3, 4, 5))])
def test_batch_norm_reduction_axes_private_route_and_fallback(monkeypatch, axis, shape):
    bn = keras.layers.BatchNormalization(axis=axis)
    x = tf.zeros(shape)
    bn.build(shape)
    axes = _compat.batch_norm_reduction_axes(bn, x)
    monkeypatch.setattr(_compat, "_BN_REDUCTION_AXES", None)
    assert _compat.batch_norm_reduction_axes(bn, x) == axes == [i for i in range(len(shape)) if i != axis % len(shape)]


def test_sync_batch_normalization_on_the_fallback_axes_is_the_same(monkeypatch):
    X = np.random.default_rng(0).standard_normal((4, 3, 2)).astype(np.float32)

    def body(comm):
        bn = hco.SyncBatchNormalization(axis=1, communicator=comm)
        return bn(tf.constant(X[2 * comm.rank:2 * comm.rank + 2]), training=True).numpy()
    ref = run_ranks(2, body)
    monkeypatch.setattr(_compat, "_BN_REDUCTION_AXES", None)
    assert all(np.array_equal(a, b) for a, b in zip(run_ranks(2, body), ref))


def test_without_the_moments_hook_sync_batch_normalization_refuses(monkeypatch):
    assert _compat.batch_norm_moments_hook()
    monkeypatch.setattr(_compat, "_BN_MOMENTS", None)
    with pytest.raises(ConfigError, match="moments"):
        hco.SyncBatchNormalization()
