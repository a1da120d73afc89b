"""The device route: selection with no host synchronisation (docs/selection.md#device-route).

On device memory (CUDA) every ``nonzero``, ``.item()`` or boolean index stalls the stream until the
host has read the data. :class:`DeviceKernels` marks the route (``sync_free``); on it the selection
algorithms run the functions below instead of their data-dependent steps:

* ``ExactTopK``'s device step (select/exact_topk.py): the exact top-k (ties to the lower index, ascending, the host route's set and
  bits) as one fixed-size ``TensorOps.topk_abs_index`` of the accumulated buffer: k is known
  before the step, so no count, no candidate pass and no threshold ever reaches the host;
* :func:`local_verdict` and :func:`marked`: the NaN/Inf rule of docs/wrapper.md#nonfinite without
  a host decision: the flag stays a device tensor and the marker replaces the selection by a
  ``where``, so the reduced bucket is non-finite on every rank exactly where the host route's is;
  the one host read is the reducer's ``settle`` (``TensorOps.read_flags``).

The route is taken for tensors on a device, and for every tensor when the host kernels are off
(:data:`~.kernels.HOST_KERNELS`; tests force it on CPU tensors that way). Everything else of
:class:`~.portable.PortableKernels` is inherited for the paths that keep their host steps.
"""
from __future__ import annotations

import math
from typing import Any

from .portable import PortableKernels

__all__ = ["DeviceKernels", "local_verdict", "marked"]


class DeviceKernels(PortableKernels):
    """:class:`~.portable.PortableKernels` that declare the device route (``sync_free``)."""

    sync_free = True


def local_verdict(ops: Any, flat: Any, vals: Any, idx: Any, flat_is_acc: bool) -> Any:
    """A device flag: this rank's contribution ``flat`` is finite (docs/selection.md#device-route).

    ``flat_is_acc`` (an unfused memory added into flat): one ``finite_flag`` pass of it. Else
    ``vals`` are the selected entries of ``acc = flat + memory`` and flat is intact: a NaN/Inf of
    flat is one of acc (the memory is finite), and NaN/Inf rank above every finite value, so
    while some selected value is finite every NaN/Inf of acc was selected and flat is finite
    exactly where ``flat[idx]`` is; with all k selected values non-finite the contribution counts
    as non-finite (the marker is sent; the reduced bucket is non-finite either way)."""
    if flat_is_acc:
        return ops.finite_flag(flat)
    sel_ok = ops.finite_flag(ops.gather(flat, idx))
    return ops.where(ops.finite_flag(vals, "any"), sel_ok, False)


def marked(ops: Any, ok: Any, vals: Any, idx: Any) -> tuple[Any, Any]:
    """The selection where the device flag ``ok``, else the marker (+Inf at positions 0..k-1,
    compress/nonfinite.py), chosen on the device: the same sizes either way."""
    return ops.where(ok, vals, math.inf), ops.where(ok, idx, ops.arange(ops.numel(idx), like=idx))
