"""TFOps' ``cast_into``: a new tensor of dst's dtype and shape (TF tensors are immutable), the bits of
``tf.cast``; a bf16 dense round on TF tensors reduces as the NumPy route does."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvd_commopt import NumpyOps, run_ranks  # noqa: E402
from hvd_commopt.compress import BF16Compressor  # noqa: E402
from hvd_commopt.reduce import DenseAllreduce, ReduceContext  # noqa: E402
from tests.reducers import reduce_once  # noqa: E402
from tf_plugin.ops import TFOps  # noqa: E402


def test_cast_into_is_the_cast():
    ops = TFOps()
    src = tf.cast(tf.constant([1.5, -2.0, 3.25]), tf.bfloat16)
    out = ops.cast_into(tf.zeros([3]), src)
    assert out.dtype == tf.float32
    np.testing.assert_array_equal(out.numpy(), [1.5, -2.0, 3.25])


def test_bf16_round_on_tf_matches_numpy():
    data = [(np.random.default_rng(r).standard_normal(515) * 10).astype(np.float32) for r in range(2)]

    def body(ops):
        def run(comm):
            ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
            flat = data[comm.rank].copy() if ops is np_ops else tf.constant(data[comm.rank])
            out = reduce_once(DenseAllreduce(BF16Compressor()), "b", flat, ctx)
            return np.asarray(out if ops is np_ops else out.numpy())
        return run_ranks(2, run)
    np_ops = NumpyOps()
    for a, b in zip(body(np_ops), body(TFOps())):
        np.testing.assert_array_equal(a, b)
