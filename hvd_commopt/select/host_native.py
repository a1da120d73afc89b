"""The native host kernels (the C extension ``hvd_commopt.select._hostkernels``) and their NumPy
stand-ins, on host arrays: the selection sweep's native run, the sparse result's one-pass build
and the whole exact top-k in one call (docs/selection.md#native-sweep, #scatter-sum, #native-topk).

The extension is optional (setup.py builds it where a C compiler is there): without it, or with
:data:`USE_NATIVE` off, every function here says "does not apply" (None/False) or runs its NumPy
stand-in, and the callers take their own route, whose bits these are.

:data:`USE_NATIVE` is an A/B switch for tests and benchmarks (the ``_np`` variants compare the
NumPy kernels in the same process); set it through a fixture or ``monkeypatch.setattr``.
"""
from __future__ import annotations

import warnings

import numpy as np

#: the version of the extension's function table this source calls (``KERNELS_VERSION`` in
#: _hostkernels.c): an editable install whose extension was built from older sources lacks the
#: newer kernels, so it is not used (the NumPy kernels stand in) and one warning says to rebuild
KERNELS_VERSION = 2

try:  # built by setup.py when a C compiler is there (optional: the NumPy kernels stand in)
    from . import _hostkernels as _native  # type: ignore[attr-defined]  # the C extension: no stub
except ImportError:  # pragma: no cover - an install without the compiled extension
    _native = None
if _native is not None and getattr(_native, "KERNELS_VERSION", 0) != KERNELS_VERSION:  # pragma: no cover
    warnings.warn(f"hvd_commopt's compiled host kernels ({_native.__file__}) were built from other sources "
                  f"than this checkout's (version {getattr(_native, 'KERNELS_VERSION', 0)}, expected "
                  f"{KERNELS_VERSION}); the NumPy kernels run instead. Rebuild them: pip install -e . "
                  f"(or python setup.py build_ext --inplace)", RuntimeWarning, stacklevel=2)
    _native = None

__all__ = ["USE_NATIVE", "native", "native_sweep", "native_for", "parts_for", "native_run", "np_scatter_sum",
           "NATIVE_DTYPES", "OP_CODE"]

# Whether the native kernels run where they apply (built, and this on); tests and benchmarks turn
# it off to compare the NumPy kernels in one process.
USE_NATIVE = True

NATIVE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
OP_CODE = {"ge": 0, "gt": 1, "le": 2, "lt": 3}


def native():
    """The extension module where the native kernels run (built and :data:`USE_NATIVE`), else None."""
    return _native if USE_NATIVE else None


def native_sweep() -> bool:
    """True when the candidate sweep runs in the native extension (built, and not turned off)."""
    return USE_NATIVE and _native is not None


def native_for(first: np.ndarray, *others: np.ndarray) -> bool:
    """Whether the native kernels may take these arrays: on, float32/float64, one dtype and one
    size, contiguous."""
    if not (USE_NATIVE and _native is not None and first.dtype in NATIVE_DTYPES and first.flags.c_contiguous):
        return False
    dt, n = first.dtype, first.size
    for a in others:  # a loop, not a generator over a new tuple: several calls per bucket and step
        if a.dtype != dt or a.size != n or not a.flags.c_contiguous:
            return False
    return True


def parts_for(x: np.ndarray, parts: tuple) -> bool:
    """Whether ``parts``, ``(start, array)`` pairs, cover ``x`` in order with contiguous arrays of
    its dtype (the native top-k's addend in parts)."""
    at = 0
    for start, a in parts:
        if start != at or a.dtype != x.dtype or not a.flags.c_contiguous or a.ndim != 1:
            return False
        at += a.size
    return at == x.size and bool(parts)


def native_run(x: np.ndarray, plan, g: np.ndarray | None, y: np.ndarray, momentum: tuple = ()):
    """The candidate sweep in the native kernel: output buffers sized for 1/32 of the elements; when
    they fill up, the kernel says where it stopped and the sweep goes on into larger ones.
    ``momentum`` = (u, mu, u_out): the addend is ``u*mu + g``, made in the same pass into u_out."""
    op, key = plan
    code, n = OP_CODE[op], x.size
    start, cap, ip, vp = 0, max(64, n >> 5), [], []
    while True:
        idx = np.empty(min(cap, n - start + 64), dtype=np.int64)
        val = np.empty(idx.size, dtype=x.dtype)
        c, start = _native.sweep(x, g, y, code, key, idx, val, start, *momentum)
        ip.append(idx[:c])
        vp.append(val[:c])
        if start >= n:
            break
        cap *= 4
    if len(ip) == 1:
        return ip[0], vp[0]
    return np.concatenate(ip), np.concatenate(vp)


def np_scatter_sum(out: np.ndarray, idx: np.ndarray, vals: np.ndarray, scale: float, sums: np.ndarray) -> bool | None:
    """The sparse result in one native pass (docs/selection.md#scatter-sum): ``out =
    scatter_add(zeros, idx, vals)`` scaled by ``scale`` (rounded to out's dtype; 1.0: unscaled),
    ``sums[j] = out[idx[j]]``; returns whether every sum is finite. None, nothing written, where
    it does not apply (native kernels off, dtypes, layout, idx in more than a few ascending runs):
    the caller's plain path, whose bits these are."""
    if not (USE_NATIVE and _native is not None and out.dtype in NATIVE_DTYPES and vals.dtype == out.dtype
            and sums.dtype == out.dtype and idx.dtype == np.int64 and vals.size == idx.size == sums.size
            and all(a.flags.c_contiguous for a in (out, idx, vals, sums))):
        return None
    return _native.scatter_sum(out.reshape(-1), idx.reshape(-1), vals.reshape(-1), float(scale), sums.reshape(-1))
