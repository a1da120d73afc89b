"""A 16-bit dense round casts its result back into the round's fusion buffer (no new float32 buffer
per step, docs/auto-compression.md#dense-path), with the bits of the cast into a new one."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import NumpyOps, run_ranks
from hvd_commopt.autocompress.dense import AutoMemory
from hvd_commopt.autocompress.methods import CastWithMemory
from hvd_commopt.compress import BF16Compressor, FP16Compressor, NoneCompressor
from hvd_commopt.dtypes import float32_to_half
from hvd_commopt.reduce import DenseAllreduce, ReduceContext
from tests.reducers import reduce_once

ops = NumpyOps()


def _data(rank: int, n: int = 1031) -> np.ndarray:
    return (np.random.default_rng(rank).standard_normal(n) * 10).astype(np.float32)


def test_numpy_cast_into_converts_bfloat16_bits():
    dst = np.zeros(3, np.float32)
    out = ops.cast_into(dst, float32_to_half(np.array([1.5, -2.0, 3.0], np.float32), np.uint16))
    assert out is dst
    np.testing.assert_array_equal(dst, [1.5, -2.0, 3.0])
    ops.cast_into(dst, np.array([0.5, 1.0, 2.0], np.float16))
    np.testing.assert_array_equal(dst, [0.5, 1.0, 2.0])


@pytest.mark.parametrize("comp", [BF16Compressor(), FP16Compressor()])
@pytest.mark.parametrize("size", [1, 3])
def test_dense_cast_round_writes_into_the_flat_with_the_same_bits(comp, size):
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        flat = _data(comm.rank)
        out = reduce_once(DenseAllreduce(comp), "b", flat, ctx)
        # the reference: the payload's cast into a new buffer, as before
        wire = ops.cast(_data(comm.rank) * np.float32(1.0 / comm.size), comp.target)
        return out, flat, wire
    outs = run_ranks(size, body)
    for out, flat, wire in outs:
        assert out is flat  # the fusion buffer holds the result: no new float32 buffer
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, outs[0][0])
        if size == 1:
            np.testing.assert_array_equal(out, ops.cast(wire, "float32"))


def test_three_rank_bf16_sum_matches_the_ring_reference():
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        return reduce_once(DenseAllreduce(BF16Compressor()), "b", _data(comm.rank), ctx)
    outs = run_ranks(3, body)
    ref = sum(_data(r).astype(np.float64) / 3 for r in range(3))
    np.testing.assert_allclose(outs[0], ref, rtol=2e-2, atol=0.1)


def test_uncast_rounds_keep_their_buffers():
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        flat = _data(comm.rank).astype(np.float16)  # already narrow: sent as it is, nothing cast back
        out = reduce_once(DenseAllreduce(BF16Compressor()), "b", flat, ctx)
        out32 = reduce_once(DenseAllreduce(NoneCompressor()), "c", _data(comm.rank), ctx)
        return out, flat, out32
    for out, flat, out32 in run_ranks(2, body):
        assert out.dtype == np.float16
        assert out32.dtype == np.float32


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_auto_cast_round_writes_into_the_flat(momentum):
    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        mem = AutoMemory()
        mem.bind_momentum(momentum, False)
        flat = _data(comm.rank)
        out = reduce_once(CastWithMemory(BF16Compressor(), mem), "b", flat, ctx)
        return out, flat
    outs = run_ranks(2, body)
    ref = sum(ops.cast(ops.cast(_data(r) * np.float32(0.5), "bfloat16"), "float32") for r in range(2))
    for out, flat in outs:
        assert out is flat
        # two ranks: the bf16 sum of two halves-averaged values is exact in float32 only up to the
        # final rounding to bf16, which the ring applies once
        np.testing.assert_array_equal(out, ops.cast(ops.cast(ref, "bfloat16"), "float32"))
