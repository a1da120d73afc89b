"""TorchOps pieces of checkpoints and of the NaN/Inf rule (docs/wrapper.md#checkpoints,
docs/wrapper.md#nonfinite): per-rank parts come back as CPU torch tensors of the same dtype
(bf16 included), loadable with torch.load(weights_only=True); all_finite agrees with NumPy."""
from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

from hvd_commopt import NumpyOps  # noqa: E402
from hvd_commopt.checkpoint import from_host, to_host  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402

tops = TorchOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64])
def test_host_round_trip_is_exact_and_weights_only_loadable(dtype):
    t = (torch.randn(5, 3) * 100).to(dtype)
    back = from_host(tops, to_host(tops, {"x": t, "step": torch.tensor(3.0)}))
    assert back["x"].dtype == dtype and back["x"].shape == t.shape and torch.equal(back["x"], t)
    buf = io.BytesIO()
    torch.save(back, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True)["x"], t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_all_finite_matches_numpy(dtype, bad):
    t = torch.randn(50).to(dtype)
    if bad is not None:
        t[7] = bad
    expect = NumpyOps().all_finite(t.float().numpy())
    assert tops.all_finite(t) is expect
    assert expect is (bad is None)
