"""``compression="auto"``: per bucket, the method (dense fp32, bf16/fp16, Top-k/DGC/gTop-k/Ok-Topk/
random-k at a density, all with error feedback) that the calibrated link model, the measured
selection cost and the profiled backward timeline predict to give the shortest step
(docs/auto-compression.md#model). :func:`choose` is the pure chooser, :class:`AutoReducer` routes
each bucket to its method, :class:`AutoPolicy` decides on rank 0, broadcasts and re-decides."""
from .choose import BucketChoice, BucketCosts, Choice, choose, predict
from .options import DEFAULT_ALLOW, DEFAULT_MIN_DENSITY, METHODS, AutoOptions, Method
from .policy import AutoPolicy
from .methods import CastWithMemory, build_method
from .reducer import AutoReducer
from .resolve import resolve_auto

__all__ = ["AutoOptions", "AutoPolicy", "AutoReducer", "CastWithMemory", "build_method", "BucketChoice", "BucketCosts", "Choice", "DEFAULT_ALLOW",
           "DEFAULT_MIN_DENSITY", "METHODS", "Method", "choose", "predict", "resolve_auto"]
