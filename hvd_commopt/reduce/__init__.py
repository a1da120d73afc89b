"""Reducers (how a bucket is reduced): dense allreduce, sparse allgather (Top-k, random-k, DGC)
and gTop-k."""
from .base import Pending, ReduceContext, Reducer
from .dense import DenseAllreduce
from .gtopk import GTopK
from .sparse_allgather import SparseAllgather

__all__ = ["Reducer", "ReduceContext", "Pending", "DenseAllreduce", "SparseAllgather", "GTopK"]
