"""The engine: buckets, fusion buffers, rounds, the fusion tuner; the step runs in its scheduler,
and the :class:`Trainer` holds both."""
from ..buckets import Bucket, TensorSpec, build_buckets
from ..reduce import make_reducer
from .engine import CommEngine
from .ports import Checkpointable, RoundSource, StepScheduler
from .rounds import Round, RoundPlan
from .specs import verify_same_tensors
from .stats import StepStats
from .trainer import Trainer

__all__ = ["CommEngine", "Trainer", "StepScheduler", "RoundSource", "Checkpointable", "make_reducer", "TensorSpec",
           "verify_same_tensors", "Bucket", "build_buckets", "StepStats", "Round", "RoundPlan"]
