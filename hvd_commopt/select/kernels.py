"""The selection's kernel seam: what a selection algorithm asks of the memory its tensors live in.

The algorithms (:mod:`.exact_topk`, :mod:`.strategies`, :mod:`.sampled`, :mod:`.layerwise`) are
written once, against :class:`SelectionKernels`; ``kernels_for(ops, *tensors)`` picks the
implementation for the tensors at hand (docs/selection.md#primitives):

* :class:`~.host.HostKernels` when the adapter gives a host view of every tensor
  (``TensorOps.host_view``: a zero-copy NumPy array of a contiguous CPU tensor): the NumPy
  kernels and the C extension run on the tensors' own memory;
* :class:`~.device.DeviceKernels` for tensors on a device (CUDA), and for every tensor when the
  host kernels are off: the portable kernels that declare the device route (``sync_free``), on
  which the selections run with no host synchronisation (docs/selection.md#device-route);
* :class:`~.portable.PortableKernels` otherwise (host tensors without a view: bfloat16, strided):
  the same contracts on the adapter's TensorOps primitives.

All give the same bits.

:data:`HOST_KERNELS` is an A/B switch for tests and benchmarks (off: every selection takes the
device route, on CPU tensors too); set it through a fixture or ``monkeypatch.setattr``.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .grad_parts import GradParts
from .device import DeviceKernels
from .host import HostKernels
from .portable import PortableKernels

__all__ = ["SelectionKernels", "kernels_for", "device_route", "HOST_KERNELS"]

Tensor = Any

# Whether tensors with host views run the host kernels (tests and benchmarks turn it off)
HOST_KERNELS = True


@runtime_checkable
class SelectionKernels(Protocol):
    """The selection-only operations (contracts of the magnitude order in docs/selection.md#order).

    Magnitudes are ordered +0 == -0 < denormals < normals < +Inf < NaN (every NaN equal); ``thr``
    is a Python float rounded to t's dtype (nan: the NaN class, < 0: below every |x|). Tensors are
    1-D (a shaped tensor is read flat). Results are the framework's tensors (``ops``')."""

    ops: Any  # the TensorOps of the tensors these kernels run on
    # the device route (docs/selection.md#device-route): the selections on these kernels make no
    # host synchronisation (fixed sizes, flags kept as tensors)
    sync_free: bool

    @property
    def reads_grad_parts(self) -> bool:
        """fused_topk and add_momentum_abs_where read a bucket's unpacked gradients (a
        :class:`~.grad_parts.GradParts`, docs/selection.md#grad-parts) where they are."""
        ...

    def abs_where(self, t: Tensor, op: str, thr: float) -> tuple[Tensor, Tensor]:
        """(int64 ascending positions i with ``|t[i]| op thr``, ``t`` at them); ``op`` one of
        "ge" "gt" "le" "lt". The one full pass of a selection."""
        ...

    def add_abs_where(self, acc: Tensor, g: Tensor, op: str, thr: float,
                      out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``acc + g`` (into acc where allowed, or into ``out``, a buffer of acc's size, leaving acc
        intact; bit-identical to ``TensorOps.add``) and ``abs_where`` of it, fused in one sweep
        where the memory allows: (the sum, indices, values). Use the returned sum (functional
        frameworks return a new tensor)."""
        ...

    def add_momentum_abs_where(self, acc: Tensor, u: Tensor, mu: float, g: Tensor, u_out: Tensor, op: str,
                               thr: float, out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """``u' = TensorOps.scale_add_into(u_out, u, mu, g)`` and ``add_abs_where(acc, u', op, thr,
        out)`` in one sweep: (acc', u', indices, values), bit-identical to the two calls. None where
        there is no such pass (the caller then makes the two calls; docs/selection.md#native-sweep).
        ``g`` may be a :class:`~.grad_parts.GradParts` where :attr:`reads_grad_parts`."""
        ...

    def scatter_sum(self, buf: Tensor, idx: Tensor, vals: Tensor, scale: float) -> tuple[Tensor, Tensor, bool] | None:
        """A sparse exchange's result built in ``buf`` (every element overwritten): ``out =
        scatter_add(zero_(buf), idx, vals)`` times ``scale`` (> 0, finite), ``sums = out[idx]``
        (scaled; one per entry of idx), and whether every sum is finite: ``(out, sums, finite)``,
        bit-identical to those TensorOps calls. None where there is no such pass (the caller makes
        the calls; docs/selection.md#scatter-sum)."""
        ...

    def fused_topk(self, t: Tensor, k: int, sidx: Tensor | None, j_lo: int, j_hi: int, max_retries: int,
                   g: Tensor | None, u: Tensor | None, mu: float, u_out: Tensor | None,
                   out: Tensor | None) -> tuple | None:
        """``ExactTopK.select`` of ``t`` (+ ``g``, or + ``u*mu + g`` made into ``u_out``; the sum
        into ``out`` with t intact when given) in one call: ``(acc, values, indices, v,
        candidates, retries, full_fallbacks, above_fallback, ties, finite)``. None where there is
        no such call for these tensors (ExactTopK's own steps run; docs/selection.md#native-topk).
        ``g`` may be a :class:`~.grad_parts.GradParts` where :attr:`reads_grad_parts`."""
        ...

    def kth_largest_abs(self, t: Tensor, k: int) -> float:
        """The exact k-th largest ``|t|`` (1 <= k <= numel) as a Python float, nan for a NaN."""
        ...


_PAIRS: dict[int, tuple[Any, Any, Any, Any]] = {}  # id(ops) -> (ops, HostKernels, PortableKernels, DeviceKernels)


def _pair(ops: Any) -> tuple[Any, Any, Any, Any]:
    entry = _PAIRS.get(id(ops))
    if entry is None or entry[0] is not ops:
        portable = PortableKernels(ops)
        entry = _PAIRS[id(ops)] = (ops, HostKernels(ops, portable), portable, DeviceKernels(ops))
    return entry


def device_route(ops: Any, t: Any) -> bool:
    """``kernels_for(ops, t).sync_free`` for one tensor, without making a host view (a sparse
    reducer asks it per bucket before its selection; docs/selection.md#device-route)."""
    return not HOST_KERNELS or ops.on_device(t)


def kernels_for(ops: Any, *tensors: Any) -> SelectionKernels:
    """The selection kernels for ``tensors`` (None entries ignored, a GradParts by its buffer):
    :class:`~.host.HostKernels` when ``ops`` gives a host view of every one of them (and
    :data:`HOST_KERNELS`), else :class:`~.device.DeviceKernels` where one is on a device (or the
    host kernels are off), else :class:`~.portable.PortableKernels`. With no tensors: the host
    kernels where they are on (what an adapter offers for host memory)."""
    _, host, portable, device = _pair(ops)
    if not HOST_KERNELS:
        return device
    for t in tensors:
        if t is not None:
            t = t.buf if isinstance(t, GradParts) else t
            if ops.host_view(t) is None:
                return device if ops.on_device(t) else portable
    return host
