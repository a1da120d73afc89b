"""Reducers (how a bucket is reduced): dense allreduce (with optional compression and memory), and
the sparse reducers on one base (selection + memory): Top-k/random-k/DGC allgather and gTop-k."""
from ..compress.base import Compressor
from ..compress.selector import Selector
from ..compress.user import as_user_compressor
from ..errors import ConfigError
from .adasum import AdasumReducer
from .base import (REDUCE_AVERAGING_OPS, TENSOR_OPS, Adasum, Average, Max, Min, Pending, Product, ReduceContext,
                   Reducer, RoundInfo, Sum, check_op, check_tensor_op)
from .dense import DenseAllreduce
from .gtopk import GTopK
from .oktopk import OkTopK
from .quantized import QuantizedAllreduce
from .sparse import SparseReducer
from .sparse_allgather import SparseAllgather

__all__ = ["Reducer", "ReduceContext", "Pending", "RoundInfo", "DenseAllreduce", "SparseReducer", "SparseAllgather", "GTopK",
           "OkTopK", "Average", "Sum", "REDUCE_AVERAGING_OPS", "check_op", "make_reducer", "Min", "Max", "Product", "Adasum",
           "TENSOR_OPS", "check_tensor_op", "AdasumReducer", "QuantizedAllreduce"]


def make_reducer(compression: Compressor | Reducer | None, op: str = Average) -> Reducer:
    """The reducer for a user's ``compression`` argument (a compressor or a ready reducer) and
    ``op`` (``Adasum`` takes a cast compressor and gives the Adasum reducer)."""
    if op == Adasum:
        if isinstance(compression, AdasumReducer):
            return compression
        if compression is not None and not isinstance(compression, Compressor):
            raise ConfigError(f"op=Adasum combines dense gradients; it cannot be used with {compression!r}")
        return AdasumReducer(compression)
    if compression is None:
        return DenseAllreduce()
    if isinstance(compression, Reducer):
        return compression
    if isinstance(compression, Compressor):
        return DenseAllreduce(compression)
    user = as_user_compressor(compression)  # Horovod's compress(tensor) / decompress(tensor, ctx)
    if user is not None:
        return DenseAllreduce(user)
    if isinstance(compression, Selector):
        raise ConfigError(f"{compression!r} needs a sparse exchange; pass the reducer built by "
                          f"Compression.{compression.name}(...) instead of the bare selector")
    raise ConfigError(f"compression must be a Compression.* value, got {compression!r}")
