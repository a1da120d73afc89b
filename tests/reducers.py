"""Driving a reducer directly in tests: a one-tensor bucket and a round, as the engine passes them."""
from __future__ import annotations

from typing import Any

from hvd_commopt.buckets import Bucket
from hvd_commopt.reduce.base import ReduceContext, Reducer, RoundInfo


def bucket(name: str, ops: Any = None, flat: Any = None, numel: int = 1, dtype: str = "float32") -> Bucket:
    """A flat one-tensor bucket named ``name`` (sized like ``flat`` when given)."""
    if flat is not None:
        numel, dtype = ops.numel(flat), ops.dtype_name(flat)
    return Bucket.single(name, numel, dtype)


def start(red: Reducer, name: str, flat: Any, ctx: ReduceContext, step: int = 0, tag: str | None = None):
    """``red.start`` on a bucket named ``name`` in round ``step`` (collectives named ``name@tag``)."""
    return red.start(bucket(name, ctx.ops, flat), RoundInfo(step, tag), flat, ctx)


def reduce_once(red: Reducer, name: str, flat: Any, ctx: ReduceContext, step: int = 0, tag: str | None = None):
    return red.finish(start(red, name, flat, ctx, step, tag), ctx)
