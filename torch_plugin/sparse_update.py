"""Plain SGD applied at the reduced gradient's support only (docs/wrapper.md#sparse-update).

After a sparse exchange (Top-k, DGC, gTop-k, Ok-Topk, ...) a bucket's reduced gradient is +0
everywhere but at the k·P exchanged positions. ``torch.optim.SGD`` without momentum and weight
decay computes ``p + (-lr)·g`` for every element, reading and writing the whole model each step;
at a +0 gradient that is ``p + (-0) = p``, so only the support changes. :class:`SparseSGD` applies
exactly those changes, with the native ``sparse_axpy``, and the dense rule to every other
parameter (the 1-D tensors sent whole, parameters outside the engine).

Choices:

* **Only where it is the same step, bit for bit.** The wrapped optimizer must be exactly
  ``torch.optim.SGD`` (a subclass may change ``step``), every group after the schedule's
  hyper-parameter override (momentum correction runs SGD without momentum) must have momentum 0,
  weight decay 0, ``maximize``, ``differentiable`` and ``fused`` off and one float learning rate
  shared by all groups, no step hooks may be registered (they would not run), and no closure is
  given. Anything else takes the wrapped ``step()``, unchanged.
* **The same roundings.** ATen's ``add_(g, alpha=a)`` computes ``fma(g, a, p)`` on this build
  (its vector kernel fuses the multiply-add); ``sparse_axpy`` does the same. This is checked once
  per dtype at run time, on sizes that exercise ATen's vector body and its tail; if the check
  fails, the dense step is used.
* **The gradients stay visible.** ``p.grad`` still holds the reduced gradient (the engine's
  views), as after the dense step; only the weight update is sparse.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hvd_commopt.host_memory import native_on, sparse_axpy

from ._compat import step_hooks_registered
from .host_arrays import flat_np

__all__ = ["SparseSGD", "ENABLED"]

#: apply the sparse step wherever it is the dense one bit for bit; tests and benchmarks set False
#: to run the wrapped optimizer's own step and compare (docs/wrapper.md#sparse-update)
ENABLED = True

_DTYPES = (torch.float32, torch.float64)
# the hyper-parameters of torch.optim.SGD that must be off (or 0) for the sparse step
_OFF = ("momentum", "weight_decay", "maximize", "differentiable", "fused")


def _same_as_aten(dtype: torch.dtype) -> bool:
    """Whether ``sparse_axpy`` gives ATen's ``add_(alpha=)`` bits (vector body and tail sizes)."""
    gen = torch.Generator().manual_seed(1234)
    for n in (1, 7, 33, 4099):
        p = torch.randn(n, generator=gen, dtype=dtype) * 3
        g = torch.randn(n, generator=gen, dtype=dtype) * 1e-2
        want = p.clone().add_(g, alpha=-0.0123)
        got = p.clone()
        idx = np.arange(n, dtype=np.int64)
        if not sparse_axpy(idx, g.numpy(), -0.0123, np.array([0, n], np.int64), [got.numpy()]):
            return False
        bits = torch.int32 if dtype == torch.float32 else torch.int64
        if not torch.equal(want.view(bits), got.view(bits)):
            return False
    return True


class SparseSGD:
    """The sparse step for one wrapped optimizer (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor]):
        self.opt = optimizer
        self.params = params
        self._verified: dict[torch.dtype, bool] = {}

    def lr(self, hyper: Any) -> float | None:
        """The learning rate when the sparse step applies to the optimizer as configured, else None."""
        opt = self.opt
        if not ENABLED or getattr(opt, "_hco_base", None) is not torch.optim.SGD:
            return None
        if step_hooks_registered(opt):
            return None
        lr = None
        for i, group in enumerate(opt.param_groups):
            over = hyper[i] if hyper is not None else {}
            if any(over.get(k, group.get(k)) for k in _OFF):
                return None
            g_lr = over.get("lr", group.get("lr"))
            if isinstance(g_lr, bool) or not isinstance(g_lr, (int, float)) or (lr is not None and g_lr != lr):
                return None
            lr = float(g_lr)
        return lr

    def _verified_for(self, dtype: torch.dtype) -> bool:
        """The native update runs (the extension is there and on) and matches ATen for ``dtype``
        (checked once per dtype)."""
        if not native_on():  # turned off (benchmarks' NumPy A/Bs) or not built: never cached
            return False
        ok = self._verified.get(dtype)
        if ok is None:
            ok = self._verified[dtype] = dtype in _DTYPES and _same_as_aten(dtype)
        return ok

    def _members(self, bucket: Any, idx: Any, vals: Any, stepped: set[int]) -> list[np.ndarray] | None:
        """The bucket's parameters as flat NumPy views, when the native update can write them and
        the optimizer steps every one of them (``stepped``: ids of its parameters)."""
        if not (isinstance(idx, torch.Tensor) and isinstance(vals, torch.Tensor) and idx.is_cpu
                and vals.is_cpu and idx.dtype == torch.int64 and self._verified_for(vals.dtype)):
            return None
        out = []
        for name in bucket.names:
            p = self.params.get(name)
            if (p is None or id(p) not in stepped or p.dtype != vals.dtype or not p.is_cpu
                    or not p.is_contiguous()):
                return None
            out.append(flat_np(p))
        return out

    def step(self, sparse: dict, lr: float) -> bool:
        """Apply one SGD step with the gradients already in ``p.grad``: the sparse buckets at their
        support, every other parameter with a gradient densely. False (nothing changed) when a
        bucket cannot take the native update: the caller then runs the wrapped step."""
        plans = []
        stepped = {id(p) for group in self.opt.param_groups for p in group["params"]}
        for bucket, idx, vals in sparse.values():
            members = self._members(bucket, idx, vals, stepped)
            if members is None:
                return False
            starts = np.array((*bucket.offsets, bucket.numel), dtype=np.int64)
            plans.append((idx.contiguous(), vals.contiguous(), starts, members, bucket.names))
        done: set[int] = set()
        with torch.no_grad():
            for idx, vals, starts, members, names in plans:
                if not sparse_axpy(idx.numpy(), vals.numpy(), -lr, starts, members):
                    raise RuntimeError("internal: the native sparse update was checked available, then refused")
                done.update(id(self.params[n]) for n in names)
            for group in self.opt.param_groups:  # SGD's rule for everything else: p += -lr * grad
                for p in group["params"]:
                    if p.grad is not None and id(p) not in done:
                        p.add_(p.grad, alpha=-lr)
        return True
