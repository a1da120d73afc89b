"""TensorFlow adapter: bad arguments give one clear error naming the fix when wrapping (not at the
first step), root ranks outside the job are refused at size 1, and one compression object shared
by two tapes keeps one state per engine (docs/cross-rank-check.md#arguments,
docs/cross-rank-check.md#shared-compression)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import tf_plugin as hco  # noqa: E402
from hvd_commopt import run_ranks  # noqa: E402
from hvd_commopt.errors import ConfigError  # noqa: E402
from tests.bad_args import BAD_WRAPPER_ARGS  # noqa: E402

from .test_tf_adapter import data, init_weights, loss_fn  # noqa: E402


@pytest.mark.parametrize("kwargs, match", BAD_WRAPPER_ARGS)
def test_bad_arguments_are_refused_when_wrapping(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        hco.DistributedGradientTape(tf.GradientTape(), **kwargs)
    keras_kwargs = {k: v for k, v in kwargs.items() if k != "backward_passes_per_step" or v != 0}
    if keras_kwargs:
        with pytest.raises(ConfigError, match=match):
            hco.DistributedOptimizer(keras.optimizers.SGD(0.1), **keras_kwargs)


def test_root_rank_outside_the_job_is_refused_at_size_one():
    hco.init()
    v = [tf.Variable([1.0, 2.0])]
    fix = r"root_rank=3 is out of range: the job has 1 rank\(s\), numbered 0 to 0; pass root_rank= one of them"
    with pytest.raises(ConfigError, match=fix):
        hco.broadcast_variables(v, root_rank=3)
    with pytest.raises(ConfigError, match=fix):
        hco.broadcast(tf.ones([2]), root_rank=3)
    with pytest.raises(ConfigError, match=fix):
        hco.broadcast_object({"epoch": 1}, root_rank=3)
    hco.broadcast_variables(v, root_rank=0)


def _two_models(comm, shared: bool, steps: int = 3):
    """Two weight sets of the same shapes (a GAN's two models), each reduced by its own tape;
    Top-k with error feedback from one object (shared) or two."""
    comp = hco.Compression.topk(0.2)
    comps = (comp, comp) if shared else (comp, hco.Compression.topk(0.2))
    models = [[tf.Variable(w) for w in init_weights(seed)] for seed in (1, 2)]
    for step in range(steps):
        x, y = data(comm.rank, seed=step)
        for ws, c in zip(models, comps):
            with tf.GradientTape() as tape:
                loss = loss_fn(ws, x, y)
            grads = hco.DistributedGradientTape(tape, communicator=comm, compression=c).gradient(loss, ws)
            for w, g in zip(ws, grads):
                w.assign_sub(0.2 * g)
    return [w.numpy() for ws in models for w in ws]


def test_one_topk_object_for_two_tapes_keeps_one_residual_per_engine():
    shared = run_ranks(2, _two_models, True)
    separate = run_ranks(2, _two_models, False)
    for a, b in zip(shared, separate):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_average_and_op_together_are_refused_as_horovod_does():
    """Horovod raises when both the old ``average`` flag and ``op`` are given; so does the TF
    adapter, as the torch one does (resolved once: hvd_commopt.collectives.resolve_op)."""
    hco.init()
    with pytest.raises(ConfigError, match="not both"):
        hco.allreduce(tf.ones([2]), average=True, op=hco.Sum)
    with pytest.raises(ConfigError, match="not both"):
        hco.grouped_allreduce([tf.ones([2])], average=False, op=hco.Average)
    assert np.array_equal(hco.allreduce(tf.ones([2]), average=False).numpy(), np.ones(2))  # one of them: fine
