"""Fusion planners and cost models: pure functions of tensor sizes, times and a cost model.

A plan is a list of groups of tensor positions in backward order (see :mod:`.threshold`).
"""
from .threshold import plan_per_tensor, plan_single, plan_threshold, validate_plan

__all__ = ["plan_threshold", "plan_per_tensor", "plan_single", "validate_plan"]
