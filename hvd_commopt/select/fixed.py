"""Fixed-capacity building blocks of the device route: results whose shapes are known
before the step, written on TensorOps primitives, with no host synchronisation.

The device route is the route a selection takes when :func:`~.kernels.kernels_for` does not give
the host kernels (always for CUDA tensors; on CPU when a test turns
:data:`~.kernels.HOST_KERNELS` off). On it nothing may wait for the data: no ``nonzero``, no
``unique``, no boolean-mask indexing, no ``.item()``; every intermediate has a size fixed by k.

* :func:`merge_fixed` is gTop-k's merge operator M (docs/gtopk.md#merge-fixed): the same set,
  values and order, bit for bit, as the host route's ``unique_sum`` + ``topk_abs``
  (docs/gtopk.md#merge-robust), from 2k concatenated pairs: a stable sort by index puts the two
  entries of a common index side by side (first operand's first), their sum ``(0 + a) + b`` is
  ``unique_sum``'s, the consumed duplicate becomes padding (index n, key -1: below every
  magnitude), and a stable descending sort of the magnitude keys picks k, ties to the lower index.
* :func:`member_of_sorted` is ``isin`` against an ascending unique set by binary search
  (gTop-k's survival masks, docs/gtopk.md#residual-survival).
"""
from __future__ import annotations

from typing import Any

from .host import HostKernels
from .kernels import kernels_for
from .portable import INF_KEYS

__all__ = ["device_route", "merge_fixed", "member_of_sorted", "magnitude_keys"]


def device_route(ops: Any, *tensors: Any) -> bool:
    """True when the selection of ``tensors`` (the values: the route the selection took) takes the
    device route (not the host kernels)."""
    return not isinstance(kernels_for(ops, *tensors), HostKernels)


def _full(ops: Any, n: int, value: int, like: Any) -> Any:
    """An int64 tensor of n times ``value`` on like's device (no host data crosses)."""
    return ops.shift(ops.zeros(n, "int64", like=like), value)


def magnitude_keys(ops: Any, v: Any) -> Any:
    """int64 keys of ``|v|`` (docs/selection.md#order), every NaN one class above +Inf, as
    ``torch.topk`` ranks them (the host route's merge)."""
    dt = ops.dtype_name(v)
    keys = ops.cast(ops.abs_keys(v), "int64")
    inf = INF_KEYS[dt]
    return ops.where(ops.compare(keys, "gt", inf), _full(ops, ops.numel(v), inf + 1, keys), keys)


def merge_fixed(ops: Any, first: tuple[Any, Any], second: tuple[Any, Any], k: int, n: int) -> tuple[Any, Any]:
    """M(first, second) of two lists of k unique int64 indices each (values of one dtype): the k
    entries of the union with the largest |summed value|, ties to the lower index, ascending
    (module docstring; docs/gtopk.md#merge-fixed). ``n``: the bucket's size (the padding index)."""
    i = ops.cat([first[0], second[0]])
    v = ops.cat([first[1], second[1]])
    c = ops.numel(i)
    if c == 0:
        return i, v
    dt = ops.dtype_name(v)
    order = ops.argsort(i)  # stable: at a common index, first's entry precedes second's
    si, sv = ops.gather(i, order), ops.gather(v, order)
    no = ops.zeros(1, "bool", like=si)
    dup = ops.equal(ops.slice(si, 1, c), ops.slice(si, 0, c - 1))  # dup[j]: si[j + 1] == si[j]
    has_next, consumed = ops.cat([dup, no]), ops.cat([no, dup])
    zero = ops.zeros(c, dt, like=sv)
    # unique_sum's additions: 0 + a (a -0.0 becomes +0.0), then + b at a common index
    summed = ops.add(ops.add(ops.zeros(c, dt, like=sv), sv),
                     ops.where(has_next, ops.cat([ops.slice(sv, 1, c), ops.zeros(1, dt, like=sv)]), zero))
    keys = ops.where(consumed, _full(ops, c, -1, si), magnitude_keys(ops, summed))
    top = ops.slice(ops.argsort(keys, descending=True), 0, min(k, c))
    pos = ops.gather(top, ops.argsort(top))  # ascending position == ascending index
    si = ops.where(consumed, _full(ops, c, n, si), si)  # padding carries index n (never selected: |U| >= k)
    return ops.gather(si, pos), ops.gather(summed, pos)


def member_of_sorted(ops: Any, elements: Any, sorted_seq: Any) -> Any:
    """bool tensor: ``elements[j]`` (int64, >= 0) occurs in the ascending int64 ``sorted_seq``."""
    ext = ops.cat([sorted_seq, _full(ops, 1, -1, sorted_seq)])  # searchsorted may answer numel
    return ops.equal(ops.gather(ext, ops.searchsorted(sorted_seq, elements)), elements)
