"""The sum step of the MPI backend's half-precision ring allreduce: ``dst = half(dst + src)``.

MPI has no sum for float16 or bfloat16, so :meth:`~hvd_commopt.comm.mpi.MPIBackend.allreduce_`
runs a ring of its own and adds each received chunk here, in float32, rounded back to half
(docs/backends.md#half-ring). For bfloat16 (uint16 bit patterns) the native kernel
(``_halfsum.bf16_add``, built with the package where a C compiler exists) does it in one pass.
The NumPy route (:mod:`hvd_commopt.dtypes`' conversions) gives the same bits in about ten passes
with three temporaries: measured on 2 local ranks, a 6.1M-element bfloat16 allreduce took 143 ms
through it against Gloo's 21 ms (2026-11-27, load 20; docs/auto-compression-measured.md#dense-parity).
float16 keeps NumPy's route, whose conversions are vectorised already.
"""
from __future__ import annotations

import numpy as np

from ..dtypes import float32_to_half, half_to_float32

try:  # optional: built from _halfsum.c by setup.py
    from . import _halfsum as _native  # type: ignore[attr-defined]  # the C extension: no stub
except ImportError:  # pragma: no cover - no C compiler at install: the NumPy route
    _native = None

__all__ = ["add_into", "native_available", "USE_NATIVE"]

#: False: the NumPy route even where the kernel is built (the benchmarks' A/B of the two routes in one
#: job, as ``host_native.USE_NATIVE`` for the selection kernels; not a library option)
USE_NATIVE = True


def native_available() -> bool:
    """Whether bfloat16 sums run in the native kernel."""
    return _native is not None


def add_into(dst: np.ndarray, src: np.ndarray, native: bool = True) -> None:
    """``dst[...] = half(dst + src)``: float16, or bfloat16 as uint16 bit patterns; each sum in
    float32, rounded to nearest even. ``native=False`` forces the NumPy route (tests compare them)."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"half sum of {dst.dtype}{dst.shape} and {src.dtype}{src.shape}: equal shapes and dtypes expected")
    if native and USE_NATIVE and _native is not None and dst.dtype == np.uint16 and dst.flags.c_contiguous and src.flags.c_contiguous:
        _native.bf16_add(dst, src)
        return
    dst[...] = float32_to_half(half_to_float32(dst) + half_to_float32(src), dst.dtype)
