"""TorchOps' ``cast_into`` and the 16-bit dense rounds on torch tensors: the cast back lands in the
round's fusion buffer (same storage, no new float32 tensor per step, docs/auto-compression.md#dense-path),
with the bits of ``to(float32)``; and a training step under ``Compression.bf16`` reduces as before."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hvd_commopt import run_ranks  # noqa: E402
from hvd_commopt.autocompress.dense import AutoMemory  # noqa: E402
from hvd_commopt.autocompress.methods import CastWithMemory  # noqa: E402
from hvd_commopt.compress import BF16Compressor, FP16Compressor  # noqa: E402
from hvd_commopt.reduce import DenseAllreduce, ReduceContext  # noqa: E402
from tests.reducers import reduce_once  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402

ops = TorchOps()


def _data(rank: int, n: int = 4099) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(rank)) * 10


def test_cast_into_writes_dst_with_the_cast_bits():
    src = _data(0).to(torch.bfloat16)
    dst = torch.empty(src.numel())
    out = ops.cast_into(dst, src)
    assert out.data_ptr() == dst.data_ptr()
    assert torch.equal(dst, src.to(torch.float32))
    leaf = torch.zeros(3, requires_grad=True)  # no autograd record of the write
    ops.cast_into(leaf, torch.ones(3, dtype=torch.float16))
    assert torch.equal(leaf.detach(), torch.ones(3))


@pytest.mark.parametrize("comp", [BF16Compressor(), FP16Compressor()])
def test_dense_cast_round_result_is_the_fusion_buffer(comp):
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        flat = _data(comm.rank)
        ptr = flat.data_ptr()
        out = reduce_once(DenseAllreduce(comp), "b", flat, ctx)
        return out, ptr
    outs = run_ranks(2, body)
    wire = {"bfloat16": torch.bfloat16, "float16": torch.float16}[comp.target]
    ref = (_data(0) * 0.5).to(wire).to(torch.float32) + (_data(1) * 0.5).to(wire).to(torch.float32)
    ref = ref.to(wire).to(torch.float32)  # the sum rounded to the wire's precision once
    for out, ptr in outs:
        assert out.data_ptr() == ptr
        assert torch.equal(out, ref)


def test_auto_bf16_round_result_is_the_fusion_buffer():
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        mem = AutoMemory()
        mem.bind_momentum(0.9, False)
        flat = _data(comm.rank)
        ptr = flat.data_ptr()
        return reduce_once(CastWithMemory(BF16Compressor(), mem), "b", flat, ctx), ptr
    for out, ptr in run_ranks(2, body):
        assert out.data_ptr() == ptr
