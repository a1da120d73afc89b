"""Fusion planners, cost models and the DAG simulator: pure functions of tensor sizes, times
and a cost model.

A plan is a list of groups of tensor positions in backward order (see :mod:`.threshold`).
"""
from .auto import PlanChoice, candidate_plans, choose_plan
from .cost_model import (AlphaBeta, CommTimeFn, CostModel, allgather_time, gtopk_time, ring_allreduce_time, sparse_k,
                         topk_allgather_time)
from .exact import brute_force_plan, optimal_with_time, plan_optimal
from .mgwfbp import mgwfbp_with_prediction, plan_mgwfbp
from .omgs import OMGS_TOPK_S, omgs_with_prediction, plan_omgs, topk_select_time
from .simulator import SimResult, check_profile, ready_times, simulate
from .threshold import plan_bucket_cap, plan_per_tensor, plan_single, plan_threshold, validate_plan

__all__ = [
    "plan_threshold", "plan_bucket_cap", "plan_per_tensor", "plan_single", "validate_plan",
    "AlphaBeta", "CostModel", "CommTimeFn", "ring_allreduce_time", "allgather_time", "topk_allgather_time",
    "gtopk_time", "sparse_k", "plan_mgwfbp", "mgwfbp_with_prediction", "plan_optimal", "optimal_with_time",
    "brute_force_plan", "plan_omgs", "omgs_with_prediction", "topk_select_time", "OMGS_TOPK_S",
    "SimResult", "simulate", "ready_times", "check_profile", "PlanChoice", "choose_plan", "candidate_plans",
]
