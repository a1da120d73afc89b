"""Reducers (how a bucket is reduced): dense allreduce here; sparse exchanges beside it."""
from .base import Pending, ReduceContext, Reducer
from .dense import DenseAllreduce

__all__ = ["Reducer", "ReduceContext", "Pending", "DenseAllreduce"]
