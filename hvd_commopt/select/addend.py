"""The momentum correction's addend, made inside the selection's pass (docs/selection.md#native-sweep).

DGC's memory, and so Top-k's momentum correction, adds ``u' = mu*u + g`` to the velocity ``v``
during the selection's candidate pass (docs/selection.md#fused-ef). Handing the selection ``u``,
``mu`` and ``g`` (a :class:`MomentumAddend`) instead of a finished ``u'`` lets the host kernel make
``u'`` in that same pass (``SelectionKernels.add_momentum_abs_where``): one read and one write of the
bucket fewer than making ``u'`` first.

Every place a selection reads its addend goes through the helpers here. The layer-wise selection
slices the addend per member (:func:`slice_of`), each member's sweep making its part. A path
without the fused pass (a bucket small enough to sort, device tensors, TF) makes ``u'`` first
with ``TensorOps.scale_add_into``; the sample reads ``mu*u + g`` at the sampled
positions with the same two roundings. So the sums, the selection and ``u'`` are bit-identical
whichever path ran, and :meth:`MomentumAddend.make` after the selection returns ``u'`` either way.
"""
from __future__ import annotations

from typing import Any

from .grad_parts import GradParts
from .kernels import SelectionKernels

__all__ = ["MomentumAddend", "made", "gather", "add_abs_where", "slice_of", "made_by_slices", "fused_parts",
           "made_in_pass"]


class MomentumAddend:
    """``u*mu + g``, to be written into ``out`` (which may be ``u``) by whichever pass makes it.

    ``g`` may be a bucket's :class:`~hvd_commopt.select.grad_parts.GradParts`: the native top-k
    reads them in place (:func:`fused_parts`); any other reader of ``g`` packs them first."""

    __slots__ = ("u", "mu", "_g", "out", "made")

    def __init__(self, u: Any, mu: float, g: Any, out: Any):
        self.u, self.mu, self._g, self.out = u, float(mu), g, out
        self.made: Any = None

    @property
    def g(self) -> Any:
        if isinstance(self._g, GradParts):
            self._g = self._g.pack()
        return self._g

    def g_for(self, kern: SelectionKernels) -> Any:
        """``g`` as the fused kernels take it: a :class:`GradParts` left unpacked where they read
        those in place (``kern.reads_grad_parts``), else packed."""
        return self._g if kern.reads_grad_parts else self.g

    def make(self, ops: Any) -> Any:
        """``u'`` (made now unless a fused pass already made it)."""
        if self.made is None:
            self.made = ops.scale_add_into(self.out, self.u, self.mu, self.g)
        return self.made

    def slice(self, ops: Any, start: int, stop: int) -> "MomentumAddend":
        """The addend of elements ``[start, stop)``, writing into a view of ``out``."""
        return MomentumAddend(ops.slice(self.u, start, stop), self.mu, ops.slice(self.g, start, stop),
                              ops.slice(self.out, start, stop))


def made(ops: Any, addend: Any) -> Any:
    """``addend`` as a tensor (a :class:`MomentumAddend` is made first; None stays None)."""
    return addend.make(ops) if isinstance(addend, MomentumAddend) else addend


def gather(ops: Any, addend: Any, idx: Any) -> Any:
    """``addend[idx]``; of a momentum addend not made yet, ``mu*u[idx] + g[idx]`` (the same two
    roundings as the full pass), so sampling does not force a pass of its own."""
    if isinstance(addend, MomentumAddend) and addend.made is None:
        return ops.add(ops.scale(ops.gather(addend.u, idx), addend.mu), ops.gather(addend.g, idx))
    return ops.gather(made(ops, addend), idx)


def slice_of(ops: Any, addend: Any, start: int, stop: int) -> Any:
    """``addend[start:stop]``: a momentum addend not made yet stays one (over views of its
    buffers), so a layer-wise selection makes each member's ``u'`` in that member's sweep."""
    if isinstance(addend, MomentumAddend) and addend.made is None:
        return addend.slice(ops, start, stop)
    return ops.slice(made(ops, addend), start, stop)


def made_by_slices(ops: Any, addend: Any, parts: list) -> None:
    """After a selection that read ``addend`` through the slices ``parts`` (covering it, with
    :func:`slice_of`): each part made (a no-op where its sweep made it), so ``addend.out`` holds
    ``u'`` whole. Needs slices that are views (``ops.slices_are_views``)."""
    if isinstance(addend, MomentumAddend) and addend.made is None:
        for p in parts:
            made(ops, p)
        addend.made = addend.out


def add_abs_where(kern: SelectionKernels, acc: Any, addend: Any, op: str, thr: float,
                  out: Any = None) -> tuple[Any, Any, Any]:
    """``SelectionKernels.add_abs_where`` of ``acc`` and ``addend``; a momentum addend not made
    yet is made in the same pass where the kernels can (``add_momentum_abs_where``), else first."""
    if isinstance(addend, MomentumAddend) and addend.made is None:
        fused = kern.add_momentum_abs_where(acc, addend.u, addend.mu, addend.g_for(kern), addend.out, op, thr, out)
        if fused is not None:
            acc, addend.made, idx, vals = fused
            return acc, idx, vals
    return kern.add_abs_where(acc, made(kern.ops, addend), op, thr, out)


def fused_parts(kern: SelectionKernels, addend: Any) -> tuple[Any, Any, float, Any]:
    """``(g, u, mu, u_out)`` for a kernel that adds ``u*mu + g`` (u None: just ``g``; g None: no
    addend) in its pass: a momentum addend not made yet goes as its parts, to be made there; its
    ``g`` stays a :class:`GradParts` where the kernels read those (``kern.reads_grad_parts``)."""
    if isinstance(addend, MomentumAddend) and addend.made is None:
        return addend.g_for(kern), addend.u, addend.mu, addend.out
    return made(kern.ops, addend), None, 0.0, None


def made_in_pass(addend: Any) -> None:
    """A kernel given :func:`fused_parts` wrote ``u'`` into the momentum addend's ``out``."""
    if isinstance(addend, MomentumAddend) and addend.made is None:
        addend.made = addend.out
