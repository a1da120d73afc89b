"""The two adapters' tensor collectives give the same answers on the same data (both are thin
layers over hvd_commopt.collectives), on three in-process ranks."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import tf_plugin  # noqa: E402
import torch_plugin  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.errors import ConfigError, RankMismatchError  # noqa: E402

P = 3


def data(rank: int, shape=(4, 5), dtype=np.float32, big=False) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal(shape)
    if big:  # each value fits fp16, a sum of 3 does not (max 65504): only a pre-divided sum is finite
        x = 25000 + 1000 * np.clip(x, -3, 3)
    return x.astype(dtype)


def both(fn_torch, fn_tf):
    """Run each adapter's collective on every rank; return per rank (torch result, tf result)."""
    def body(comm):
        return fn_torch(comm).numpy(), fn_tf(comm).numpy()
    return run_ranks(P, body)


@pytest.mark.parametrize("kw", [
    {}, {"op": "sum"}, {"op": "average", "prescale_factor": 0.5, "postscale_factor": 3.0},
    {"compression": Compression.fp16}, {"compression": Compression.bf16},
])
def test_allreduce_is_identical_in_both_adapters(kw):
    big = "compression" in kw
    res = both(lambda c: torch_plugin.allreduce(torch.from_numpy(data(c.rank, big=big)), communicator=c, **kw),
               lambda c: tf_plugin.allreduce(tf.constant(data(c.rank, big=big)), communicator=c, **kw))
    for t, f in res:
        assert np.isfinite(t).all()
        np.testing.assert_array_equal(t, f)
        np.testing.assert_array_equal(t, res[0][0])
    if not kw:
        np.testing.assert_allclose(res[0][0], sum(data(r) for r in range(P)) / P, rtol=1e-6)


def test_integer_average_and_sum():
    for op in ("average", "sum"):
        res = both(lambda c: torch_plugin.allreduce(torch.from_numpy(data(c.rank, dtype=np.int32) + 7), op=op,
                                                    communicator=c),
                   lambda c: tf_plugin.allreduce(tf.constant(data(c.rank, dtype=np.int32) + 7), op=op, communicator=c))
        for t, f in res:
            assert t.dtype == f.dtype == np.int32
            np.testing.assert_array_equal(t, f)


def test_allgather_and_broadcast_are_identical():
    res = both(lambda c: torch_plugin.allgather(torch.from_numpy(data(c.rank, (c.rank + 1, 3))), communicator=c),
               lambda c: tf_plugin.allgather(tf.constant(data(c.rank, (c.rank + 1, 3))), communicator=c))
    for t, f in res:
        assert t.shape == (1 + 2 + 3, 3)
        np.testing.assert_array_equal(t, f)
    res = both(lambda c: torch_plugin.broadcast(torch.from_numpy(data(c.rank)), root_rank=1, communicator=c),
               lambda c: tf_plugin.broadcast(tf.constant(data(c.rank)), root_rank=1, communicator=c))
    for t, f in res:
        np.testing.assert_array_equal(t, data(1))
        np.testing.assert_array_equal(f, data(1))


def test_fused_broadcast_of_parameters_and_variables():
    def body(comm):
        tensors = {"a": torch.from_numpy(data(comm.rank)), "b": torch.arange(5, dtype=torch.int64) * comm.rank}
        torch_plugin.broadcast_parameters(tensors, root_rank=2, communicator=comm)
        variables = [tf.Variable(data(comm.rank)), tf.Variable(np.arange(5, dtype=np.int64) * comm.rank)]
        tf_plugin.broadcast_variables(variables, root_rank=2, communicator=comm)
        return [t.numpy() for t in tensors.values()], [v.numpy() for v in variables]
    for t, f in run_ranks(P, body):
        for a, b in zip(t, f):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(t[0], data(2))


def test_mismatches_raise_the_same_errors():
    def body(comm):
        shape = (2, 3 + (comm.rank == 1))
        errors = []
        for call in (lambda: torch_plugin.allgather(torch.zeros(shape), communicator=comm),
                     lambda: tf_plugin.allgather(tf.zeros(shape), communicator=comm)):
            with pytest.raises(ConfigError, match="must agree across ranks in dtype and in every dimension but the first") as e:
                call()
            errors.append(str(e.value))
        with pytest.raises(RankMismatchError):
            torch_plugin.broadcast_parameters({"w": torch.zeros(shape)}, communicator=comm)
        return errors
    for errs in run_ranks(P, body):
        assert errs[0] == errs[1]
