"""Reducers (how a bucket is reduced): dense allreduce (with optional compression and memory), and
the sparse reducers on one base (selection + memory): Top-k/random-k/DGC allgather and gTop-k."""
from ..compress.base import Compressor
from ..compress.topk import SparseCompressor
from ..errors import ConfigError
from .base import REDUCE_AVERAGING_OPS, Average, Pending, ReduceContext, Reducer, RoundInfo, Sum, check_op
from .dense import DenseAllreduce
from .gtopk import GTopK
from .oktopk import OkTopK
from .sparse import SparseReducer
from .sparse_allgather import SparseAllgather

__all__ = ["Reducer", "ReduceContext", "Pending", "RoundInfo", "DenseAllreduce", "SparseReducer", "SparseAllgather", "GTopK", "OkTopK",
           "Average", "Sum", "REDUCE_AVERAGING_OPS", "check_op", "make_reducer"]


def make_reducer(compression: Compressor | Reducer | None) -> Reducer:
    """The reducer for a user's ``compression`` argument (a compressor or a ready reducer)."""
    if compression is None:
        return DenseAllreduce()
    if isinstance(compression, Reducer):
        return compression
    if isinstance(compression, Compressor):
        return DenseAllreduce(compression)
    if isinstance(compression, SparseCompressor):
        raise ConfigError(f"{compression!r} needs a sparse exchange; pass the reducer built by "
                          f"Compression.{compression.name}(...) instead of the bare selector")
    raise ConfigError(f"compression must be a Compression.* value, got {compression!r}")
