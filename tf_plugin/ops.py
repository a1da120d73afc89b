"""TensorOps with native TensorFlow ops (see :mod:`hvd_commopt.tensor_ops` for the contract).

TF tensors are immutable, so every method returns a new tensor, which is what the functional
TensorOps protocol asks for. One addition, for speed:
:meth:`TFOps.empty` returns a lazy fusion buffer, :class:`~tf_plugin.pack_buffer.PackBuffer` (why: its
module docstring).

Index operands are passed to eager ops as NumPy arrays, 2-4x cheaper to convert than Python lists.

All methods run eagerly: the adapter calls the core from eager code, or from inside the one
``tf.py_function`` per step that :mod:`tf_plugin.bridge` inserts into a ``tf.function``, where
the tensors are eager again.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from hvd_commopt.dtypes import magnitude_key
from hvd_commopt.numpy_ops import topk_index_np, topk_ranked_np
from .clip_ops import ClipToNorm
from .pack_buffer import PackBuffer
from .pack_buffer import value_of as _t
from .quant_ops import QuantKernels

__all__ = ["TFOps", "PackBuffer", "TF_DTYPES"]

TF_DTYPES = {
    "float64": tf.float64, "float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16,
    "int64": tf.int64, "int32": tf.int32, "int16": tf.int16, "int8": tf.int8, "uint8": tf.uint8,
    "bool": tf.bool,
}


def _idx(*values: int) -> np.ndarray:
    """Index operands as NumPy arrays: eager TF converts them 2-4x faster than Python lists
    (measured: a strided slice with list operands 520 us, with int64 arrays 160 us)."""
    return np.array(values, dtype=np.int64)


_ONE = _idx(1)
_FLAT = _idx(-1)


# float dtype -> key dtype: |x| as its bit pattern (docs/selection.md#order)
_KEYS = {tf.float32: tf.int32, tf.float64: tf.int64, tf.float16: tf.int16, tf.bfloat16: tf.int16}
_NP_OF = {tf.float32: np.float32, tf.float64: np.float64, tf.float16: np.float16}  # the host views' dtypes
_CMP = {"ge": tf.greater_equal, "gt": tf.greater, "le": tf.less_equal, "lt": tf.less}


def _on_cpu(t) -> bool:
    return "GPU" not in (getattr(t, "device", "") or "").upper()


def _device_of(like) -> str | None:
    dev = getattr(like, "device", None)
    return dev or None


class TFOps(ClipToNorm, QuantKernels):
    """TensorOps over 1-D TF tensors (fusion buffers: :class:`PackBuffer`)."""

    name = "tensorflow"
    slices_are_views = False  # slice() returns a new tensor: nothing written into it reaches the buffer

    # -- description -------------------------------------------------------------------------
    def numel(self, t):
        if isinstance(t, PackBuffer):
            return t.n
        return int(np.prod(t.shape.as_list(), dtype=np.int64)) if t.shape.rank else 1

    def dtype_name(self, t): return tf.as_dtype(t.dtype).name
    def shape(self, t): return tuple(int(d) for d in t.shape)

    def device_name(self, t):
        dev = _device_of(t) or "/device:CPU:0"
        spec = tf.DeviceSpec.from_string(dev)
        kind = (spec.device_type or "CPU").lower()
        return "cpu" if kind == "cpu" else f"{kind}:{spec.device_index or 0}"

    def on_device(self, t):
        return self.device_name(t) != "cpu"

    # -- creation and layout -----------------------------------------------------------------
    def empty(self, n, dtype, like=None):
        """A lazy fusion buffer (:class:`PackBuffer`): see the module docstring."""
        return PackBuffer(int(n), TF_DTYPES[dtype], _device_of(like))

    def zeros(self, n, dtype, like=None):
        with tf.device(_device_of(like)):
            return tf.zeros([int(n)], dtype=TF_DTYPES[dtype])

    def flatten(self, t): return tf.reshape(_t(t), _FLAT)
    def reshape(self, t, shape: Sequence[int]): return tf.reshape(_t(t), np.array([int(d) for d in shape], dtype=np.int64))

    def slice(self, t, start, stop):
        t = _t(t)
        if isinstance(t, tf.Variable):
            t = t.read_value()
        return tf.raw_ops.StridedSlice(input=t, begin=_idx(int(start)), end=_idx(int(stop)), strides=_ONE)

    def cat(self, ts): return tf.concat([tf.reshape(_t(x), _FLAT) for x in ts], axis=0)

    def copy_into(self, dst, offset, src):
        src = tf.reshape(_t(src), _FLAT)
        n = int(src.shape[0])
        offset = int(offset)
        if isinstance(dst, PackBuffer):  # record only; one concat when the bucket is used
            if src.dtype != dst.dtype:
                src = tf.cast(src, dst.dtype)
            if dst._value is not None:  # a used buffer (e.g. from the engine's pool): new parts
                return PackBuffer(dst.n, dst.dtype, dst.device, [(offset, src)], base=dst._value)
            dst.parts.append((offset, src))
            return dst
        if isinstance(dst, tf.Variable):
            tf.raw_ops.ResourceStridedSliceAssign(ref=dst.handle, begin=_idx(offset), end=_idx(offset + n),
                                                  strides=_ONE, value=tf.cast(src, dst.dtype))
            return dst
        return tf.concat([dst[:offset], tf.cast(src, dst.dtype), dst[offset + n:]], axis=0)

    def clone(self, t): return tf.identity(tf.convert_to_tensor(_t(t)))

    def exclusive(self, t):
        return True  # tensors are immutable (copy_into builds a new one): a reuse writes nothing shared

    def zero_(self, t):
        if isinstance(t, PackBuffer):  # no need to assemble the parts for zeros
            with tf.device(t.device):
                return tf.zeros([t.n], t.dtype)
        return tf.zeros_like(tf.convert_to_tensor(_t(t)))
    def cast(self, t, dtype): return tf.cast(_t(t), TF_DTYPES[dtype])

    # tf.bitcast to a narrower dtype adds a last axis ([n] float32 -> [n, 4] uint8) and from a
    # wider one needs it: the byte view is flattened, and reshaped to [n, width] on the way back
    def as_bytes(self, t):
        return tf.reshape(tf.bitcast(tf.reshape(_t(t), _FLAT), tf.uint8), _FLAT)

    def from_bytes(self, b, dtype):
        dt = TF_DTYPES[dtype]
        b = tf.reshape(_t(b), _FLAT)
        if dt.size == 1:
            return tf.bitcast(b, dt)
        return tf.bitcast(tf.reshape(b, [-1, dt.size]), dt)

    # -- arithmetic --------------------------------------------------------------------------
    def scale(self, t, factor):
        t = tf.convert_to_tensor(_t(t))
        return t * tf.constant(factor, dtype=t.dtype)

    def scale_into(self, dst, t, factor): return self.scale(t, factor)  # immutable tensors: a new one

    def add(self, a, b): return tf.convert_to_tensor(_t(a)) + _t(b)
    def scale_add_into(self, dst, t, factor, g): return self.add(self.scale(t, factor), g)
    def sub(self, a, b): return tf.convert_to_tensor(_t(a)) - _t(b)
    def mul(self, a, b): return tf.convert_to_tensor(_t(a)) * _t(b)

    def trunc_divide(self, t, d):
        t = tf.convert_to_tensor(_t(t))
        return tf.truncatediv(t, tf.constant(int(d), dtype=t.dtype))

    def cast_into(self, dst, src): return self.copy_(dst, src)  # copy_ casts to dst's dtype

    def copy_(self, dst, src):
        """Assign into a ``tf.Variable`` destination; otherwise a new tensor shaped like dst."""
        src = _t(src)
        if isinstance(dst, tf.Variable):
            dst.assign(tf.reshape(tf.cast(src, dst.dtype), dst.shape))
            return dst
        dst = _t(dst)
        return tf.identity(tf.reshape(tf.cast(src, dst.dtype), tf.shape(dst)))

    def axpy_(self, y, alpha, x):
        # y + (alpha*x): with alpha = -lr this is bit-identical to Keras SGD's
        # ``variable.assign_sub(lr * g)`` (negation is exact).
        y, x = tf.convert_to_tensor(_t(y)), _t(x)
        return y + tf.constant(alpha, dtype=y.dtype) * x

    def axpy_into(self, dst, y, alpha, x): return self.axpy_(y, alpha, x)  # immutable: a new tensor

    def ternary(self, t, theta, dtype):
        t = tf.convert_to_tensor(_t(t))
        wire = TF_DTYPES[dtype]
        th = tf.constant(theta, dtype=t.dtype)
        return tf.cast(t >= th, wire) - tf.cast(t <= -th, wire)

    # -- sparse ------------------------------------------------------------------------------
    def topk_abs(self, t, k):
        """k largest |t|, ties towards the lower index, indices ascending (canonical form).

        ``tf.math.top_k`` documents that of two equal values the lower-index one comes first, so
        with ``sorted=True`` its first k entries already break ties towards the lower index,
        exactly as NumpyOps and TorchOps do; sorting the indices gives the canonical order.
        """
        t = tf.convert_to_tensor(_t(t))
        n = self.numel(t)
        k = min(int(k), n)
        if k == n:
            idx = tf.range(n, dtype=tf.int64)
            return t, idx
        _, idx = tf.math.top_k(tf.abs(t), k=k, sorted=True)
        idx = tf.sort(tf.cast(idx, tf.int64))
        return tf.gather(t, idx), idx

    def gather(self, t, idx): return tf.gather(_t(t), _t(idx))

    def scatter_add(self, dst, idx, vals):
        return tf.tensor_scatter_nd_add(tf.convert_to_tensor(_t(dst)), tf.reshape(tf.cast(_t(idx), tf.int64), [-1, 1]),
                                        _t(vals))

    def index_fill(self, t, idx, value):
        t = tf.convert_to_tensor(_t(t))
        idx = tf.reshape(tf.cast(idx, tf.int64), [-1, 1])
        return tf.tensor_scatter_nd_update(t, idx, tf.fill([tf.shape(idx)[0]], tf.constant(value, t.dtype)))

    def index_copy(self, t, idx, vals):
        idx = tf.reshape(tf.cast(_t(idx), tf.int64), [-1, 1])
        return tf.tensor_scatter_nd_update(tf.convert_to_tensor(_t(t)), idx, _t(vals))

    def arange(self, n, like=None):
        with tf.device(_device_of(like)):
            return tf.range(int(n), dtype=tf.int64)

    def shift(self, idx, offset):
        return tf.cast(_t(idx), tf.int64) + int(offset)

    # -- sparse merging and selection (gTop-k, DGC) --------------------------------------------
    def unique_sum(self, idx, vals):
        """(sorted unique int64 indices, per-index sums). ``tf.unique`` keeps first-appearance
        order, so the unique indices are sorted and the segment ids remapped to that order."""
        idx, vals = tf.reshape(tf.cast(_t(idx), tf.int64), [-1]), _t(vals)
        u, inv = tf.unique(idx, out_idx=tf.int64)
        order = tf.argsort(u, stable=True)  # unique values: a permutation
        seg = tf.gather(tf.math.invert_permutation(order), inv)
        sums = tf.math.unsorted_segment_sum(vals, seg, num_segments=tf.size(u, out_type=tf.int64))
        return tf.gather(u, order), sums

    def isin(self, elements, test, invert=False):
        elements = tf.reshape(tf.cast(_t(elements), tf.int64), [-1])
        test = tf.sort(tf.reshape(tf.cast(_t(test), tf.int64), [-1]))
        if int(test.shape[0]) == 0:
            found = tf.zeros(tf.shape(elements), dtype=tf.bool)
        else:
            pos = tf.searchsorted(test, elements, side="left")
            pos = tf.minimum(pos, tf.cast(tf.size(test) - 1, pos.dtype))
            found = tf.equal(tf.gather(test, pos), elements)
        return tf.logical_not(found) if invert else found

    def nonzero(self, mask, sparse=False):
        return tf.reshape(tf.where(tf.reshape(_t(mask), [-1])), [-1])  # int64, ascending

    def argsort(self, t, descending=False):
        # tf.argsort's descending order is top_k's (ties to the lower position); stable ascending
        t = tf.reshape(tf.convert_to_tensor(_t(t)), [-1])
        return tf.cast(tf.argsort(t, direction="DESCENDING" if descending else "ASCENDING", stable=True), tf.int64)

    def searchsorted(self, sorted_seq, values):
        return tf.searchsorted(_t(sorted_seq), _t(values), side="left", out_type=tf.int64)

    def equal(self, a, b): return tf.equal(_t(a), _t(b))
    def cumsum(self, t): return tf.cumsum(tf.cast(_t(t), tf.int64))

    def abs_ge(self, t, threshold):
        t = tf.convert_to_tensor(_t(t))
        return tf.abs(t) >= tf.constant(threshold, dtype=t.dtype)

    # -- magnitude keys (docs/selection.md#order) ---------------------------------------------
    def abs_keys(self, t):
        t = tf.convert_to_tensor(_t(t))
        return tf.bitcast(tf.abs(t), _KEYS[t.dtype])

    def abs_key(self, value, like):
        dtype = tf.as_dtype(like.dtype)
        if dtype in _NP_OF:  # host arithmetic: no eager op per call
            return magnitude_key(value, np.dtype(_NP_OF[dtype]))
        return int(tf.bitcast(tf.abs(tf.constant(value, dtype=dtype)), _KEYS[dtype]).numpy())

    def compare(self, t, op, value):
        t = tf.convert_to_tensor(_t(t))
        return _CMP[op](t, tf.constant(value, dtype=t.dtype))

    def kth_smallest(self, t, k):
        key = tf.cast(tf.reshape(tf.convert_to_tensor(_t(t)), _FLAT), tf.int64)
        n, k = int(key.shape[0]), int(k)
        # tf.math.top_k from the nearer side (integer keys: negation is exact)
        if n - k + 1 <= k:
            return int(tf.math.top_k(key, k=n - k + 1, sorted=True).values[n - k])
        return -int(tf.math.top_k(-key, k=k, sorted=True).values[k - 1])

    def all_finite(self, t):
        t = tf.convert_to_tensor(_t(t))
        if not t.dtype.is_floating:
            return True
        # one summing pass; the exact element check only when the sum is not finite
        return bool(tf.math.is_finite(tf.reduce_sum(t))) or bool(tf.reduce_all(tf.math.is_finite(t)))

    # -- the device route (docs/selection.md#device-route): TF may synchronise (not its target)
    def topk_abs_index(self, t, k):
        t = tf.convert_to_tensor(_t(t))
        idx = topk_index_np(self.to_numpy(tf.reshape(t, _FLAT)), k)
        with tf.device(_device_of(t)):
            return tf.convert_to_tensor(idx)

    def threshold_reuse(self, t, k, lo_c, hi_c, tau, prev): return None  # no native kernel: the portable one
    def add_topk_abs_index(self, t, addend, out, k): return None  # no fused kernel: add, then select
    def add_threshold_reuse(self, t, addend, out, k, lo_c, hi_c, tau, prev): return None
    def topk_abs_ranked(self, t, k):
        t = tf.convert_to_tensor(_t(t))
        idx, keys = topk_ranked_np(self.to_numpy(tf.reshape(t, _FLAT)), k)
        with tf.device(_device_of(t)):
            return tf.convert_to_tensor(idx), tf.convert_to_tensor(keys)

    def count_true(self, mask):
        return tf.reshape(tf.reduce_sum(tf.cast(tf.reshape(mask, _FLAT), tf.int64)), [1])

    def sort(self, t):
        return tf.sort(tf.convert_to_tensor(_t(t)))

    def finite_flag(self, t, how="all"):
        fin = tf.math.is_finite(tf.convert_to_tensor(_t(t)))
        return tf.reduce_all(fin) if how == "all" else tf.reduce_any(fin)

    def where(self, flag, a, b):
        a = tf.convert_to_tensor(_t(a))
        return tf.where(_t(flag), a, tf.cast(b, a.dtype) if isinstance(b, (int, float)) else _t(b))

    def read_flags(self, flags):
        return tuple(bool(f) for f in flags)

    def norm(self, t):
        t = tf.convert_to_tensor(_t(t))
        acc = tf.float64 if t.dtype == tf.float64 else tf.float32
        x = tf.cast(t, acc)
        return float(tf.sqrt(tf.reduce_sum(tf.square(x))))

    def host_view(self, t):
        """A NumPy array with a CPU float tensor's values (``EagerTensor.numpy()``: no copy where TF
        shares the buffer; read only, the tensors being immutable), else None."""
        t = _t(t)
        if not (_on_cpu(t) and t.dtype in _NP_OF):
            return None
        return tf.reshape(tf.convert_to_tensor(t), _FLAT).numpy()

    # -- host exchange -----------------------------------------------------------------------
    def to_numpy(self, t):
        """A writable host copy (TF's ``.numpy()`` of an eager tensor owns its data). bfloat16
        travels as uint16 bit patterns, the host convention of the core (NumPy has no bf16)."""
        t = tf.convert_to_tensor(_t(t))
        if t.dtype == tf.bfloat16:
            return tf.bitcast(t, tf.uint16).numpy()
        return t.numpy()

    def from_numpy(self, a, like=None):
        a = np.asarray(a)
        with tf.device(_device_of(like)):
            if a.dtype == np.uint16 and like is not None and like.dtype == tf.bfloat16:
                return tf.bitcast(tf.convert_to_tensor(a), tf.bfloat16)
            return tf.convert_to_tensor(a)
