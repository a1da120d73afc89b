"""Checks of the engine's numeric arguments, shared by :class:`~hvd_commopt.engine.CommEngine` and
the adapters that validate them before an engine exists (TensorFlow builds it at the first step).

Each bad value gets one :class:`~hvd_commopt.errors.ConfigError` that names the argument and the
fix. Strings are refused, not parsed: ``backward_passes_per_step='2'`` is a config value that was
not converted, and a fraction (``1.5``) has no meaning, so neither is rounded silently.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

from .. import env
from ..errors import ConfigError
from ..reduce.base import Average, check_op

__all__ = ["check_backward_passes", "check_predivide", "check_engine_args"]


def check_backward_passes(value: Any) -> int:
    """``backward_passes_per_step`` as an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"backward_passes_per_step={value!r} must be a whole number >= 1 (the backward "
                          f"passes accumulated locally before one reduction), e.g. backward_passes_per_step=2")
    if value < 1:
        raise ConfigError(f"backward_passes_per_step={value!r} must be >= 1: use 1 to reduce after every "
                          f"backward pass, k > 1 to accumulate k passes locally first")
    return int(value)


def check_predivide(value: Any, op: str) -> float:
    """``gradient_predivide_factor`` as a finite float > 0 (only with op=Average unless 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ConfigError(f"gradient_predivide_factor={value!r} must be a finite number > 0, e.g. 1.0 "
                          f"(the default) or the number of ranks")
    if value <= 0:
        raise ConfigError(f"gradient_predivide_factor must be > 0, got {value!r}; 1.0 (the default) "
                          f"divides after the sum only")
    if float(value) != 1.0 and op != Average:
        raise ConfigError("gradient_predivide_factor only applies to op=Average; drop it with op=Sum")
    return float(value)


def check_engine_args(*, op: str = Average, backward_passes_per_step: Any = 1,
                      gradient_predivide_factor: Any = 1.0, fusion_threshold: Any = None) -> None:
    """Validate every numeric engine argument at once (adapters call it when wrapping)."""
    check_op(op)
    check_backward_passes(backward_passes_per_step)
    check_predivide(gradient_predivide_factor, op)
    env.fusion_threshold_setting(fusion_threshold)
