"""TensorOps with native PyTorch ops (see hvd_commopt.tensor_ops for the contract)."""
from __future__ import annotations

from typing import Sequence

import math

import numpy as np
import torch

from hvd_commopt import host_memory

from ._compat import storage_exclusive
from .host_arrays import flat_np, host_ok, index_host
from .cast_ops import CastKernels
from .device_route_ops import _KEYS, DeviceRouteKernels, _flat
from .quant_ops import QuantKernels

__all__ = ["TorchOps", "TORCH_DTYPES"]

TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool, "uint16": torch.uint16,
}
_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

# Below this many bytes a copy or fill stays ATen's (a Python call costs more than it saves);
# above it the host kernel streams the stores (docs/selection.md#streaming-stores).
_STREAM_MIN_BYTES = 1 << 20
_HOST_VIEW = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32)
_SCALE_ADD = (torch.float32, torch.float64)  # scale_add_into's one host pass (float16: ATen's)
# Up to this many elements all_finite is one element pass and one host decision (the sum-first
# check pays only on long CPU tensors)
_ONE_PASS_FINITE = 1 << 14
_CMP = {"ge": torch.ge, "gt": torch.gt, "le": torch.le, "lt": torch.lt}


def _word_nonzero(m):
    """nonzero of a sparse 1-D bool mask through its int64 words (8 flags each): only words with
    a set flag are expanded, and (word, byte) row-major order is ascending flat order."""
    n = m.numel()
    n8 = n - n % 8
    head = m[:n8]
    wi = torch.nonzero(head.view(torch.int64)).view(-1)
    rc = torch.nonzero(head.view(-1, 8).index_select(0, wi))
    idx = wi.index_select(0, rc[:, 0]).mul_(8).add_(rc[:, 1])
    if n8 < n:
        idx = torch.cat([idx, torch.nonzero(m[n8:]).view(-1).add_(n8)])
    return idx


class TorchOps(QuantKernels, CastKernels, DeviceRouteKernels):
    """In place where PyTorch allows; every method returns its result.

    ``host_view`` gives the selection's host kernels (:mod:`hvd_commopt.select.host`) the memory
    of contiguous CPU tensors (ATen's CPU ``nonzero`` and comparisons cost 3-5 passes;
    docs/selection.md#primitives); the magnitude-key primitives (``abs_keys``, ``compare``,
    ``nonzero``, ``kth_smallest``) serve the portable kernels on every other tensor. Large copies,
    fills and scattered index work on host memory run in :mod:`hvd_commopt.host_memory`.
    """

    name = "torch"
    slices_are_views = True  # slice() shares memory, so writes into a slice land in the buffer

    def numel(self, t): return int(t.numel())
    def dtype_name(self, t): return _NAMES[t.dtype]
    def shape(self, t): return tuple(t.shape)
    def device_name(self, t): return str(t.device)
    def on_device(self, t): return not t.is_cpu

    @staticmethod
    def _device(like):
        return like.device if isinstance(like, torch.Tensor) else torch.device("cpu")

    def empty(self, n, dtype, like=None):
        return torch.empty(int(n), dtype=TORCH_DTYPES[dtype], device=self._device(like))

    def zeros(self, n, dtype, like=None):
        return torch.zeros(int(n), dtype=TORCH_DTYPES[dtype], device=self._device(like))

    def flatten(self, t): return t.reshape(-1)
    def reshape(self, t, shape: Sequence[int]): return t.view(tuple(shape))
    def slice(self, t, start, stop): return t[start:stop]
    def cat(self, ts): return torch.cat([_flat(x) for x in ts])

    def copy_into(self, dst, offset, src):
        # once per gradient per step (the engine's packing): a narrow view and no no_grad()
        # context unless autograd could record the copy (~2 us less per tensor)
        if src.requires_grad or dst.requires_grad:
            with torch.no_grad():
                dst[offset:offset + src.numel()].copy_(src.reshape(-1))
            return dst
        part = dst.narrow(0, offset, src.numel())
        flat = _flat(src)
        if (part.numel() * part.element_size() >= _STREAM_MIN_BYTES and src.dtype == dst.dtype and host_ok(dst)
                and src.is_contiguous() and src.is_cpu and host_memory.stream_store(part.numpy(), flat.numpy())):
            return dst
        part.copy_(flat)
        return dst

    def clone(self, t): return t.detach().clone()

    def exclusive(self, t):
        return storage_exclusive(t)  # no other tensor on t's storage (docs/wrapper.md#grad-views)

    def zero_(self, t):
        if (not t.requires_grad and t.is_cpu and t.is_contiguous()
                and t.numel() * t.element_size() >= _STREAM_MIN_BYTES
                and host_memory.stream_store(t.view(-1).view(torch.uint8).numpy())):
            return t
        with torch.no_grad():
            return t.zero_()

    def cast(self, t, dtype):
        return t.to(TORCH_DTYPES[dtype])

    def as_bytes(self, t):  # a flat contiguous tensor as it is: its bytes are a view (one op, not four)
        if t.dim() == 1 and not t.requires_grad and t.is_contiguous():
            return t.view(torch.uint8)
        return t.detach().reshape(-1).contiguous().view(torch.uint8)

    def from_bytes(self, b, dtype):
        b = _flat(b).contiguous()
        dt = TORCH_DTYPES[dtype]
        if (b.storage_offset() * b.element_size()) % dt.itemsize:  # view(dtype) wants an aligned start
            b = b.clone()
        return b.view(dt)

    def scale(self, t, factor):
        return t.mul_(factor)

    def scale_into(self, dst, t, factor):
        if t.requires_grad or dst.requires_grad:
            with torch.no_grad():
                return torch.mul(t, factor, out=dst)
        return torch.mul(t, factor, out=dst)

    def add(self, a, b): return a.add_(b)

    def scale_add_into(self, dst, t, factor, g):
        if t.dtype in _SCALE_ADD and g.dtype == t.dtype and dst.dtype == t.dtype:
            d, x, y = self.host_view(dst), self.host_view(t), self.host_view(g)
            if d is not None and x is not None and y is not None:
                host_memory.scale_add(d, x, factor, y)
                return dst
        return self.add(self.scale_into(dst, t, factor), g)

    def sub(self, a, b): return a.sub_(b)

    def trunc_divide(self, t, d):
        return t.div_(int(d), rounding_mode="trunc")

    def mul(self, a, b):
        with torch.no_grad():
            return a * b

    # copy_, axpy_, scale_into: called per tensor by the delayed schedules' local update (~5 per
    # tensor per step); like copy_into, no no_grad() context unless autograd could record the op
    def copy_(self, dst, src):
        if dst.requires_grad or src.requires_grad:
            with torch.no_grad():
                return dst.copy_(src)
        return dst.copy_(src)

    def axpy_(self, y, alpha, x):  # torch.optim.SGD's own kernel (bit-exact local updates)
        if y.requires_grad or x.requires_grad:
            with torch.no_grad():
                return y.add_(x, alpha=alpha)
        return y.add_(x, alpha=alpha)

    def axpy_into(self, dst, y, alpha, x):  # the same add kernel as axpy_, reading y instead of dst
        if dst.requires_grad or y.requires_grad or x.requires_grad:
            with torch.no_grad():
                return torch.add(y, x, alpha=alpha, out=dst)
        return torch.add(y, x, alpha=alpha, out=dst)

    def ternary(self, t, theta, dtype):
        with torch.no_grad():
            wire = TORCH_DTYPES[dtype]
            return (t >= theta).to(wire) - (t <= -theta).to(wire)

    def topk_abs(self, t, k):
        """k largest |t|, ties towards the lower index, indices ascending (canonical form).

        ``torch.topk`` does not specify which of equal values it returns, and ranks must agree
        (gTop-k depends on it), so the boundary value's ties are resolved explicitly.
        """
        a = t.abs()
        n = a.numel()
        k = min(int(k), n)
        if k == n:
            idx = torch.arange(n, device=t.device)
            return t[idx], idx
        vals, idx = torch.topk(a, k, sorted=False)
        # torch.topk ranks NaN above every number: the boundary is the least non-NaN selected value
        nan = vals.isnan()
        thr = vals.masked_fill(nan, math.inf).min()
        # Usually every element equal to the boundary value is already selected (one counting
        # pass proves it); only then is torch's choice among equal values irrelevant. Otherwise
        # resolve the boundary ties explicitly towards the lower index.
        if int((a == thr).sum()) != int((vals == thr).sum()):
            above = idx[(vals > thr) | nan]
            ties = torch.nonzero(a == thr).reshape(-1)[: k - above.numel()]
            idx = torch.cat([above, ties])
        idx = torch.sort(idx).values
        return t[idx], idx

    def gather(self, t, idx):  # index_select: same values as t[idx], 5-8x cheaper on CPU
        if index_host(t, idx):
            got = host_memory.take(t.reshape(-1).numpy(), idx.reshape(-1).numpy())  # allocates only when it runs
            if got is not None:
                return torch.from_numpy(got)
        return t.reshape(-1).index_select(0, idx.reshape(-1))

    def scatter_add(self, dst, idx, vals):
        if (index_host(dst, idx) and vals.dtype == dst.dtype and vals.is_cpu
                and not vals.requires_grad and vals.is_contiguous()
                and host_memory.scatter_add(dst.view(-1).numpy(), idx.view(-1).numpy(), vals.view(-1).numpy())):
            return dst
        return dst.index_add_(0, idx, vals)

    def index_fill(self, t, idx, value):
        if (value == 0 and math.copysign(1.0, value) > 0 and index_host(t, idx)
                and host_memory.zero_at(t.view(-1).numpy(), idx.view(-1).numpy())):
            return t
        return t.index_fill_(0, idx, value)

    def index_copy(self, t, idx, vals):
        return t.index_copy_(0, idx, vals)

    def arange(self, n, like=None):
        return torch.arange(int(n), dtype=torch.int64, device=self._device(like))

    def shift(self, idx, offset):
        return idx + int(offset)  # a new tensor: a selection may hand out a cached arange

    def unique_sum(self, idx, vals):
        u, inv = torch.unique(idx.to(torch.int64), sorted=True, return_inverse=True)
        out = torch.zeros(u.numel(), dtype=vals.dtype, device=vals.device)
        return u, out.index_add_(0, inv.reshape(-1), vals)

    def isin(self, elements, test, invert=False): return torch.isin(elements, test, invert=invert)

    def nonzero(self, mask, sparse=False):
        if sparse and mask.numel() >= 64:
            return _word_nonzero(mask.reshape(-1))
        return torch.nonzero(mask).reshape(-1)

    def abs_ge(self, t, threshold): return t.abs() >= threshold

    # fixed-capacity merging: shapes never depend on the data, no host synchronisation
    def argsort(self, t, descending=False):
        return torch.sort(t.reshape(-1), stable=True, descending=bool(descending)).indices

    def searchsorted(self, sorted_seq, values):
        return torch.searchsorted(sorted_seq, values, side="left")

    def equal(self, a, b): return torch.eq(a, b)
    def cumsum(self, t): return torch.cumsum(t, 0, dtype=torch.int64)

    # -- magnitude keys (docs/selection.md#order) ---------------------------------------------
    def abs_keys(self, t):
        with torch.no_grad():
            return t.abs().view(_KEYS[t.dtype])

    def abs_key(self, value, like):
        return int(torch.tensor(value, dtype=like.dtype).abs().view(_KEYS[like.dtype]))

    def compare(self, t, op, value):
        return _CMP[op](t, value)

    def kth_smallest(self, t, k):
        return int(torch.kthvalue(t.reshape(-1), int(k)).values)

    def count_true(self, mask):
        return torch.sum(mask.reshape(-1), dtype=torch.int64).reshape(1)

    def sort(self, t):
        return torch.sort(t).values

    def finite_flag(self, t, how="all"):
        fin = torch.isfinite(t.detach())
        return fin.all() if how == "all" else fin.any()

    def where(self, flag, a, b):
        return torch.where(flag, a, b)

    def read_flags(self, flags):
        """One ``_local_scalar_dense`` for all the flags: their bits packed into one integer."""
        if not flags:
            return ()
        bits = torch.stack([f.reshape(()).to(torch.int64) for f in flags])
        weights = torch.tensor([1 << i for i in range(len(flags))], dtype=torch.int64, device=bits.device)
        word = int(torch.sum(bits * weights))
        return tuple(bool(word >> i & 1) for i in range(len(flags)))

    def all_finite(self, t):
        # One summing pass (~25x faster than isfinite().all() on the CPU): any NaN/Inf makes the sum
        # non-finite; only then (or on an overflow of finite values) the exact element check runs.
        # A device tensor, or a small one (a sparse result's k·P sums), gets one decision: the
        # element check alone (one host synchronisation per NaN/Inf decision on the device route).
        if not t.is_floating_point():
            return True
        if not t.is_cpu or t.numel() <= _ONE_PASS_FINITE:
            return bool(torch.isfinite(t).all())
        return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())

    def norm(self, t):
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        return float(torch.linalg.vector_norm(t, dtype=acc))

    def clip_to_norm_(self, t, max_norm, eps):
        """``mul_`` by a Python float multiplies in the op-math type (float64 for float64, else
        float32) with the factor rounded to it: the same here with the factor a device tensor."""
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        denom = torch.linalg.vector_norm(t, dtype=acc).to(torch.float64) + eps
        coef = denom.new_full((), max_norm).div_(denom)  # a true division (scalar / tensor multiplies by 1/x)
        factor = torch.where(coef < 1, coef, 1.0).to(acc)
        if t.dtype == acc:
            return t.mul_(factor)
        return t.copy_(t.to(acc).mul_(factor))

    def host_view(self, t):
        """``t``'s memory as a flat NumPy array (zero-copy; detached from autograd) where ``t`` is a
        contiguous CPU tensor of a dtype NumPy has (float16/32/64, int32/64), else None."""
        if not (t.is_cpu and t.dtype in _HOST_VIEW and t.is_contiguous()):  # is_cpu: no device object made
            return None
        return flat_np(t)

    def to_numpy(self, t):
        t = t.detach() if t.requires_grad else t
        if not t.is_cpu:
            t = t.cpu()
        if t.dtype == torch.bfloat16:  # NumPy has no bf16: carry the bit patterns as uint16
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def from_numpy(self, a, like=None):
        if a.dtype == np.uint16 and isinstance(like, torch.Tensor) and like.dtype == torch.bfloat16:
            t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a)
        dev = self._device(like)
        return t if dev.type == "cpu" else t.to(dev, non_blocking=False)
