"""TensorOps with native PyTorch ops (see hvd_commopt.tensor_ops for the contract)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["TorchOps", "TORCH_DTYPES"]

TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool, "uint16": torch.uint16,
}
_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


class TorchOps:
    """In place where PyTorch allows; every method returns its result."""

    name = "torch"

    def numel(self, t): return int(t.numel())
    def dtype_name(self, t): return _NAMES[t.dtype]
    def shape(self, t): return tuple(t.shape)
    def device_name(self, t): return str(t.device)

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
    def cat(self, ts): return torch.cat([x.reshape(-1) for x in ts])

    def copy_into(self, dst, offset, src):
        with torch.no_grad():
            dst[offset:offset + src.numel()].copy_(src.reshape(-1))
        return dst

    def clone(self, t): return t.detach().clone()

    def cast(self, t, dtype):
        return t.to(TORCH_DTYPES[dtype])

    def scale(self, t, factor):
        return t.mul_(factor)

    def add(self, a, b): return a.add_(b)
    def sub(self, a, b): return a.sub_(b)

    def trunc_divide(self, t, d):
        return t.div_(int(d), rounding_mode="trunc")

    def mul(self, a, b):
        with torch.no_grad():
            return a * b

    def copy_(self, dst, src):
        with torch.no_grad():
            return dst.copy_(src)

    def axpy_(self, y, alpha, x):  # torch.optim.SGD's own kernel (bit-exact local updates)
        with torch.no_grad():
            return y.add_(x, alpha=alpha)

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
        thr = vals.min()
        # Usually every element equal to the boundary value is already selected (one counting
        # pass proves it); only then is torch's choice among equal values irrelevant. Otherwise
        # resolve the boundary ties explicitly towards the lower index.
        if int((a == thr).sum()) != int((vals == thr).sum()):
            above = idx[vals > thr]
            ties = torch.nonzero(a == thr).reshape(-1)[: k - above.numel()]
            idx = torch.cat([above, ties])
        idx = torch.sort(idx).values
        return t[idx], idx

    def gather(self, t, idx): return t[idx]

    def scatter_add(self, dst, idx, vals):
        return dst.index_add_(0, idx, vals)

    def index_fill(self, t, idx, value):
        return t.index_fill_(0, idx, value)

    def arange(self, n, like=None):
        return torch.arange(int(n), dtype=torch.int64, device=self._device(like))

    def unique_sum(self, idx, vals):
        u, inv = torch.unique(idx.to(torch.int64), sorted=True, return_inverse=True)
        out = torch.zeros(u.numel(), dtype=vals.dtype, device=vals.device)
        return u, out.index_add_(0, inv.reshape(-1), vals)

    def isin(self, elements, test, invert=False): return torch.isin(elements, test, invert=invert)
    def nonzero(self, mask): return torch.nonzero(mask).reshape(-1)
    def abs_ge(self, t, threshold): return t.abs() >= threshold

    def all_finite(self, t):
        # One summing pass (~25x faster than isfinite().all() on the CPU): any NaN/Inf makes the sum
        # non-finite; only then (or on an overflow of finite values) the exact element check runs.
        if not t.is_floating_point():
            return True
        return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())

    def norm(self, t):
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        return float(torch.linalg.vector_norm(t, dtype=acc))

    def to_numpy(self, t):
        t = t.detach()
        if t.device.type != "cpu":
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
