"""Host kernels of the selection primitives (``abs_where``, ``add_abs_where``, ``kth_largest_abs``).

NumPy only, so the core can hold them: :class:`hvd_commopt.numpy_ops.NumpyOps` calls them, and
the adapters call them on the memory of contiguous CPU tensors (torch's ``Tensor.numpy()`` is
zero-copy), because ATen's CPU ``nonzero`` and bool comparisons alone cost 3-5 memory passes
(docs/selection.md#primitives). The candidate sweep of float32/float64 runs in the native
extension ``hvd_commopt._hostkernels`` when it was built (one pass where NumPy needs five
operations per chunk; bit-identical, docs/selection.md#native-sweep), else in NumPy; so does the
momentum correction's ``u = mu*u + g`` (:func:`np_scale_add`, one pass where NumPy makes two).

The order on magnitudes (docs/selection.md#order): ``+0 == -0 < denormals < normals < +Inf <
NaN`` with every NaN equal, the order of ``torch.topk`` / ``np.partition``. Comparisons work on
the bit pattern of ``|x|`` read as a signed integer (the *key*), monotone in the value, so NaNs
need no extra pass and the result does not depend on the CPU's denormals-are-zero mode.

A threshold ``thr`` is a Python float rounded to the tensor's dtype. ``thr = nan`` is the NaN
class (``ge``: the NaNs, ``gt``: nothing, ``le``: everything, ``lt``: every non-NaN); a negative
threshold is below every ``|x|``.
"""
from __future__ import annotations

import math
import threading

import numpy as np

__all__ = ["OPS", "ALL", "NONE", "threshold_plan", "np_abs_where", "np_add_abs_where",
           "np_kth_largest_abs", "np_key_of", "np_sweep", "np_all_none", "np_abs_keys", "np_key_value", "NP_KEYS",
           "native_sweep", "use_native", "np_scale_add", "np_add_momentum_abs_where", "np_stream_store",
           "np_sparse_axpy", "np_take", "np_scatter_add", "np_zero_at", "np_scatter_sum", "RANDOM_ACCESS_MIN",
           "np_fused_topk"]

try:  # built by setup.py when a C compiler is there (optional: the NumPy sweep stands in)
    from . import _hostkernels as _native
except ImportError:  # pragma: no cover - an install without the compiled extension
    _native = None

OPS = ("ge", "gt", "le", "lt")

# The key domain: |x| as its bit pattern, an integer that orders like the value
#
# For IEEE floats with the sign bit cleared, the bit pattern read as a signed integer is monotone
# in the value: +0 < denormals < normals < +Inf (INF_KEY) < every NaN (> INF_KEY). Comparing keys
# instead of floats gives the NaN-largest order for free (no isnan pass), treats -0 as +0 (abs
# clears the sign), orders denormals as values, and does not depend on the CPU's
# denormals-are-zero mode. Equal to IEEE comparison of |x| whenever DAZ is off.

# numpy dtype -> (key dtype, abs mask, +Inf key)
NP_KEYS = {
    np.dtype(np.float32): (np.dtype(np.int32), 0x7FFFFFFF, 0x7F800000),
    np.dtype(np.float64): (np.dtype(np.int64), 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
    np.dtype(np.float16): (np.dtype(np.int16), 0x7FFF, 0x7C00),
}
ALL, NONE = "all", "none"


def threshold_plan(op: str, thr: float, key_of, inf_key: int):
    """``abs_where``'s comparison in the key domain: ALL, NONE or (op, key).

    ``key_of(thr)`` is the key of ``thr`` rounded to the tensor's dtype (a non-negative float).
    NaN thresholds select the NaN class (ge: NaNs, lt: non-NaNs, gt: none, le: all); negative
    thresholds are below every |x| (ge/gt: all, le/lt: none).
    """
    if op not in OPS:
        raise ValueError(f"abs_where: op must be one of {OPS}, got {op!r}")
    thr = float(thr)
    if math.isnan(thr):
        if op == "gt":
            return NONE
        if op == "le":
            return ALL
        return op, inf_key + 1
    if thr < 0.0:
        return ALL if op in ("ge", "gt") else NONE
    return op, int(key_of(thr))


def np_key_of(dtype):
    kd, mask, _ = NP_KEYS[dtype]
    def key_of(thr):
        with np.errstate(over="ignore"):  # beyond the dtype's range: rounds to +Inf, as a cast does
            return int(np.array(thr, dtype=dtype).view(kd)) & mask
    return key_of


# NumPy kernels (also the host kernels of the torch and TF adapters)

CHUNK = 1 << 18  # 256 Ki elements: 1 MiB of keys + 256 KiB of flags stay in L2


class _Scratch(threading.local):
    """Per-thread reusable buffers: no allocation (and no page faults) per call."""

    def __init__(self):
        self.bufs: dict = {}

    def get(self, kd):
        """The sweep's chunk buffers for key dtype ``kd``: (keys, flags)."""
        b = self.bufs.get(kd)
        if b is None:
            b = self.bufs[kd] = (np.empty(CHUNK, dtype=kd), np.empty(CHUNK, dtype=np.bool_))
        return b

    def at_least(self, dtype, n: int) -> np.ndarray:
        """A buffer of ``dtype`` holding at least ``n`` elements (grown when a call needs more)."""
        key = ("at_least", np.dtype(dtype))
        b = self.bufs.get(key)
        if b is None or b.size < n:
            b = self.bufs[key] = np.empty(max(n, 1 << 16), dtype=dtype)
        return b


_SCRATCH = _Scratch()
_NP_CMP = {"ge": np.greater_equal, "gt": np.greater, "le": np.less_equal, "lt": np.less}


def _np_float(x) -> np.ndarray:
    x = np.asarray(x).reshape(-1)
    if x.dtype not in NP_KEYS:
        raise TypeError(f"abs_where/kth_largest_abs: float16/32/64 expected, got {x.dtype}")
    return x


def np_all_none(x, plan):
    if plan == ALL:
        return np.arange(x.size, dtype=np.int64), x.copy()
    return np.empty(0, dtype=np.int64), x[:0].copy()


_NATIVE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_OP_CODE = {"ge": 0, "gt": 1, "le": 2, "lt": 3}
_native_on = _native is not None


def _native_for(first: np.ndarray, *others: np.ndarray) -> bool:
    """Whether the native kernels may take these arrays: on, float32/float64, one dtype and one
    size, contiguous."""
    if not (_native_on and first.dtype in _NATIVE_DTYPES and first.flags.c_contiguous):
        return False
    dt, n = first.dtype, first.size
    for a in others:  # a loop, not a generator over a new tuple: several calls per bucket and step
        if a.dtype != dt or a.size != n or not a.flags.c_contiguous:
            return False
    return True


def _parts_for(x: np.ndarray, parts: tuple) -> bool:
    """Whether ``parts``, ``(start, array)`` pairs, cover ``x`` in order with contiguous arrays of
    its dtype (the native top-k's addend in parts)."""
    at = 0
    for start, a in parts:
        if start != at or a.dtype != x.dtype or not a.flags.c_contiguous or a.ndim != 1:
            return False
        at += a.size
    return at == x.size and bool(parts)


def native_sweep() -> bool:
    """True when the candidate sweep runs in the native extension (built, and not turned off)."""
    return _native_on


def use_native(on: bool) -> bool:
    """Turn the native sweep on or off (benchmarks compare the two in one process); returns the
    previous setting. On needs the extension: without it this stays off."""
    global _native_on
    prev, _native_on = _native_on, bool(on) and _native is not None
    return prev


def np_sweep(x: np.ndarray, plan, g: np.ndarray | None = None, out: np.ndarray | None = None):
    """(indices, values) of |x| op key, chunk by chunk; with ``g``: x += g first, per chunk (into
    ``out`` instead of x when given: x stays intact, at no extra pass)."""
    y = x if g is None or out is None else out
    if _native_for(x, y, *(() if g is None else (g,))):
        return _native_run(x, plan, g, y)
    op, key = plan
    kd, mask, _ = NP_KEYS[x.dtype]
    cmp = _NP_CMP[op]
    key = kd.type(key)
    mask = kd.type(mask)
    buf, flags = _SCRATCH.get(kd)
    n = x.size
    xi = y.view(kd)
    ip, vp = [], []
    for c0 in range(0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        L = c1 - c0
        xc = y[c0:c1]
        if g is not None:
            np.add(x[c0:c1], g[c0:c1], out=xc)
        b, f = buf[:L], flags[:L]
        np.bitwise_and(xi[c0:c1], mask, out=b)   # |x| as a key (the abs pass, into cache)
        cmp(b, key, out=f)
        p = np.flatnonzero(f)
        if p.size:
            vp.append(xc.take(p))                 # values from the chunk while it is in cache
            if c0:
                p += c0
            ip.append(p)
    if not ip:
        return np.empty(0, dtype=np.int64), y[:0].copy()
    if len(ip) == 1:
        return ip[0], vp[0]
    return np.concatenate(ip), np.concatenate(vp)


def _native_run(x: np.ndarray, plan, g: np.ndarray | None, y: np.ndarray, momentum: tuple = ()):
    """:func:`np_sweep` in the native kernel: output buffers sized for 1/32 of the elements; when
    they fill up, the kernel says where it stopped and the sweep goes on into larger ones.
    ``momentum`` = (u, mu, u_out): the addend is ``u*mu + g``, made in the same pass into u_out."""
    op, key = plan
    code, n = _OP_CODE[op], x.size
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


def np_stream_store(dst: np.ndarray, src: np.ndarray | None = None) -> bool:
    """``dst = src`` byte for byte (``src`` None: zero bytes, +0.0 in every float dtype) in the
    native kernel, which writes a buffer of a megabyte or more with streaming stores
    (docs/selection.md#streaming-stores); False, nothing done, where the native kernels are off or
    the arrays are not contiguous and of one size: the caller does it its own way."""
    if not _native_on or not dst.flags.c_contiguous or (src is not None and (
            not src.flags.c_contiguous or src.nbytes != dst.nbytes)):
        return False
    _native.stream_store(dst.reshape(-1).view(np.uint8), None if src is None else src.reshape(-1).view(np.uint8))
    return True


def np_sparse_axpy(idx: np.ndarray, vals: np.ndarray, alpha: float, starts: np.ndarray, params: list) -> bool:
    """``p[i] = fma(v, alpha, p[i])`` at every (i, v) of (idx, vals), i a position in a bucket whose
    members ``params`` (flat arrays) start at ``starts`` (plus the total at the end); a repeated i
    gets the same value again, never a second update (docs/wrapper.md#sparse-update). Native only:
    False, nothing done, where the extension is missing or off."""
    if not _native_on or vals.dtype not in _NATIVE_DTYPES:
        return False
    _native.sparse_axpy(idx, vals, float(alpha), starts, params, _SCRATCH.at_least(vals.dtype, vals.size))
    return True


# Below this many positions an index operation stays the framework's: the call costs more than the
# cache misses it overlaps (docs/selection.md#random-access)
RANDOM_ACCESS_MIN = 1024


def _random_access_ok(x: np.ndarray, idx: np.ndarray) -> bool:
    return (_native_on and idx.dtype == np.int64 and idx.size >= RANDOM_ACCESS_MIN and x.flags.c_contiguous
            and idx.flags.c_contiguous and x.dtype.itemsize in (1, 2, 4, 8))


def np_take(x: np.ndarray, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
    """``x[idx]`` (flat x, int64 idx) by the native kernel, which prefetches ahead of the scattered
    reads (docs/selection.md#random-access); None where it does not apply (the caller's own path)."""
    if not _random_access_ok(x, idx):
        return None
    if out is None:
        out = np.empty(idx.size, dtype=x.dtype)
    _native.scattered(0, x.reshape(-1), idx.reshape(-1), out)
    return out


def np_scatter_add(dst: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> bool:
    """``dst[idx[j]] += vals[j]`` in the order of j (repeats add up), float32/float64, natively
    (docs/selection.md#random-access); False, nothing done, where it does not apply."""
    if not (_random_access_ok(dst, idx) and dst.dtype in _NATIVE_DTYPES and vals.dtype == dst.dtype
            and vals.flags.c_contiguous and vals.size == idx.size):
        return False
    _native.scattered(1, dst.reshape(-1), idx.reshape(-1), vals.reshape(-1))
    return True


def np_zero_at(x: np.ndarray, idx: np.ndarray) -> bool:
    """``x[idx] = 0`` (zero bytes: +0.0), natively (docs/selection.md#random-access); False where
    it does not apply."""
    if not _random_access_ok(x, idx):
        return False
    _native.scattered(2, x.reshape(-1), idx.reshape(-1))
    return True


def np_scatter_sum(out: np.ndarray, idx: np.ndarray, vals: np.ndarray, scale: float, sums: np.ndarray) -> bool | None:
    """The sparse result in one native pass (docs/selection.md#scatter-sum): ``out =
    scatter_add(zeros, idx, vals)`` scaled by ``scale`` (rounded to out's dtype; 1.0: unscaled),
    ``sums[j] = out[idx[j]]``; returns whether every sum is finite. None, nothing written, where
    it does not apply (native kernels off, dtypes, layout, idx in more than a few ascending runs):
    the caller's plain path, whose bits these are."""
    if not (_native_on and out.dtype in _NATIVE_DTYPES and vals.dtype == out.dtype and sums.dtype == out.dtype
            and idx.dtype == np.int64 and vals.size == idx.size == sums.size
            and all(a.flags.c_contiguous for a in (out, idx, vals, sums))):
        return None
    return _native.scatter_sum(out.reshape(-1), idx.reshape(-1), vals.reshape(-1), float(scale), sums.reshape(-1))


def np_fused_topk(x: np.ndarray, k: int, sidx: np.ndarray | None, j_lo: int, j_hi: int, max_retries: int,
                  g: np.ndarray | None = None, u: np.ndarray | None = None, mu: float = 0.0,
                  u_out: np.ndarray | None = None, out: np.ndarray | None = None):
    """``ExactTopK.select`` of ``x`` (+ ``g``, or + ``u*mu + g`` made into ``u_out``) in one native
    call (docs/selection.md#native-topk): ``(acc, values, indices, v, candidates, retries,
    full_fallbacks, above_fallback, ties, finite)`` with acc the sums (into ``out`` when given, x
    intact; else into x) and finite None where unknown. None, nothing done, where it does not apply
    (native kernels off, dtypes, sizes, layout): the caller's own route.

    ``g`` may also be a tuple of ``(start, array)`` parts that cover x in order (a bucket's
    gradients read where they are, docs/selection.md#grad-parts): the same sums, bit for bit."""
    y = x if g is None or out is None else out
    arrays = (x, y, *(() if g is None or isinstance(g, tuple) else (g,)), *(() if u is None else (u, u_out)))
    if not (_native_for(*arrays) and (sidx is None or (sidx.dtype == np.int64 and sidx.flags.c_contiguous))):
        return None
    if isinstance(g, tuple) and not _parts_for(x, g):
        return None
    vals, idx = np.empty(k, dtype=x.dtype), np.empty(k, dtype=np.int64)
    v, c, retries, full, above, ties, finite = _native.topk(x, g, y, u, float(mu), u_out, int(k), sidx, int(j_lo),
                                                            int(j_hi), int(max_retries), vals, idx)
    return (y, vals, idx, np_key_value(v, x.dtype), c, retries, full, above, ties,
            None if finite < 0 else bool(finite))


def np_scale_add(out: np.ndarray, t: np.ndarray, s: float, g: np.ndarray) -> np.ndarray:
    """``t * s + g`` into ``out`` (which may be t, not g), ``s`` rounded to t's dtype: two
    roundings, bit-identical to a multiply then an add (docs/selection.md#native-sweep)."""
    if _native_for(t, g, out):
        _native.scale_add(t, float(s), g, out)
        return out
    with np.errstate(invalid="ignore", over="ignore"):  # Inf*0 and overflow are values here, as in torch
        np.multiply(t, t.dtype.type(s), out=out)
        return np.add(out, g, out=out)


def np_add_momentum_abs_where(acc: np.ndarray, u: np.ndarray, mu: float, g: np.ndarray, u_out: np.ndarray,
                              op: str, thr: float, out: np.ndarray | None = None):
    """``u' = u*mu + g`` into ``u_out`` (which may be u) and ``add_abs_where(acc, u')`` in one
    sweep where the native kernel runs (docs/selection.md#native-sweep); returns (the sum, u',
    indices, values), bit-identical to :func:`np_scale_add` then :func:`np_add_abs_where`. ``g``
    may be a tuple of ``(start, array)`` parts covering acc (docs/selection.md#grad-parts)."""
    acc = _np_float(acc)
    y = acc if out is None else out.reshape(-1)
    plan = threshold_plan(op, thr, np_key_of(acc.dtype), NP_KEYS[acc.dtype][2])
    parts = isinstance(g, tuple)  # (start, array) parts of g (docs/selection.md#grad-parts)
    if (plan not in (ALL, NONE) and _native_for(acc, u, u_out, y)
            and (_parts_for(acc, g) if parts else _native_for(acc, g))):
        return (y, u_out, *_native_run(acc, plan, g, y, (u, float(mu), u_out)))
    if parts:
        g = np.concatenate([a.reshape(-1) for _, a in g]) if g else np.empty(0, acc.dtype)
    u_new = np_scale_add(u_out, u, mu, g)
    y, idx, vals = np_add_abs_where(acc, u_new, op, thr, out)
    return y, u_new, idx, vals


def np_abs_where(x, op: str, thr: float):
    """NumPy kernel of ``abs_where``: (int64 ascending indices, values)."""
    x = _np_float(x)
    plan = threshold_plan(op, thr, np_key_of(x.dtype), NP_KEYS[x.dtype][2])
    if plan in (ALL, NONE):
        return np_all_none(x, plan)
    return np_sweep(x, plan)


def np_add_abs_where(acc: np.ndarray, g, op: str, thr: float, out: np.ndarray | None = None):
    """NumPy kernel of ``add_abs_where``: ``acc += g`` (in place, or into ``out``, chunk by chunk,
    each chunk compared while in cache); returns (the sum, indices, values)."""
    acc = _np_float(acc)
    g = np.asarray(g).reshape(-1)
    y = acc if out is None else out.reshape(-1)
    plan = threshold_plan(op, thr, np_key_of(acc.dtype), NP_KEYS[acc.dtype][2])
    if plan in (ALL, NONE):
        np.add(acc, g, out=y)
        return (y, *np_all_none(y, plan))
    return (y, *np_sweep(acc, plan, g, y))


def np_abs_keys(x: np.ndarray) -> np.ndarray:
    """|x| as its keys (a new array), every NaN one key just above +Inf."""
    kd, mask, inf_key = NP_KEYS[x.dtype]
    keys = np.bitwise_and(x.view(kd), kd.type(mask))
    return np.minimum(keys, kd.type(inf_key + 1), out=keys)


def np_key_value(key: int, dtype) -> float:
    """The magnitude a key stands for, as a Python float (nan for the NaN key)."""
    kd, _, inf_key = NP_KEYS[np.dtype(dtype)]
    return math.nan if int(key) > inf_key else float(np.array(key, dtype=kd).view(dtype))


def np_kth_largest_abs(x, k: int) -> float:
    """Exact k-th largest |x| in the key order (NaN largest), via np.partition on the keys."""
    x = _np_float(x)
    n, k = x.size, int(k)
    if not 1 <= k <= n:
        raise ValueError(f"kth_largest_abs: k={k} outside [1, {n}]")
    return np_key_value(np.partition(np_abs_keys(x), n - k)[n - k], x.dtype)
