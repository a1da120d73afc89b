"""Layer-wise top-k inside a fused bucket: LAGS-SGD's selection with merged sends.

Paper: LAGS-SGD (Shi et al., ECAI 2020; docs/lags-omgs.md#lags-update) selects the top-k of
**each layer**. Sent one bucket per layer (``fusion_threshold=0``), every layer costs a chain of
small operations and two collectives; on a fast link that start-up cost, not the bytes, sets the
step time (docs/lags-omgs.md#lags-merged). ``Compression.topk(density, layerwise=True)`` keeps the
rule (each member tensor of a bucket gets its own ``k_l = min(max(int(n_l·ρ_l), min_k), n_l)`` and
its own exact top-k) and fuses what does not depend on the layer: the packing, the error-feedback
buffers, the allgather and the scatter-add run once per bucket.

Choices:

* With one tensor per bucket the result is the per-layer bucket's, bit for bit; with several,
  every element gets the same residual, the same selection and the same sum as under
  ``fusion_threshold=0`` (the exchange sums the same (index, value) pairs in rank order), so the
  weights are identical too (tests/unit/test_layerwise.py). One exception, with ``dense_1d=False``
  only: a one-layer bucket whose k is its size goes by the dense path (momentum correction keeps
  its velocity there), a member with ``k_l = n_l`` is selected whole (and its velocity masked).
* The members' sums are written straight into slices of the bucket's accumulator: where slices
  are views (``TensorOps.slices_are_views``: torch, NumPy) the bucket is swept once; a functional
  framework returns new tensors and the pieces are concatenated.
* Two paths, one result: a CPU bucket of float16/32/64 is selected in a few batched steps
  (:mod:`hvd_commopt.select.layerwise_host`); other tensors (a device, bfloat16) member by
  member with :class:`~hvd_commopt.select.exact_topk.ExactTopK`, on the device.
* Exact selection only: threshold reuse and DGC's sampled threshold keep their state per bucket.
* The per-member ``k`` is cached per bucket layout (the frozen :class:`~hvd_commopt.buckets.Bucket`
  itself, not its name) and size: buckets change only on a re-plan.
"""
from __future__ import annotations

from typing import Any

from . import addend as addend_ops
from .kernels import kernels_for
from .layerwise_host import HOST_DTYPES, HostLayerwise

__all__ = ["LayerwiseK"]


class LayerwiseK:
    """The per-member plan ``((offset, numel, k), ...)`` of a compressor's buckets, and the
    selection that follows it. ``comp`` is the :class:`~hvd_commopt.compress.topk.TopKSelector`
    it serves (its density, ``min_k``, ``dense_1d`` and selection)."""

    def __init__(self, comp: Any):
        self._comp = comp
        self._host = HostLayerwise(comp.selection.exact)
        self._plans: dict[tuple[Any, int], tuple[tuple[int, int, int], ...] | None] = {}

    def of(self, bucket: Any, numel: int) -> tuple[tuple[int, int, int], ...] | None:
        """The bucket's per-member plan, or None where the whole-bucket rule applies (not layer-wise,
        a dense bucket, a buffer that is not the bucket's). A one-tensor bucket has a plan too, so
        the density is asked by tensor name whatever the fusion."""
        comp = self._comp
        if not comp.layerwise or bucket is None or bucket.dense:
            return None
        key = (bucket, int(numel))  # by value: a re-plan may reuse a name for other members
        if key in self._plans:
            return self._plans[key]
        sizes = [bucket.member_numel(i) for i in range(len(bucket.names))]
        plan = None
        if sum(sizes) == numel:
            plan = tuple((off, n, min(max(int(n * comp.density.of_tensor(name, n)), comp.min_k), n))
                         for off, n, name in zip(bucket.offsets, sizes, bucket.names))
        if len(self._plans) > 4096:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def select_acc(self, ops: Any, plan: tuple, r: Any, bucket: Any, step: int, addend: Any,
                   out: Any = None, finite: list | None = None) -> tuple[Any, Any, Any]:
        """``TopKSelector.select_acc`` of a multi-member bucket: (values, ascending
        bucket-relative indices, acc = r + addend), one finiteness verdict for the bucket."""
        sel = self._comp.selection
        if not ops.slices_are_views:
            addend = addend_ops.made(ops, addend)  # a member's u' would not land in the bucket's buffer
        target = r if out is None else out
        # the device route (docs/selection.md#device-route) selects member by member, as a device does
        if ops.device_name(r) == "cpu" and ops.dtype_name(r) in HOST_DTYPES and not kernels_for(ops, r).sync_free:
            key = (bucket, ops.numel(r), ops.name, ops.dtype_name(r))
            v, i, accs, ok, made = self._host.select(ops, plan, key, r, addend, out)  # makes addend
            sel.record_calls(bucket.name, step, made)
            if finite is not None:
                finite.append(ok)
            return v, i, self._acc(ops, r, target, addend, accs)
        vals, idxs, accs, parts = [], [], [], []
        verdicts: list[bool | None] = []
        for off, n, k in plan:
            part = ops.slice(target, off, off + n)
            a = None if addend is None else addend_ops.slice_of(ops, addend, off, off + n)
            parts.append(a)
            src = part if out is None else ops.slice(r, off, off + n)
            v, i, acc = sel.select_acc(ops, src, k, bucket, step, a, None if out is None else part, verdicts)
            if finite is not None and verdicts[-1] is None:
                # a member small enough to skip the candidate pass: check it alone, so that the
                # bucket gets a verdict and the reducer no extra sweep (docs/selection.md#finite-sweep)
                verdicts[-1] = ops.all_finite(acc)
            vals.append(v)
            idxs.append(ops.shift(i, off) if off else i)
            accs.append(acc)
        if finite is not None:
            finite.append(all(verdicts))
        addend_ops.made_by_slices(ops, addend, parts)
        return ops.cat(vals), ops.cat(idxs), self._acc(ops, r, target, addend, accs)

    @staticmethod
    def _acc(ops: Any, r: Any, target: Any, addend: Any, sums: list) -> Any:
        """The bucket's sum: r itself without an addend; the target buffer where every member's
        sum was written into a view of it; else the members' sums end to end."""
        if addend is None:
            return r
        return target if ops.slices_are_views else ops.cat(sums)
