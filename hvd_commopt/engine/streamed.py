"""A bucket's start and finish on its side stream (docs/backends.md#cuda-streams).

The engine calls these instead of the reducer directly when the bucket has a
:class:`~hvd_commopt.streams.BucketStream` (tensors on a device with streams); host buckets
never come here, so the CPU path makes no stream call.
"""
from __future__ import annotations

from typing import Any

from ..buckets import Bucket
from ..reduce.base import Pending, ReduceContext
from ..streams import BucketStream
from .rounds import Round

__all__ = ["start_on_stream", "finish_on_stream", "drop_on_stream"]


def start_on_stream(bs: BucketStream, rnd: Round, bucket: Bucket, flat: Any, buf: Any,
                    parts: list[tuple[int, Any]] | None, ctx: ReduceContext) -> Pending:
    """``reducer.start`` on the side stream, after the bucket's gradients: ``buf`` is its fusion
    buffer and ``parts`` the gradients the selection reads in place (docs/selection.md#grad-parts),
    the tensors the side stream reads that the compute stream made."""
    reads = [buf] if not parts else [buf, *(t for _, t in parts)]
    with bs.launch(reads):
        return rnd.reducer.start(bucket, rnd.info, flat, ctx)


def finish_on_stream(bs: BucketStream, rnd: Round, bucket: Bucket, pending: Pending,
                     ctx: ReduceContext) -> tuple[Any, bool]:
    """``reducer.finish`` and ``settle`` on the side stream; the compute stream then waits for the
    bucket's event (not the host), and what it uses next is marked as used by it: the result (the
    reduced buffer, a sparse support) and the round's fusion buffer, which the pool hands to the
    compute stream's packing in a later step (the start may have packed it on the side stream).
    Returns (the reduced buffer, settle's verdict)."""
    with bs.finish():
        flat = rnd.reducer.finish(pending, ctx)
        kept = rnd.reducer.settle(bucket, rnd.info, flat, ctx, pending)
    buf = rnd.flats[bucket.index]
    used = [flat] if buf is flat else [flat, buf]
    bs.hand_over(used if pending.support is None else [*used, *pending.support])
    return flat, kept


def drop_on_stream(bs: BucketStream, rnd: Round, pending: Pending, ctx: ReduceContext) -> None:
    """Wait for an abandoned bucket's collective; its buffers go back to the pool, so the compute
    stream waits for the side stream first."""
    with bs.finish():
        rnd.reducer.finish(pending, ctx)
