"""NumPy kernels of the selection primitives (``abs_where``, ``add_abs_where``, ``kth_largest_abs``).

NumPy only: :class:`hvd_commopt.select.host.HostKernels` runs them on the host view of a tensor
(``TensorOps.host_view``: torch's ``Tensor.numpy()`` is zero-copy), because ATen's CPU
``nonzero`` and bool comparisons alone cost 3-5 memory passes (docs/selection.md#primitives). The
candidate sweep of float32/float64 runs in the native extension (:mod:`.host_native`) when it was
built (one pass where NumPy needs five operations per chunk; bit-identical,
docs/selection.md#native-sweep), else in NumPy; so does the momentum correction's ``u = mu*u + g``
(:func:`hvd_commopt.host_memory.scale_add`, one pass where NumPy makes two).

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

from ..host_memory import scale_add
from .host_native import native, native_for, native_run, parts_for

__all__ = ["OPS", "ALL", "NONE", "threshold_plan", "np_abs_where", "np_add_abs_where", "np_kth_largest_abs",
           "np_key_of", "np_sweep", "np_all_none", "np_abs_keys", "np_key_value", "NP_KEYS",
           "np_add_momentum_abs_where", "np_fused_topk"]

OPS = ("ge", "gt", "le", "lt")

# The key domain: |x| as its bit pattern, an integer that orders like the value
#
# For IEEE floats with the sign bit cleared, the bit pattern read as a signed integer is monotone
# in the value: +0 < denormals < normals < +Inf (INF_KEY) < every NaN (> INF_KEY). Comparing keys
# instead of floats gives the NaN-largest order for free (no isnan pass), treats -0 as +0 (abs
# clears the sign), orders denormals as values, and does not depend on the CPU's
# denormals-are-zero mode. Equal to IEEE comparison of |x| whenever DAZ is off.

# numpy dtype -> (key dtype, abs mask, +Inf key)
NP_KEYS: dict[np.dtype, tuple[np.dtype, int, int]] = {
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


# NumPy kernels (the host kernels of every adapter, on its host views)

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


def np_sweep(x: np.ndarray, plan, g: np.ndarray | None = None, out: np.ndarray | None = None):
    """(indices, values) of |x| op key, chunk by chunk; with ``g``: x += g first, per chunk (into
    ``out`` instead of x when given: x stays intact, at no extra pass)."""
    y = x if g is None or out is None else out
    if native_for(x, y, *(() if g is None else (g,))):
        return native_run(x, plan, g, y)
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
    if not (native_for(*arrays) and (sidx is None or (sidx.dtype == np.int64 and sidx.flags.c_contiguous))):
        return None
    if isinstance(g, tuple) and not parts_for(x, g):
        return None
    vals, idx = np.empty(k, dtype=x.dtype), np.empty(k, dtype=np.int64)
    v, c, retries, full, above, ties, finite = native().topk(x, g, y, u, float(mu), u_out, int(k), sidx, int(j_lo),
                                                            int(j_hi), int(max_retries), vals, idx)
    return (y, vals, idx, np_key_value(v, x.dtype), c, retries, full, above, ties,
            None if finite < 0 else bool(finite))


def np_add_momentum_abs_where(acc: np.ndarray, u: np.ndarray, mu: float, g: np.ndarray, u_out: np.ndarray,
                              op: str, thr: float, out: np.ndarray | None = None):
    """``u' = u*mu + g`` into ``u_out`` (which may be u) and ``add_abs_where(acc, u')`` in one
    sweep where the native kernel runs (docs/selection.md#native-sweep); returns (the sum, u',
    indices, values), bit-identical to :func:`~hvd_commopt.host_memory.scale_add` then :func:`np_add_abs_where`. ``g``
    may be a tuple of ``(start, array)`` parts covering acc (docs/selection.md#grad-parts)."""
    acc = _np_float(acc)
    y = acc if out is None else out.reshape(-1)
    plan = threshold_plan(op, thr, np_key_of(acc.dtype), NP_KEYS[acc.dtype][2])
    parts = isinstance(g, tuple)  # (start, array) parts of g (docs/selection.md#grad-parts)
    if (plan not in (ALL, NONE) and native_for(acc, u, u_out, y)
            and (parts_for(acc, g) if parts else native_for(acc, g))):  # type: ignore[arg-type]  # parts: g is a tuple
        return (y, u_out, *native_run(acc, plan, g, y, (u, float(mu), u_out)))
    if parts:
        g = np.concatenate([a.reshape(-1) for _, a in g]) if g else np.empty(0, acc.dtype)
    u_new = scale_add(u_out, u, mu, g)
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
