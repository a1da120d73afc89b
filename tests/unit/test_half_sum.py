"""The MPI backend's half-precision ring sum (hvd_commopt/comm/half_sum.py): the native bfloat16
kernel gives the NumPy route's bits for every bfloat16 pattern, NaN as NaN."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt.comm import half_sum
from hvd_commopt.dtypes import float32_to_half, half_to_float32

ALL_BF16 = np.arange(1 << 16, dtype=np.uint16)
# zero, -0, 1, the largest finite, its negative, +-Inf, the smallest subnormals, a NaN, the smallest normal
EDGES = [0x0000, 0x8000, 0x3F80, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x7FC0, 0x0080]


def _same_bits_or_both_nan(a: np.ndarray, b: np.ndarray) -> bool:
    nan = np.isnan(half_to_float32(a)) & np.isnan(half_to_float32(b))
    return bool(((a == b) | nan).all())


@pytest.mark.skipif(not half_sum.native_available(), reason="the _halfsum extension was not built (no C compiler)")
@pytest.mark.parametrize("addend", EDGES)
def test_native_bf16_sum_is_the_numpy_route_for_every_pattern(addend):
    native, numpy_route = ALL_BF16.copy(), ALL_BF16.copy()
    other = np.full(ALL_BF16.size, addend, np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        half_sum.add_into(native, other)
        half_sum.add_into(numpy_route, other, native=False)
    finite = np.isfinite(half_to_float32(native))
    np.testing.assert_array_equal(native[finite], numpy_route[finite])
    assert _same_bits_or_both_nan(native, numpy_route)


def test_bf16_sum_values_exact():
    # 1 + 2^-8 is not a bfloat16 (7 fraction bits): it rounds to even, 1.0; 1 + 3*2^-8 rounds up to 1 + 2^-6
    a = float32_to_half(np.array([1.0, 1.0, 1.5, -2.0], np.float32), np.uint16)
    b = float32_to_half(np.array([2.0 ** -8, 3 * 2.0 ** -8, 0.25, 0.5], np.float32), np.uint16)
    for native in (True, False):
        x = a.copy()
        half_sum.add_into(x, b, native=native)
        np.testing.assert_array_equal(half_to_float32(x), np.array([1.0, 1.0 + 2.0 ** -6, 1.75, -1.5], np.float32))


def test_fp16_sum_is_float32_rounded():
    a = np.array([1.0, 65504.0, 0.1], np.float16)
    b = np.array([2.0 ** -11, 65504.0, 0.2], np.float16)
    x = a.copy()
    with np.errstate(over="ignore"):
        half_sum.add_into(x, b)
        ref = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(x, ref)
    assert x[0] == np.float16(1.0) and np.isinf(x[1])


def test_mismatched_buffers_are_refused():
    with pytest.raises(ValueError, match="equal shapes and dtypes"):
        half_sum.add_into(np.zeros(4, np.uint16), np.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="equal shapes and dtypes"):
        half_sum.add_into(np.zeros(4, np.uint16), np.zeros(4, np.float16))


def test_a_strided_chunk_takes_the_numpy_route():
    a = float32_to_half(np.arange(8, dtype=np.float32), np.uint16)
    b = float32_to_half(np.ones(8, np.float32), np.uint16)
    half_sum.add_into(a[::2], b[::2])
    np.testing.assert_array_equal(half_to_float32(a), np.array([1, 1, 3, 3, 5, 5, 7, 7], np.float32))
