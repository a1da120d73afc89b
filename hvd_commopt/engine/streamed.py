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

__all__ = ["start_on_stream", "finish_on_stream", "finish_bucket", "settle_deferred", "drop_on_stream"]


def start_on_stream(bs: BucketStream, rnd: Round, bucket: Bucket, flat: Any, buf: Any,
                    parts: list[tuple[int, Any]] | None, ctx: ReduceContext) -> Pending:
    """``reducer.start`` on the side stream, after the bucket's gradients: ``buf`` is its fusion
    buffer and ``parts`` the gradients the selection reads in place (docs/selection.md#grad-parts),
    the tensors the side stream reads that the compute stream made."""
    reads = [buf] if not parts else [buf, *(t for _, t in parts)]
    with bs.launch(reads):
        return rnd.reducer.start(bucket, rnd.info, flat, ctx)


def finish_on_stream(bs: BucketStream, rnd: Round, bucket: Bucket, pending: Pending,
                     ctx: ReduceContext) -> tuple[Any, bool | None, tuple | None]:
    """``reducer.finish`` and ``settle`` on the side stream; the compute stream then waits for the
    bucket's event (not the host), and what it uses next is marked as used by it: the result (the
    reduced buffer, a sparse support) and the round's fusion buffer, which the pool hands to the
    compute stream's packing in a later step (the start may have packed it on the side stream).
    A reducer whose verdict is device flags (``reducer.device_flags``) is not settled here: the
    flags are handed over too, and the engine reads them with the step's others
    (:func:`settle_deferred`). Returns (the reduced buffer, settle's verdict or None, the flags or None)."""
    with bs.finish():
        flat = rnd.reducer.finish(pending, ctx)
        flags = rnd.reducer.device_flags(bucket, rnd.info, pending)
        kept = None if flags is not None else rnd.reducer.settle(bucket, rnd.info, flat, ctx, pending)
    buf = rnd.flats[bucket.index]
    used = [flat] if buf is flat else [flat, buf]
    if pending.support is not None:
        used += list(pending.support)
    bs.hand_over(used if flags is None else [*used, *flags])
    return flat, kept, flags


def finish_bucket(bs: BucketStream | None, rnd: Round, bucket: Bucket, pending: Pending,
                  ctx: ReduceContext) -> tuple[Any, bool | None, tuple | None]:
    """:func:`finish_on_stream` where the bucket has a stream, else the same on the caller's."""
    if bs is not None:
        return finish_on_stream(bs, rnd, bucket, pending, ctx)
    flat = rnd.reducer.finish(pending, ctx)
    flags = rnd.reducer.device_flags(bucket, rnd.info, pending)
    return flat, None if flags is not None else rnd.reducer.settle(bucket, rnd.info, flat, ctx, pending), flags


def settle_deferred(ops: Any, rnd: Round, deferred: list[tuple[Bucket, Any, Pending, tuple]],
                    streams: list[BucketStream | None] | None, ctx: ReduceContext) -> list[Bucket]:
    """Settle the buckets whose verdict is device flags, ``(bucket, result, pending, flags)`` each:
    every bucket's flags read in ONE host read (``TensorOps.read_flags``, the one decision per step
    that ``torch.amp.GradScaler`` also makes; docs/selection.md#one-read-per-step), then each
    bucket's ``settle`` with its values (on its side stream, where a rollback writes the memory).
    The result's flag is the same on every rank, so every rank decides the skip alike. Returns the
    buckets that were kept (finite)."""
    flat_flags = [f for _, _, _, flags in deferred for f in flags]
    values = ops.read_flags(flat_flags)
    kept: list[Bucket] = []
    at = 0
    for b, out, pending, flags in deferred:
        mine = tuple(values[at:at + len(flags)])
        at += len(flags)
        bs = streams[b.index] if streams is not None else None
        if bs is None:
            ok = rnd.reducer.settle(b, rnd.info, out, ctx, pending, mine)
        else:
            with bs.finish():
                ok = rnd.reducer.settle(b, rnd.info, out, ctx, pending, mine)
        if ok:
            kept.append(b)
    return kept


def drop_on_stream(bs: BucketStream, rnd: Round, pending: Pending, ctx: ReduceContext) -> None:
    """Wait for an abandoned bucket's collective; its buffers go back to the pool, so the compute
    stream waits for the side stream first."""
    with bs.finish():
        rnd.reducer.finish(pending, ctx)
