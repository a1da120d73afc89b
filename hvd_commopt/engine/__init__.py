"""The engine: buckets, fusion buffers, rounds, the fusion tuner; the step runs in its scheduler."""
from ..buckets import Bucket, TensorSpec, build_buckets
from ..reduce import make_reducer
from .engine import CommEngine, StepScheduler
from .rounds import Round, RoundPlan
from .specs import verify_same_tensors
from .stats import StepStats

__all__ = ["CommEngine", "StepScheduler", "make_reducer", "TensorSpec", "verify_same_tensors", "Bucket",
           "build_buckets", "StepStats", "Round", "RoundPlan"]
