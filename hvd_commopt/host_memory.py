"""Host-memory kernels for any adapter's tensor primitives: streaming copies and fills, prefetched
scattered reads and writes, the one-pass ``t*s + g`` and the sparse optimizer update.

These are not selection: the engine's packing (``copy_into``), a reused buffer's ``zero_``, the
memories' ``index_fill``/``scatter_add`` and the momentum's ``scale_add_into`` call them through
the adapters' TensorOps on the memory of host tensors. They run in the native extension
(``hvd_commopt.select._hostkernels``, whose switch :data:`hvd_commopt.select.host_native.USE_NATIVE`
they follow); where it is missing or off each says "does not apply" (False/None) and the adapter
uses its framework's own op, whose bits these are.
"""
from __future__ import annotations

import threading

import numpy as np

from .select import host_native

__all__ = ["stream_store", "sparse_axpy", "take", "scatter_add", "zero_at", "scale_add", "RANDOM_ACCESS_MIN",
           "native_on", "momentum_average"]

# Below this many positions an index operation stays the framework's: the call costs more than the
# cache misses it overlaps (docs/selection.md#random-access)
RANDOM_ACCESS_MIN = 1024


def native_on() -> bool:
    """True when these kernels run natively (the extension built, and not turned off)."""
    return host_native.native() is not None


class _Scratch(threading.local):
    """A per-thread buffer of at least n elements (no allocation per call)."""

    def __init__(self):
        self.bufs: dict = {}

    def at_least(self, dtype, n: int) -> np.ndarray:
        key = np.dtype(dtype)
        b = self.bufs.get(key)
        if b is None or b.size < n:
            b = self.bufs[key] = np.empty(max(n, 1 << 16), dtype=dtype)
        return b


_SCRATCH = _Scratch()


def stream_store(dst: np.ndarray, src: np.ndarray | None = None) -> bool:
    """``dst = src`` byte for byte (``src`` None: zero bytes, +0.0 in every float dtype) in the
    native kernel, which writes a buffer of a megabyte or more with streaming stores
    (docs/selection.md#streaming-stores); False, nothing done, where the native kernels are off or
    the arrays are not contiguous and of one size: the caller does it its own way."""
    native = host_native.native()
    if native is None or not dst.flags.c_contiguous or (src is not None and (
            not src.flags.c_contiguous or src.nbytes != dst.nbytes)):
        return False
    native.stream_store(dst.reshape(-1).view(np.uint8), None if src is None else src.reshape(-1).view(np.uint8))
    return True


def sparse_axpy(idx: np.ndarray, vals: np.ndarray, alpha: float, starts: np.ndarray, params: list) -> bool:
    """``p[i] = fma(v, alpha, p[i])`` at every (i, v) of (idx, vals), i a position in a bucket whose
    members ``params`` (flat arrays) start at ``starts`` (plus the total at the end); a repeated i
    gets the same value again, never a second update (docs/wrapper.md#sparse-update). Native only:
    False, nothing done, where the extension is missing or off."""
    native = host_native.native()
    if native is None or vals.dtype not in host_native.NATIVE_DTYPES:
        return False
    native.sparse_axpy(idx, vals, float(alpha), starts, params, _SCRATCH.at_least(vals.dtype, vals.size))
    return True


def _random_access(x: np.ndarray, idx: np.ndarray):
    native = host_native.native()
    if (native is not None and idx.dtype == np.int64 and idx.size >= RANDOM_ACCESS_MIN and x.flags.c_contiguous
            and idx.flags.c_contiguous and x.dtype.itemsize in (1, 2, 4, 8)):
        return native
    return None


def take(x: np.ndarray, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
    """``x[idx]`` (flat x, int64 idx) by the native kernel, which prefetches ahead of the scattered
    reads (docs/selection.md#random-access); None where it does not apply (the caller's own path)."""
    native = _random_access(x, idx)
    if native is None:
        return None
    if out is None:
        out = np.empty(idx.size, dtype=x.dtype)
    native.scattered(0, x.reshape(-1), idx.reshape(-1), out)
    return out


def scatter_add(dst: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> bool:
    """``dst[idx[j]] += vals[j]`` in the order of j (repeats add up), float32/float64, natively
    (docs/selection.md#random-access); False, nothing done, where it does not apply."""
    native = _random_access(dst, idx)
    if not (native is not None and dst.dtype in host_native.NATIVE_DTYPES and vals.dtype == dst.dtype
            and vals.flags.c_contiguous and vals.size == idx.size):
        return False
    native.scattered(1, dst.reshape(-1), idx.reshape(-1), vals.reshape(-1))
    return True


def zero_at(x: np.ndarray, idx: np.ndarray) -> bool:
    """``x[idx] = 0`` (zero bytes: +0.0), natively (docs/selection.md#random-access); False where
    it does not apply."""
    native = _random_access(x, idx)
    if native is None:
        return False
    native.scattered(2, x.reshape(-1), idx.reshape(-1))
    return True


def scale_add(out: np.ndarray, t: np.ndarray, s: float, g: np.ndarray) -> np.ndarray:
    """``t * s + g`` into ``out`` (which may be t, not g), ``s`` rounded to t's dtype: two
    roundings, bit-identical to a multiply then an add (docs/selection.md#native-sweep)."""
    if host_native.native_for(t, g, out):
        host_native.native().scale_add(t, float(s), g, out)
        return out
    with np.errstate(invalid="ignore", over="ignore"):  # Inf*0 and overflow are values here, as in torch
        np.multiply(t, t.dtype.type(s), out=out)
        return np.add(out, g, out=out)


def momentum_average(x: np.ndarray, post: float, u: np.ndarray, mu: float, uo: np.ndarray) -> bool | None:
    """``uo = u*mu + x*post``, written to ``uo`` and to ``x`` (``post`` and ``mu`` rounded to x's
    dtype, no multiply when ``post`` is 1; the roundings of torch's ``mul_`` then ``add_``), and
    whether every ``x*post`` is finite, in one native pass: the momentum of a bucket reduced dense
    (docs/auto-compression.md#dense-path). ``uo`` must not overlap ``x``. None, nothing done, where
    the native kernels do not apply."""
    if not host_native.native_for(x, u, uo):
        return None
    return bool(host_native.native().momentum_average(x, float(post), u, float(mu), uo))
