"""Where a bucket's compression and collective run relative to the compute stream: the engine's
stream seam (docs/backends.md#cuda-streams).

On a GPU, the gradients of a step are made on the compute stream; a bucket's compression, its
collective and the work that finishes it (decompression, the memory update, the NaN/Inf check) run
on a side stream, ordered by events, so backward keeps running on the compute stream while a
bucket is compressed and sent, and ``step()`` makes the compute stream wait for each bucket's
event instead of making the host wait for the device.

The engine (:class:`~hvd_commopt.engine.CommEngine`) asks a :class:`DeviceStreams` once per bucket
and plan for the bucket's :class:`BucketStream`, and calls it at three points:

* :meth:`BucketStream.launch` around the bucket's start (``reducer.start``: compression and the
  collective's submission), with the tensors the start reads;
* :meth:`BucketStream.finish` around its finish (``reducer.finish`` and ``settle``);
* :meth:`BucketStream.hand_over` with the tensors the compute stream uses afterwards (the reduced
  buffer, a sparse support).

Host tensors (NumPy, the CPU path of torch, TensorFlow) have no streams: the adapter passes no
:class:`DeviceStreams` (None), and the engine then makes none of these calls (docs/backends.md#cuda-streams).
:data:`NO_STREAMS` is the explicit "nothing to order" implementation, for adapters and tests that want
an object; its buckets get None. The CUDA implementation is ``torch_plugin.streams.CudaStreams``.
This module imports no framework.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, Sequence, runtime_checkable

from .buckets import Bucket

__all__ = ["BucketStream", "DeviceStreams", "NoStreams", "NO_STREAMS"]


@runtime_checkable
class BucketStream(Protocol):
    """One bucket's place on the device: its side stream and its events, made once (no per-step
    allocation, so a captured CUDA graph replays the same objects; docs/backends.md#cuda-streams)."""

    def launch(self, tensors: Sequence[Any]) -> AbstractContextManager[None]:
        """Entered around the bucket's start: on entry the side stream waits for an event recorded
        on the calling thread's current (compute) stream, i.e. for ``tensors`` (the bucket's
        gradients, its fusion buffer) to be ready; inside, the side stream is current; ``tensors``
        are marked as used by the side stream (the caching allocator then does not reuse their
        memory before the side stream is done with them)."""
        ...

    def finish(self) -> AbstractContextManager[None]:
        """Entered around the bucket's finish: inside, the side stream is current; on exit an
        event is recorded on it and the compute stream (current on entry) waits for that event.
        The host does not wait for the device."""
        ...

    def hand_over(self, tensors: Sequence[Any]) -> None:
        """``tensors`` (made or written on the side stream) are used next on the compute stream:
        marked as used by it, so that their memory outlives that use."""
        ...


@runtime_checkable
class DeviceStreams(Protocol):
    """Gives each bucket its :class:`BucketStream`, or None where nothing needs ordering."""

    def for_bucket(self, bucket: Bucket) -> BucketStream | None:
        """Called once per bucket when a plan is set (not per step)."""
        ...


class NoStreams:
    """Host tensors: one stream of execution, nothing to order; every bucket gets None."""

    def for_bucket(self, bucket: Bucket) -> BucketStream | None:
        return None


NO_STREAMS = NoStreams()
