"""``Compression.quantize`` through TorchOps (docs/quantize.md#device): the kernels give the NumPy
reference's bytes and values exactly, and the exchange's results equal the NumPy route's, bit for
bit; on CUDA (when present) the same, with no host copy of the bucket."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402,F401  (registers the adapter)
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.buckets import Bucket  # noqa: E402
from hvd_commopt.compress.chunked import ChunkLayout, chunk_plan, offset_bytes, pack_offsets, unpack_offsets  # noqa: E402
from hvd_commopt.compress.quantize import decode, encode  # noqa: E402
from hvd_commopt.numpy_ops import NumpyOps  # noqa: E402
from hvd_commopt.reduce import ReduceContext, RoundInfo  # noqa: E402
from tests.unit.test_quantize import awkward_vec, reference_encode, vec  # noqa: E402
from tests.unit.test_sparseloco import LAYOUTS, awkward, per_chunk_topk  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402

TOPS, NOPS = TorchOps(), NumpyOps()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [0, 1, 7, 1001, 4099])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_torch_kernels_give_the_reference_bytes_and_values(bits, n, device):
    x = awkward_vec(max(n, 200))[:n] if n >= 200 else vec(1, n)
    ref_buf, ref_dec = reference_encode(x, bits, 64)
    buf, dec = encode(TOPS, torch.from_numpy(x).to(device), bits, 64)
    assert buf.device.type == device and buf.dtype == torch.uint8
    np.testing.assert_array_equal(buf.cpu().numpy(), ref_buf)
    np.testing.assert_array_equal(dec.cpu().numpy(), ref_dec)
    np.testing.assert_array_equal(decode(TOPS, buf, n, bits, 64).cpu().numpy(), ref_dec)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [0, 1, 5, 8, 9, 12, 15, 16])
@pytest.mark.parametrize("k", [0, 1, 3, 41, 1001])
def test_torch_offset_packing_gives_the_numpy_bytes(k, bits, device):
    offs = np.random.RandomState(k + bits).randint(0, 1 << bits, size=k).astype(np.int64)
    ref = pack_offsets(NOPS, offs, bits)
    t = torch.from_numpy(offs).to(device)
    buf = pack_offsets(TOPS, t, bits)
    assert buf.device.type == device and buf.dtype == torch.uint8 and buf.numel() == offset_bytes(k, bits)
    np.testing.assert_array_equal(buf.cpu().numpy(), ref)
    np.testing.assert_array_equal(unpack_offsets(TOPS, buf, k, bits, like=t).cpu().numpy(), offs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes, chunk, rho", LAYOUTS)
def test_torch_batched_chunk_topk_equals_one_topk_per_chunk(sizes, chunk, rho, device):
    plan = chunk_plan(sizes, chunk, rho)
    x = awkward(sum(sizes), 3)
    t = torch.from_numpy(x).to(device)
    want_idx, want_local = per_chunk_topk(TOPS, t, plan)
    layout = ChunkLayout(plan)
    for _ in range(2):
        idx, local = layout.select(TOPS, t)
        assert idx.device.type == device and idx.dtype == local.dtype == torch.int64
        assert torch.equal(idx, want_idx) and torch.equal(local, want_local)
    np.testing.assert_array_equal(idx.cpu().numpy(), ChunkLayout(plan).select(NOPS, x)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width, k", [(1, 1), (8, 3), (64, 64), (4096, 41)])
def test_torch_topk_abs_rows_ranks_as_numpy_with_nan_above_inf(width, k, device):
    x = awkward(5 * width, width)
    x[::7] = np.inf
    x[::11] = np.nan
    got = TOPS.topk_abs_rows(torch.from_numpy(x).to(device), width, k)
    np.testing.assert_array_equal(got.cpu().numpy(), NOPS.topk_abs_rows(x, width, k))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("density, chunk, mean_over", [(None, None, "ranks"), (0.05, None, "ranks"),
                                                       (0.05, 256, "ranks"), (0.05, 256, "senders")])
@pytest.mark.parametrize("P", [1, 2, 3])
def test_the_exchange_equals_the_numpy_route_bit_for_bit(P, density, chunk, mean_over, device):
    def body(comm, ops, wrap):
        red = Compression.quantize(4, density=density, block=32, chunk=chunk, mean_over=mean_over)
        ctx = ReduceContext(comm, ops, postscale=1.0 / comm.size)
        outs, res = [], []
        for t in range(3):  # error feedback carried across rounds
            x = vec(comm.rank, 1000, seed=t)
            out = red.reduce(Bucket.single("g", 1000, "float32"), RoundInfo(t), wrap(x), ctx)
            outs.append(np.asarray(out.cpu() if isinstance(out, torch.Tensor) else out).copy())
            r = red.memory.residual(ops, "g", wrap(x))
            res.append(np.asarray(r.cpu() if isinstance(r, torch.Tensor) else r).copy())
        return outs, res
    ref = run_ranks(P, body, NOPS, lambda x: x.copy())
    got = run_ranks(P, body, TOPS, lambda x: torch.from_numpy(x.copy()).to(device))
    for (ro, rr), (go, gr) in zip(ref, got):
        for a, b in zip(ro + rr, go + gr):
            np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("density", [None, 0.05])
def test_the_quantiser_makes_no_host_copy(density, monkeypatch):
    """What made CUDA tensors round-trip through NumPy: for a tensor in device memory the reducer
    calls none of the host conversions (one rank, so no communicator staging is involved). The CPU
    tensor is declared on a device: a host tensor takes the native kernels through a host view
    (docs/quantize.md#native), which is not a copy."""
    calls = []
    for name in ("to_numpy", "from_numpy", "host_view"):
        monkeypatch.setattr(TorchOps, name, lambda self, *a, _n=name, **k: calls.append(_n))
    monkeypatch.setattr(TorchOps, "on_device", lambda self, t: True)

    def body(comm):
        red = Compression.quantize(4, density=density, block=32)
        x = torch.from_numpy(vec(0, 1000))
        return red.reduce(Bucket.single("g", 1000, "float32"), RoundInfo(0), x.clone(), ReduceContext(comm, TOPS))
    out = run_ranks(1, body)[0]
    assert isinstance(out, torch.Tensor) and calls == []
