"""DGC's uniform samples (docs/dgc.md#uniform-samples) on the TF adapter: the same integers as NumPy's."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from hvd_commopt.compress.sampling import uniform_positions  # noqa: E402
from hvd_commopt.numpy_ops import NumpyOps  # noqa: E402
from tf_plugin.ops import TFOps  # noqa: E402


@pytest.mark.parametrize("n", [7, 100_003, 3_000_000_007])
def test_uniform_positions_equal_numpys(n):
    import tensorflow as tf
    keys = [int(k) for k in np.random.default_rng(n).integers(0, 2 ** 31 - 1, 10)]
    got = uniform_positions(TFOps(), n, 5_000, keys, tf.zeros([1]))
    assert np.array_equal(np.asarray(got), uniform_positions(NumpyOps(), n, 5_000, keys, None))
