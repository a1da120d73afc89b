"""The engine: buckets, fusion buffers, reducers and the step counter."""
from .bucket import Bucket, build_buckets
from .engine import CommEngine, make_reducer
from .rounds import Round
from .specs import TensorSpec, verify_same_tensors
from .stats import StepStats

__all__ = ["CommEngine", "make_reducer", "TensorSpec", "verify_same_tensors", "Bucket", "build_buckets", "StepStats", "Round"]
