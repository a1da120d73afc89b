"""When a torch tensor's own memory may go to the host kernels, and its flat NumPy view.

The host kernels (:mod:`hvd_commopt.host_memory`, and the selection's through
``TorchOps.host_view``) run on a tensor's memory through
a zero-copy ``Tensor.numpy()``: only CPU tensors of the kernels' dtypes, contiguous, qualify. These
checks run several times per bucket and step, so each is written to make no torch call it does not
need (``is_cpu`` instead of building a device object, no ``detach``/``view`` that changes nothing):
on a model of many small layers they are a measurable part of a step's Python
(benchmarks/layer_overhead_bench.py).
"""
from __future__ import annotations

import torch

from hvd_commopt.host_memory import RANDOM_ACCESS_MIN

__all__ = ["HOST_DTYPES", "flat_np", "host_ok", "index_host"]

HOST_DTYPES = (torch.float32, torch.float64, torch.float16)  # the kernels' float dtypes
INDEX_HOST = HOST_DTYPES + (torch.int64, torch.int32)  # and what a scattered read or write may move


def host_ok(t) -> bool:
    """The NumPy kernels can run on t's own memory (zero-copy ``Tensor.numpy()``)."""
    return t.is_cpu and t.dtype in HOST_DTYPES and t.is_contiguous()  # is_cpu: no device object made


def flat_np(t):
    """``t.detach().view(-1).numpy()`` minus the ops that change nothing (~0.5 us each, several
    per bucket and step): no detach when autograd does not track t, no view when t is flat."""
    if t.requires_grad:
        t = t.detach()
    return (t if t.dim() == 1 else t.view(-1)).numpy()


def index_host(t, idx) -> bool:
    """A scattered read or write of ``t`` at ``idx`` may run in the native kernels on their memory
    (docs/selection.md#random-access)."""
    return (idx.numel() >= RANDOM_ACCESS_MIN and t.is_cpu and idx.is_cpu
            and idx.dtype == torch.int64 and t.dtype in INDEX_HOST and not t.requires_grad
            and t.is_contiguous() and idx.is_contiguous())
