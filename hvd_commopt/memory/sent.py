"""The memories' zeroing of what was sent, on either route (docs/selection.md#empty-selection).

Every selection's indices ascend (a fixed-capacity one repeats its first index in the unused
slots), so ``idx[0] > idx[-1]`` marks the device route's empty selection
(:func:`~hvd_commopt.select.device.padded`), which sends -0.0 and must zero nothing, as the host
route, which sends nothing. On the host route this is ``index_fill(acc, idx, 0.0)`` as before.
"""
from __future__ import annotations

from typing import Any

from ..select import device
from ..select.kernels import device_route
from ..tensor_ops import TensorOps

__all__ = ["zero_sent"]


def zero_sent(ops: TensorOps, acc: Any, idx: Any) -> Any:
    """``acc`` with the sent positions ``idx`` set to +0.0 (in place where the framework allows)."""
    if device_route(ops, acc):
        return device.zero_sent(ops, acc, idx)
    return ops.index_fill(acc, idx, 0.0)
