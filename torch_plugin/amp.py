"""``torch.amp.GradScaler``'s plain idiom on a DistributedOptimizer (docs/usage.md#amp).

DDP users write ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``. Under DDP
the gradients are already reduced when ``scaler.step`` unscales them and looks for Inf/NaN. Here
the reduction happens inside ``opt.step()``, so without help GradScaler would unscale the *local*
gradients (which the hooks have already sent, scaled), decide the skip from this rank's gradients
only, and the step would apply the reduced *scaled* gradients: an update ``scale`` times too large
(65536x with the default scale) and, on the ranks that did not overflow, the Inf of the rank that
did.

The seam: GradScaler asks the optimizer ``_step_supports_amp_scaling`` right before it inspects
the gradients (PyTorch's contract for optimizers that handle scaling themselves: GradScaler then
checks ``p.grad`` for Inf/NaN, sets ``optimizer.grad_scale`` / ``optimizer.found_inf`` and calls
``optimizer.step()``). The wrapper answers it with a property that first finishes this step's
reduction (``synchronize()``), so that

* GradScaler's Inf/NaN check sees the **reduced** gradients, which are non-finite on every rank
  as soon as one rank's are (a dense sum carries the Inf; the compressors send a marker:
  docs/wrapper.md#nonfinite). The skip and the scale's backoff in ``scaler.update()`` are
  therefore the same on every rank;
* ``step()`` skips when ``found_inf`` is set, otherwise unscales the reduced gradients (the same
  multiplication by ``1/scale`` in float32 as ``GradScaler.unscale_``) and applies them.

Choices: Horovod's idiom (``synchronize()``, ``unscale_``, ``step`` inside ``skip_synchronize()``)
is left on GradScaler's ordinary path, unchanged. Calling ``scaler.unscale_(opt)`` before the
gradients are reduced (DDP's clipping idiom) cannot be made right after the fact (the scaled
gradients were sent, the local ones were unscaled and clipped), so it is refused at that step with
the fix. Schedules other than the synchronous one apply local or delayed gradients, and a step
that one rank skips would shift its step counter against the others': refused at the first step
with the fix.
"""
from __future__ import annotations

from typing import Any

import torch

from hvd_commopt.errors import ConfigError
from hvd_commopt.schedule.sync import SyncScheduler

__all__ = ["take_over_for_scaler", "scaled_step"]


def take_over_for_scaler(opt: Any) -> bool:
    """The answer to GradScaler's ``_step_supports_amp_scaling``: reduce now and say True, or,
    inside ``skip_synchronize()`` (the user reduced already), False: GradScaler's ordinary path."""
    if opt._hco_user_synced:
        return False
    trainer = opt._hco_engine
    if not isinstance(trainer.scheduler, SyncScheduler):
        raise ConfigError(
            f"torch.amp.GradScaler with schedule '{trainer.scheduler.name}': its step() applies local or "
            f"delayed gradients, and a step the scaler skips on one rank would put that rank's step counter "
            f"out of line with the others'. Use bf16 autocast without a GradScaler "
            f"(torch.autocast(device_type, dtype=torch.bfloat16)), or schedule=Schedule.sync() "
            f"(docs/usage.md#amp)")
    trainer.synchronize()
    opt._hco_scaler_step = True
    return True


def _unscale(opt: Any, grad_scale: torch.Tensor) -> None:
    """Multiply every gradient by 1/scale in float32, as ``GradScaler.unscale_`` does."""
    inv = grad_scale.double().reciprocal().float()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                by_device.setdefault(p.grad.device, []).append(p.grad)
    with torch.no_grad():
        for dev, grads in by_device.items():
            torch._foreach_mul_(grads, inv.to(dev))


def scaled_step(opt: Any, closure: Any) -> Any:
    """``optimizer.step()`` called by GradScaler after :func:`take_over_for_scaler`: skip on a
    non-finite reduced gradient (the same verdict on every rank), else unscale and apply."""
    opt._hco_scaler_step = False
    grad_scale, found_inf = opt.grad_scale, opt.found_inf  # set by GradScaler.step (its contract)
    trainer = opt._hco_engine
    if grad_scale is None:
        trainer.scheduler.abandon()
        raise ConfigError(
            "scaler.unscale_(optimizer) ran before the gradients were reduced: it unscaled (and you may "
            "have clipped) this rank's local gradients, while the scaled ones were already sent. To unscale "
            "or clip, reduce first: optimizer.synchronize(); scaler.unscale_(optimizer); clip; then "
            "`with optimizer.skip_synchronize(): scaler.step(optimizer)`; or drop unscale_ and let "
            "scaler.step(optimizer) unscale the reduced gradients (docs/usage.md#amp)")
    if float(found_inf.item()):
        trainer.scheduler.abandon()  # the step is skipped on every rank: forget its synchronize()
        return None
    _unscale(opt, grad_scale)
    opt.grad_scale = opt.found_inf = None  # unscaled already: a fused wrapped optimizer must not again
    with trainer.skip_synchronize():
        return trainer.run_step(closure)
