"""The quantiser's native host kernels (docs/quantize.md#native): the bytes and values of the
reference kernels (NumpyOps' ``quantize_blocks`` + ``pack_bits``, ``unpack_bits`` +
``dequantize_blocks``), bit for bit, on every bit width, block and the values where rounding and
signs are delicate."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt.compress import quant_native
from hvd_commopt.compress.quantize import decode, decode_parts, decode_sum, encode, encode_parts, encoded_bytes
from hvd_commopt.numpy_ops import NumpyOps

pytestmark = pytest.mark.skipif(not quant_native.available(),
                                reason="the native quantiser kernels are not built (python setup.py build_ext --inplace)")

OPS = NumpyOps()


def reference_encode(x: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    scales, codes, dec = OPS.quantize_blocks(x, bits, block)
    return np.concatenate([scales.view(np.uint8), OPS.pack_bits(codes, bits)]), dec


def reference_decode(buf: np.ndarray, n: int, bits: int, block: int) -> np.ndarray:
    nb = -(-n // block)
    return OPS.dequantize_blocks(buf[:4 * nb].view(np.float32), OPS.unpack_bits(buf[4 * nb:], n, bits), bits, block)


def delicate(n: int, seed: int) -> np.ndarray:
    """Gaussian values with signed zeros, exact halves (ties), tiny and huge magnitudes mixed in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if n >= 8:
        x[::7] = -0.0
        x[1::11] = 0.0
        x[2::13] = np.float32(0.5) * rng.integers(-9, 9, size=x[2::13].size).astype(np.float32)  # ties at q = 8
        x[3::17] = np.float32(1e-30)
        x[4::19] *= np.float32(1e6)
    return x


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("block", [1, 3, 32, 256, 300, 600])
@pytest.mark.parametrize("n", [0, 1, 7, 255, 257, 1000, 2049])
def test_encode_and_decode_are_the_reference_bit_for_bit(bits, block, n):
    x = delicate(n, seed=bits * 1000 + block + n)
    got, dec = quant_native.encode(x, bits, block, encoded_bytes(x.size, bits, block))
    want, want_dec = reference_encode(x, bits, block)
    assert got.size == encoded_bytes(n, bits, block)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(dec.view(np.uint32), want_dec.view(np.uint32))  # -0.0 stays -0.0
    out = np.empty(n, np.float32)
    quant_native.decode_into(got, n, bits, block, out, accumulate=False)
    np.testing.assert_array_equal(out.view(np.uint32), reference_decode(want, n, bits, block).view(np.uint32))
    base = delicate(n, seed=7)
    acc = base.copy()
    quant_native.decode_into(got, n, bits, block, acc, accumulate=True)
    np.testing.assert_array_equal(acc.view(np.uint32), (base + reference_decode(want, n, bits, block)).view(np.uint32))


def test_ties_round_to_even_and_signed_zeros_keep_their_sign():
    """Scale 1 (max 127 in int8): x / s is x, so halves are ties: rint's ties to even."""
    x = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -0.0, -0.3, 0.3], np.float32)
    payload, dec = quant_native.encode(x, 8, 16, encoded_bytes(x.size, 8, 16))
    assert payload[:4].view(np.float32)[0] == 1.0
    np.testing.assert_array_equal(dec, [127, 0, 2, 2, -0, -2, -2, -0, -0, 0])
    assert list(np.signbit(dec)) == [False, False, False, False, True, True, True, True, True, False]
    np.testing.assert_array_equal(payload[4:].astype(int) - 127, [127, 0, 2, 2, 0, -2, -2, 0, 0, 0])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_subnormal_blocks_whose_scale_rounds_away_are_the_reference(bits):
    """max|x| a few subnormal units: the scale rounds to 0 or 1 unit, the quotients reach 1.5 q."""
    unit = np.float32(1e-45)
    x = (np.arange(-190, 191, dtype=np.float32) * unit).astype(np.float32)
    for block in (1, 2, 5, 381):
        got, dec = quant_native.encode(x, bits, block, encoded_bytes(x.size, bits, block))
        want, want_dec = reference_encode(x, bits, block)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(dec.view(np.uint32), want_dec.view(np.uint32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's NaN arithmetic
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_non_finite_value_makes_its_blocks_decode_non_finite(bits):
    x = delicate(64, seed=1)
    x[5], x[40] = np.nan, np.inf
    _, dec = quant_native.encode(x, bits, 32, encoded_bytes(x.size, bits, 32))
    _, want = reference_encode(x, bits, 32)
    assert np.isnan(dec[:32]).all() and not np.isfinite(dec[32:]).all()
    np.testing.assert_array_equal(np.isfinite(dec), np.isfinite(want))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_core_functions_take_the_kernels_and_give_the_composed_bits(bits, monkeypatch):
    """encode_parts / decode_parts / decode_sum with the kernels against the same calls on the
    composed route (the kernels hidden), on parts that are not whole blocks."""
    x, counts = delicate(3001, seed=bits), [1001, 1000, 1000]
    native = encode_parts(OPS, x, counts, bits, 64), encode(OPS, x, bits, 64)
    lens = [encoded_bytes(c, bits, 64) for c in counts]
    dec_parts = decode_parts(OPS, native[0][0], counts, lens, bits, 64, like=x)
    dec_one = decode(OPS, native[1][0], 3001, bits, 64)
    payloads = [native[1][0], encode(OPS, x[::-1].copy(), bits, 64)[0]]
    summed = decode_sum(OPS, payloads, 3001, bits, 64)
    into = np.full(3001, np.nan, np.float32)
    assert decode_sum(OPS, payloads, 3001, bits, 64, into=into) is into
    monkeypatch.setattr(quant_native, "_native", None)
    composed = encode_parts(OPS, x, counts, bits, 64), encode(OPS, x, bits, 64)
    for (a, b), (c, d) in zip(native, composed):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b.view(np.uint32), d.view(np.uint32))
    np.testing.assert_array_equal(dec_parts.view(np.uint32),
                                  decode_parts(OPS, native[0][0], counts, lens, bits, 64, like=x).view(np.uint32))
    np.testing.assert_array_equal(dec_one.view(np.uint32), decode(OPS, native[1][0], 3001, bits, 64).view(np.uint32))
    composed_sum = decode_sum(OPS, payloads, 3001, bits, 64)
    np.testing.assert_array_equal(summed.view(np.uint32), composed_sum.view(np.uint32))
    np.testing.assert_array_equal(into.view(np.uint32), composed_sum.view(np.uint32))


def test_wrong_sizes_are_one_clear_error():
    from hvd_commopt.compress import _quantkernels as kernels  # type: ignore[attr-defined]
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="x has 40 bytes, out 3 \\(expected 14\\)"):
        kernels.encode(x, 8, 256, np.empty(3, np.uint8), None)
    with pytest.raises(ValueError, match="bits must be 2..8"):
        kernels.encode(x, 9, 256, np.empty(14, np.uint8), None)
    with pytest.raises(ValueError, match="10 elements need 14 bytes in and 40 out"):
        kernels.decode(np.empty(14, np.uint8), 10, 8, 256, np.empty(9, np.float32), False)


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_exchange_with_the_kernels_is_the_composed_exchange_round_after_round(P, bits, monkeypatch):
    """Results and residuals over 4 rounds of error feedback (the reducer's buffers reused from
    round to round), two buckets, parts that are not whole blocks: bit for bit the composed
    route's. One rank, timed whole (``whole_round_alone``) as ``auto`` times it, too."""
    from hvd_commopt import run_ranks
    from hvd_commopt.buckets import Bucket
    from hvd_commopt.reduce import QuantizedAllreduce, ReduceContext, RoundInfo

    def body(comm):
        red = QuantizedAllreduce(bits, block=48, whole_round_alone=comm.size == 1)
        ctx = ReduceContext(comm, OPS, postscale=1.0 / comm.size)
        got = []
        for t in range(4):
            for name, n in (("a", 1001), ("b", 333)):
                x = delicate(n, seed=100 * t + 10 * comm.rank + n)
                out = red.reduce(Bucket.single(name, n, "float32"), RoundInfo(t), x, ctx)
                got += [out.copy(), red.memory.residual(OPS, name, x).copy()]
        return got
    native = run_ranks(P, body)
    monkeypatch.setattr(quant_native, "_native", None)
    composed = run_ranks(P, body)
    for rank_native, rank_composed in zip(native, composed):
        for a, b in zip(rank_native, rank_composed):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
