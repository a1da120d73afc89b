"""Memories (what is not sent, carried into later steps): error feedback, DGC's momentum and
velocity, momentum correction; the :class:`Memory` and :class:`MomentumMemory` protocols they
implement. A memory never selects and never communicates: the reducers compose it with a selector."""
from .base import Memory, MomentumMemory
from .dgc import DGCMemory
from .error_feedback import ErrorFeedback, Generations, TensorStore
from .momentum import MomentumCorrection

__all__ = ["Memory", "MomentumMemory", "ErrorFeedback", "DGCMemory", "MomentumCorrection", "TensorStore",
           "Generations"]
