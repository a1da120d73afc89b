"""Fixtures of the native host kernels' tests (tests/unit/test_host_kernels.py,
tests/unit/test_scatter_sum.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(params=["avx2", "portable"])
def simd(request):
    """Each of the native kernels' paths in turn (AVX2 where the CPU has it, and the portable one),
    then the default back."""
    native = pytest.importorskip("hvd_commopt.select._hostkernels", reason="the native extension was not built")
    got = native._set_simd(request.param == "avx2")
    if got != request.param:
        native._set_simd(True)
        pytest.skip(f"this CPU has no {request.param} path")
    yield got
    native._set_simd(True)


@pytest.fixture
def restore_native():
    """The native kernels back on after a test that turns them off."""
    from hvd_commopt.select import host_native
    prev = host_native.USE_NATIVE
    yield
    host_native.USE_NATIVE = prev


@pytest.fixture(params=[0, 1 << 40], ids=["streamed", "plain-stores"])
def stream_min(request):
    """Each store route in turn: every buffer streamed (0), then none (2^40 bytes), then the default back."""
    native = pytest.importorskip("hvd_commopt.select._hostkernels", reason="the native extension was not built")
    prev = native._set_stream_min(request.param)
    yield request.param
    native._set_stream_min(prev)
