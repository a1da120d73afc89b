"""The chunk-wise top-k through TFOps (docs/quantize.md#batched-topk): ``topk_abs_rows`` ranks as
the NumPy reference does, and the batched selection equals one ``topk_abs`` per chunk."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvd_commopt import NumpyOps  # noqa: E402
from hvd_commopt.compress.chunked import ChunkLayout, chunk_plan  # noqa: E402
from tests.unit.test_sparseloco import LAYOUTS, awkward, per_chunk_topk  # noqa: E402
from tf_plugin.ops import TFOps  # noqa: E402

T, N = TFOps(), NumpyOps()


@pytest.mark.parametrize("width, k", [(1, 1), (8, 3), (64, 64), (4096, 41)])
def test_tf_topk_abs_rows_ranks_as_numpy_with_nan_above_inf(width, k):
    x = awkward(5 * width, width)
    x[::7] = np.inf
    x[::11] = np.nan
    np.testing.assert_array_equal(T.topk_abs_rows(tf.constant(x), width, k).numpy(), N.topk_abs_rows(x, width, k))


@pytest.mark.parametrize("sizes, chunk, rho", LAYOUTS)
def test_tf_batched_chunk_topk_equals_one_topk_per_chunk(sizes, chunk, rho):
    plan = chunk_plan(sizes, chunk, rho)
    x = awkward(sum(sizes), 4)
    want_idx, want_local = per_chunk_topk(T, tf.constant(x), plan)
    idx, local = ChunkLayout(plan).select(T, tf.constant(x))
    np.testing.assert_array_equal(idx.numpy(), want_idx.numpy())
    np.testing.assert_array_equal(local.numpy(), want_local.numpy())
    np.testing.assert_array_equal(idx.numpy(), ChunkLayout(plan).select(N, x)[0])
