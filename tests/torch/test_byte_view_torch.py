"""TorchOps.as_bytes/from_bytes (docs/topk.md#one-message): bit-exact round trips of every dtype,
the same bytes as NumpyOps, and a packed Top-k exchange equal to its oracle."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_commopt import Compression, NumpyOps, run_ranks  # noqa: E402
from hvd_commopt.reduce import ReduceContext  # noqa: E402
from torch_plugin.ops import TORCH_DTYPES, TorchOps  # noqa: E402
from tests.reducers import reduce_once  # noqa: E402
from tests.unit.test_packed_exchange import VALUE_DTYPES, special_values  # noqa: E402

nops, tops = NumpyOps(), TorchOps()


def host_and_tensor(dtype):
    a = special_values(dtype) if dtype in VALUE_DTYPES else np.arange(-5, 32).astype(dtype)
    return a, tops.from_numpy(a.copy(), like=torch.empty(0, dtype=TORCH_DTYPES[dtype]))


@pytest.mark.parametrize("dtype", VALUE_DTYPES + ["int32", "int64", "uint8"])
def test_byte_view_round_trips_bit_exactly_and_matches_numpy(dtype):
    a, t = host_and_tensor(dtype)
    assert t.dtype == TORCH_DTYPES[dtype]
    b = tops.as_bytes(t)
    assert b.dtype == torch.uint8 and b.shape == (a.nbytes,)
    assert b.numpy().tobytes() == nops.as_bytes(a).tobytes()
    back = tops.from_bytes(b, dtype)
    assert back.dtype == t.dtype and torch.equal(back.view(torch.uint8), b)
    assert tops.from_bytes(tops.as_bytes(t[:0]), dtype).numel() == 0
    # a slice starting off the element grid (as a rank's segment of a packed message can)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), b])[1:]
    assert torch.equal(tops.from_bytes(shifted, dtype).view(torch.uint8), b)


def test_byte_view_of_a_strided_or_grad_tensor():
    w = torch.arange(12, dtype=torch.float32, requires_grad=True)
    assert torch.equal(tops.from_bytes(tops.as_bytes(w), "float32"), w.detach())
    s = torch.arange(12, dtype=torch.float64)[::3]
    assert torch.equal(tops.from_bytes(tops.as_bytes(s), "float64"), s)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_packed_topk_with_torch_tensors_equals_the_oracle(dtype, index_dtype):
    """In-process ranks (host buffers): bit for bit the scatter-add of every rank's top-k."""
    n, k, P = 500, 7, 3
    rows = [torch.from_numpy(np.random.default_rng(r).standard_normal(n).astype(np.float32))
            .to(TORCH_DTYPES[dtype]) for r in range(P)]
    leaves = [tops.topk_abs(x, k) for x in rows]
    ref = tops.scatter_add(torch.zeros(n, dtype=TORCH_DTYPES[dtype]), torch.cat([i for _, i in leaves]),
                           torch.cat([v for v, _ in leaves]))

    def body(comm):
        red = Compression.topk(k / n, index_dtype=index_dtype, min_k=1)
        return reduce_once(red, "b", rows[comm.rank].clone(), ReduceContext(comm, tops, 1.0, 1.0))

    for out in run_ranks(P, body):
        assert out.dtype == ref.dtype and torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
