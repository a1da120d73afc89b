"""TorchOps' cast into an existing buffer (``cast_into`` of :class:`hvd_commopt.tensor_ops.TensorOps`).
A mixin, so that torch_plugin/ops.py stays under 400 lines.

Why: a 16-bit round's result cast back to float32 in a new tensor costs the page faults of a fresh
buffer every step; on a 6.1M-element bucket ``to(float32)`` took 16.8 ms where ``copy_`` into the
round's fusion buffer took 3.0 ms (2026-11-27, one thread; docs/auto-compression.md#dense-path).
"""
from __future__ import annotations

import torch

__all__ = ["CastKernels"]


class CastKernels:
    """``cast_into(dst, src)``: ``dst.copy_(src)``, which converts to dst's dtype in the one pass."""

    def cast_into(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        if dst.requires_grad or src.requires_grad:
            with torch.no_grad():
                return dst.copy_(src)
        return dst.copy_(src)
