"""TorchOps' device route of the selection (docs/selection.md#device-route): top-k with no host
synchronisation, through the Triton select on large float32 CUDA tensors and torch ops elsewhere.
A mixin, so that torch_plugin/ops.py stays under 400 lines.
"""
from __future__ import annotations

import torch

from . import triton_select

__all__ = ["DeviceRouteKernels", "TRITON_SELECT"]

# float dtype -> key dtype: |x| as its bit pattern (docs/selection.md#order)
_KEYS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}
# float dtype -> (magnitude mask of its key, key of +Inf)
_MAG_INF = {torch.float32: (0x7FFFFFFF, 0x7F800000), torch.float64: (0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
            torch.float16: (0x7FFF, 0x7C00), torch.bfloat16: (0x7FFF, 0x7F80)}


def _flat(t):
    """``t.reshape(-1)`` without the call when t is flat already (several per bucket and step)."""
    return t if t.dim() == 1 else t.reshape(-1)


#: the Triton select on CUDA where it imports; tests and benchmarks switch it off to compare
TRITON_SELECT = triton_select.AVAILABLE


def _triton_takes(t, k: int) -> bool:
    """Whether the Triton select runs ``t``'s top-k: a large float32 CUDA tensor, Triton imported
    (docs/selection.md#triton-select); else the torch-op route, its tested fallback."""
    return (TRITON_SELECT and t.is_cuda and t.dtype == torch.float32
            and triton_select.MIN_N <= t.numel() < 1 << 31 and 0 < k < t.numel())


class DeviceRouteKernels:
    """``topk_abs_ranked``, ``topk_abs_index``, ``threshold_reuse`` and the fused add-and-select of
    :class:`hvd_commopt.tensor_ops.TensorOps` (``None`` where no native kernel takes the tensor:
    the core then runs its portable route)."""

    def topk_abs_ranked(self, t, k):
        """A composite int64 key ``(magnitude_key << 32) | (0xFFFFFFFF - i)`` makes every key
        distinct, so ``topk`` picks exactly the lower-index ties, on any device and in any order;
        float64 keys take 63 bits, so a stable descending sort there (and past 2^32 elements)."""
        t = _flat(t)
        n, k = t.numel(), int(k)
        if _triton_takes(t, k):  # the same ranking in two reads (docs/selection.md#triton-select)
            return triton_select.topk_abs_ranked(t.detach(), k)
        with torch.no_grad():
            kd = _KEYS[t.dtype]
            mask, inf = _MAG_INF[t.dtype]
            keys = torch.clamp(torch.bitwise_and(t.view(kd), mask), max=inf + 1).to(torch.int64)  # NaN: one key
            if kd is torch.int64 or n >= 1 << 32:
                top = torch.sort(keys, descending=True, stable=True).indices[:k]
                return top, keys.index_select(0, top)
            low = torch.arange(0xFFFFFFFF, 0xFFFFFFFF - n, -1, dtype=torch.int64, device=t.device)
            comp = torch.topk(torch.bitwise_or(torch.bitwise_left_shift(keys, 32), low), k).values
            return torch.rsub(torch.bitwise_and(comp, 0xFFFFFFFF), 0xFFFFFFFF), torch.bitwise_right_shift(comp, 32)

    def threshold_reuse(self, t, k, lo_c, hi_c, tau, prev):
        if prev is not None and _triton_takes(_flat(t), k):  # one read (docs/selection.md#triton-reuse)
            return triton_select.threshold_reuse(_flat(t).detach(), k, lo_c, hi_c, tau, prev)
        return None  # the torch-op route: select/device.py reuse_candidates

    def add_topk_abs_index(self, t, addend, out, k):  # docs/selection.md#triton-fused-ef
        fits = _triton_takes(t, int(k)) and triton_select.adds(t, addend, out)
        return triton_select.add_topk_abs_index(t, addend, out, int(k)) if fits else None

    def add_threshold_reuse(self, t, addend, out, k, lo_c, hi_c, tau, prev):
        fits = _triton_takes(t, int(k)) and triton_select.adds(t, addend, out)
        return triton_select.add_threshold_reuse(t, addend, out, k, lo_c, hi_c, tau, prev) if fits else None

    def topk_abs_index(self, t, k):
        t = _flat(t)
        if int(k) >= t.numel():
            return torch.arange(t.numel(), dtype=torch.int64, device=t.device)
        if _triton_takes(t, int(k)):
            return triton_select.topk_abs_index(t.detach(), int(k))
        return torch.sort(self.topk_abs_ranked(t, k)[0]).values

