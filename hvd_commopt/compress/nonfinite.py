"""NaN/Inf never enter a residual memory (docs/wrapper.md#nonfinite).

A memory (error feedback, DGC's momentum and velocity) carries values into later steps, so one
non-finite gradient stored there would be sent, or would block selection, for many steps: a NaN
in DGC's velocity stays forever, an Inf in a Top-k residual is re-selected for about 1/density
steps. The rule, applied by the reducers that own a memory:

1. Before a bucket touches its memory, the rank checks its own contribution. If it is not finite,
   the ``nonfinite`` policy of the memory decides: ``"raise"`` raises
   :class:`NonFiniteGradientError` naming the rank and the bucket (the job ends through
   :mod:`hvd_commopt.faults`); ``"skip"`` (the default) warns, naming the rank and the bucket,
   leaves the memory untouched, and still takes part in the collective (every rank joins every
   collective, so nothing hangs) with a *marker* payload that makes the reduced bucket non-finite
   on every rank, as a dense allreduce of that gradient would be. A payload that cannot carry a
   non-finite value (the integer sums of ternary signs) sends zeros instead: the contribution is
   dropped.
2. Every rank snapshots the bucket's memory before the round (:meth:`Memory.snapshot`) and, when
   the reduced bucket comes back non-finite, rolls it back (:meth:`Memory.rollback`). The reduced
   result is identical on every rank, so every rank decides the same way, and ``GradScaler`` (which
   sees the non-finite reduced gradient) skips the step on every rank: a skipped step costs
   exactly that step, and the next steps equal a run in which the step never happened.

Why a marker rather than zeros under "skip": with zeros the reduced gradient would be finite, so
a ``GradScaler`` would neither skip the step nor lower its scale, and an overflowing rank would be
silenced step after step.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..errors import ConfigError, NonFiniteGradientError
from ..tensor_ops import TensorOps

__all__ = ["NONFINITE_POLICIES", "NonFiniteGradientError", "check_policy", "report", "marker",
           "carries_nonfinite"]

NONFINITE_POLICIES = ("skip", "raise")


def check_policy(policy: Any) -> str:
    if policy not in NONFINITE_POLICIES:
        raise ConfigError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {policy!r}: 'skip' keeps the "
                          f"compression state out of a NaN/Inf step (GradScaler then skips it), 'raise' stops")
    return policy


def report(policy: str, rank: int, bucket: str) -> None:
    """Raise or warn about a non-finite contribution of ``rank`` to ``bucket``."""
    if policy == "raise":
        raise NonFiniteGradientError(
            f"rank {rank}: the gradient of bucket {bucket!r} holds NaN or Inf. Find the cause (loss scale, "
            f"learning rate, bad input) or build the compression with nonfinite='skip' to skip such steps "
            f"(torch.amp.GradScaler then skips them on every rank)")
    # The step is not in the message, so the default warning filter shows it once per rank and bucket.
    warnings.warn(f"rank {rank}: the gradient of bucket {bucket!r} holds NaN or Inf; this step's compression "
                  f"state is left unchanged and the reduced bucket is non-finite on every rank (a GradScaler "
                  f"skips the step)", RuntimeWarning, stacklevel=3)


def marker(ops: TensorOps, k: int, like: Any) -> tuple[Any, Any]:
    """A sparse selection of k values, all +Inf, at positions 0..k-1: the reduced bucket is +Inf
    there on every rank whatever the others send (+Inf, never -Inf, so the sum is never NaN and
    magnitude comparisons such as gTop-k's merge keep it)."""
    vals = ops.from_numpy(np.full(k, np.inf, dtype=np.float32), like=like)
    if ops.dtype_name(vals) != ops.dtype_name(like):
        vals = ops.cast(vals, ops.dtype_name(like))
    return vals, ops.arange(k, like=like)


def carries_nonfinite(ops: TensorOps, payload: Any) -> bool:
    """True when a dense payload's dtype can hold NaN/Inf (floats; not ternary's integer signs)."""
    name = ops.dtype_name(payload)
    return name.startswith("float") or name.startswith("bfloat")
