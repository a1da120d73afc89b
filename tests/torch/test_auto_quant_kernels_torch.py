"""The torch quantisation kernels on the paths auto's quantisers take most (docs/quantize.md#torch-packing):
whole blocks (quantised as a view, no padded copy) and 2/4-bit codes packed whole, 8/bits to a
byte: the NumPy reference's bytes and values exactly."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402,F401  (registers the adapter)
from hvd_commopt.compress.quantize import decode, encode  # noqa: E402
from tests.unit.test_quantize import awkward_vec, reference_encode  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402

TOPS = TorchOps()


@pytest.mark.parametrize("n", [64, 256, 4096, 4096 + 2, 4096 + 3])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_whole_blocks_and_whole_code_packing_give_the_reference_bytes(bits, n):
    x = awkward_vec(max(n, 256))[:n].copy()
    ref_buf, ref_dec = reference_encode(x, bits, 64)
    t = torch.from_numpy(x.copy())
    buf, dec = encode(TOPS, t, bits, 64)
    np.testing.assert_array_equal(buf.numpy(), ref_buf)
    np.testing.assert_array_equal(dec.numpy(), ref_dec)
    np.testing.assert_array_equal(decode(TOPS, buf, n, bits, 64).numpy(), ref_dec)
    np.testing.assert_array_equal(t.numpy(), x)  # the input is only read (whole blocks are a view of it)
