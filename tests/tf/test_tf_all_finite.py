"""TFOps.all_finite agrees with NumPyOps (docs/wrapper.md#nonfinite)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvd_commopt import NumpyOps  # noqa: E402
from tf_plugin.ops import TFOps  # noqa: E402

T, N = TFOps(), NumpyOps()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
def test_all_finite_matches_numpy(dtype, bad):
    x = np.random.default_rng(0).standard_normal(40).astype(dtype)
    if bad is not None:
        x[3] = bad
    assert T.all_finite(tf.constant(x)) is N.all_finite(x) is (bad is None)
    assert T.all_finite(tf.cast(tf.constant(x), tf.bfloat16)) is (bad is None)
    assert T.all_finite(tf.constant([1, 2], tf.int32)) is True
