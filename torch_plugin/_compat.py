"""Every private PyTorch API torch_plugin uses, each with a public-API fallback
(docs/versions.md#private-apis).

The adapter's other modules call these functions and name no private torch attribute, so a torch
release that moves one changes this file only. Each function takes the private route while the
running torch has it (every release this project is tested with does) and otherwise a public one
that gives the same results and may cost speed or a warning. A private handle is a module-level
name here (a function, a class or an attribute name) and the fallback runs when it is None or the
object lacks it, which is how tests/torch/test_compat.py forces each fallback: by monkeypatching
the handle to None.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torch.optim import optimizer as _optimizer_module

__all__ = ["BatchNormBase", "is_view", "repoint_lr_scheduler_step", "step_hooks_registered",
           "storage_exclusive"]

# torch._C._storage_Use_Count(storage._cdata): how many references a tensor's storage has.
_STORAGE_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
_STORAGE_HANDLE: str | None = "_cdata"
# Tensor._base: the tensor a view was taken of (None for a tensor that is no view).
_VIEW_BASE: str | None = "_base"
# torch.optim.lr_scheduler marks the optimizer.step wrapper it installs with this attribute, and
# the wrapper sets the second one on the optimizer (the scheduler's "step order" warning reads it).
_LR_SCHED_MARK: str | None = "_wrapped_by_lr_sched"
_LR_SCHED_CALLED = "_opt_called"
# Optimizer step hooks: per optimizer (register_step_pre/post_hook) and global
# (torch.optim.optimizer.register_optimizer_step_pre/post_hook).
_STEP_HOOKS: tuple[str, str] | None = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_GLOBAL_STEP_HOOKS: tuple[str, str] | None = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
# torch.nn.modules.batchnorm._BatchNorm: the base of BatchNorm1d/2d/3d and of torch.nn.SyncBatchNorm.
_BATCH_NORM: type | None = getattr(torch.nn.modules.batchnorm, "_BatchNorm", None)
_MISSING = object()


def storage_exclusive(t: torch.Tensor) -> bool:
    """True when no tensor but ``t`` refers to its storage (the engine may then reuse it as a
    buffer, docs/wrapper.md#grad-views); False when it cannot be told, and the engine then takes
    a new buffer instead (same results, more allocation)."""
    use_count, handle = _STORAGE_USE_COUNT, _STORAGE_HANDLE
    if use_count is None or handle is None:
        return False
    cdata = getattr(t.untyped_storage(), handle, None)
    if cdata is None:
        return False
    # references to the storage: t's own, the temporary Python storage object's, and one per
    # other tensor on it (views: .grad handed out by the engine, docs/wrapper.md#grad-views)
    return use_count(cdata) <= 2


def is_view(t: torch.Tensor) -> bool:
    """True when ``t`` is a view of another tensor. Without ``Tensor._base``: when ``t`` does not
    cover its whole storage from its start (public ``storage_offset``/``untyped_storage``), which
    a view of a larger buffer never does; a view that covers all of its base counts as no view."""
    name = _VIEW_BASE
    if name is not None:
        base = getattr(t, name, _MISSING)
        if base is not _MISSING:
            return base is not None
    return t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size()


def step_hooks_registered(optimizer: torch.optim.Optimizer) -> bool:
    """True when a step pre- or post-hook is registered on ``optimizer`` or globally (a step that
    bypasses ``optimizer.step`` would not run it). Without torch's hook dicts the answer is True:
    the caller then takes the wrapped ``step()``, which runs whatever hooks there are."""
    own, shared = _STEP_HOOKS, _GLOBAL_STEP_HOOKS
    if own is None or shared is None:
        return True
    hooks = [getattr(optimizer, name, None) for name in own] + \
            [getattr(_optimizer_module, name, None) for name in shared]
    if any(h is None for h in hooks[:2]):
        return True
    return any(bool(h) for h in hooks)


def repoint_lr_scheduler_step(optimizer: torch.optim.Optimizer, base: type,
                              step: Callable[..., Any]) -> None:
    """An LR scheduler built before the optimizer was wrapped left an instance-level ``step`` that
    calls ``base``'s step directly; re-point it at ``step(optimizer, ...)`` so that gradients are
    still reduced.

    Private route: that wrapper carries torch's marker; ours carries it too and sets the flag the
    scheduler's step-order check reads, as torch's did. Public fallback: the wrapper is found by
    its ``__wrapped__`` (``functools.wraps``) being ``base.step``, and ours copies its attributes
    (``functools.update_wrapper``); the scheduler may then warn once that ``lr_scheduler.step()``
    came before ``optimizer.step()``, but the step taken is ours."""
    inst_step = optimizer.__dict__.get("step")
    if inst_step is None:
        return
    ref = weakref.ref(optimizer)
    mark = _LR_SCHED_MARK
    if mark is not None and getattr(inst_step, mark, False):
        called = _LR_SCHED_CALLED

        def marked(*args, **kwargs):
            opt = ref()
            setattr(opt, called, True)
            return step(opt, *args, **kwargs)

        setattr(marked, mark, True)
        optimizer.step = marked  # type: ignore[method-assign]  # an instance attribute, as torch's
        return
    if getattr(inst_step, "__wrapped__", None) is getattr(base, "step", _MISSING):

        def wrapped(*args, **kwargs):
            return step(ref(), *args, **kwargs)

        optimizer.step = functools.update_wrapper(wrapped, inst_step)  # type: ignore[method-assign]


def _batch_norm_base() -> type:
    """``_BatchNorm``, or ``BatchNorm1d`` without it: a ``_BatchNorm`` whose one specialisation,
    the input-rank check, SyncBatchNorm replaces."""
    return _BATCH_NORM if _BATCH_NORM is not None else torch.nn.BatchNorm1d


BatchNormBase: type = _batch_norm_base()
