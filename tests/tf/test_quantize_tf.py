"""``Compression.quantize`` through TFOps (docs/quantize.md#device): the kernels give the NumPy
reference's bytes and values exactly, and the exchange's results equal the NumPy route's."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.buckets import Bucket  # noqa: E402
from hvd_commopt.compress.quantize import decode, encode  # noqa: E402
from hvd_commopt.numpy_ops import NumpyOps  # noqa: E402
from hvd_commopt.reduce import ReduceContext, RoundInfo  # noqa: E402
from tests.unit.test_quantize import awkward_vec, reference_encode, vec  # noqa: E402
from tf_plugin.ops import TFOps  # noqa: E402

TFO, NOPS = TFOps(), NumpyOps()


@pytest.mark.parametrize("n", [0, 7, 1001])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_tf_kernels_give_the_reference_bytes_and_values(bits, n):
    x = awkward_vec(1001)[:n] if n >= 200 else vec(1, n)
    ref_buf, ref_dec = reference_encode(x, bits, 64)
    buf, dec = encode(TFO, tf.constant(x), bits, 64)
    np.testing.assert_array_equal(buf.numpy(), ref_buf)
    np.testing.assert_array_equal(dec.numpy(), ref_dec)
    np.testing.assert_array_equal(decode(TFO, buf, n, bits, 64).numpy(), ref_dec)


@pytest.mark.parametrize("density", [None, 0.05])
def test_the_exchange_equals_the_numpy_route(density):
    def body(comm, ops, wrap):
        red = Compression.quantize(4, density=density, block=32)
        out = red.reduce(Bucket.single("g", 1000, "float32"), RoundInfo(0), wrap(vec(comm.rank, 1000)),
                         ReduceContext(comm, ops))
        return (out if isinstance(out, np.ndarray) else out.numpy()).copy()
    ref = run_ranks(2, body, NOPS, lambda x: x.copy())
    got = run_ranks(2, body, TFO, lambda x: tf.constant(x))
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(b, a)
