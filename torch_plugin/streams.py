"""CUDA streams for the engine's buckets and for the collectives the progress thread issues
(docs/backends.md#cuda-streams).

* :class:`CudaStreams` is the torch adapter's :class:`hvd_commopt.streams.DeviceStreams` for a
  model on one CUDA device: each bucket gets a :class:`CudaBucketStream`, the device's side
  stream plus two events made once per bucket and plan (nothing is allocated per step, so a
  captured CUDA graph replays the same objects). A bucket's start waits on the GPU for an event
  recorded on the compute stream when its gradients are ready, then compresses on the side
  stream; at ``step()`` the compute stream waits for the bucket's event; the host never does.
  Tensors that cross streams get ``record_stream``.
* :func:`on_side_stream` wraps the torch.distributed backend's collectives on CUDA tensors: they
  are issued, and waited for, with the side stream current on the progress thread. NCCL's internal
  stream waits for the *issuing thread's current stream*, and ``Work.wait`` makes the *waiting
  thread's current stream* wait for NCCL; on the progress thread both would otherwise be the
  default (compute) stream, which neither orders the collective after the side stream's
  compression nor keeps the compute stream free of the collective.

One side stream per device and process: every bucket's compression and every collective are
ordered on it, as they are issued (the collectives themselves run on NCCL's stream).
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

from hvd_commopt.buckets import Bucket

__all__ = ["CudaStreams", "CudaBucketStream", "side_stream", "on_side_stream", "streams_for"]

_SIDE: dict[torch.device, torch.cuda.Stream] = {}
_SIDE_LOCK = threading.Lock()
_LOCAL = threading.local()  # per thread and device: the events on_side_stream records


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's side stream on ``device`` (a CUDA device), made on first use."""
    with _SIDE_LOCK:
        s = _SIDE.get(device)
        if s is None:
            s = _SIDE[device] = torch.cuda.Stream(device=device)
        return s


def _cuda_tensors(tensors: Sequence[Any]) -> Iterator[torch.Tensor]:
    return (t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda)


class CudaBucketStream:
    """One bucket's side stream and its two events (docs/backends.md#cuda-streams)."""

    __slots__ = ("device", "stream", "ready", "done")

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = side_stream(device)
        self.ready = torch.cuda.Event()  # on the compute stream: the bucket's gradients are ready
        self.done = torch.cuda.Event()   # on the side stream: the bucket is reduced

    @contextmanager
    def launch(self, tensors: Sequence[Any]) -> Iterator[None]:
        self.ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(self.ready)
        for t in _cuda_tensors(tensors):  # made on the compute stream, read on the side stream
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield

    @contextmanager
    def finish(self) -> Iterator[None]:
        compute = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self.done.record(self.stream)
            compute.wait_event(self.done)  # the GPU waits, not the host

    def hand_over(self, tensors: Sequence[Any]) -> None:
        compute = torch.cuda.current_stream(self.device)
        for t in _cuda_tensors(tensors):
            t.record_stream(compute)


class CudaStreams:
    """The adapter's :class:`~hvd_commopt.streams.DeviceStreams` for parameters on ``device``."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CudaStreams needs a CUDA device, got {device}")
        self.device = device

    def for_bucket(self, bucket: Bucket) -> CudaBucketStream:
        return CudaBucketStream(self.device)


def streams_for(params: Sequence[torch.Tensor]) -> CudaStreams | None:
    """:class:`CudaStreams` when every parameter is on one CUDA device; None otherwise (host
    tensors: the engine then makes no stream call; several devices: the current stream is kept)."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        return None
    device = next(iter(devices))
    if device.type != "cuda":
        return None
    return CudaStreams(torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device()))


def _events(device: torch.device) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """This thread's two events for ``device`` (made once per thread and device)."""
    per = getattr(_LOCAL, "events", None)
    if per is None:
        per = _LOCAL.events = {}
    ev = per.get(device)
    if ev is None:
        ev = per[device] = (torch.cuda.Event(), torch.cuda.Event())
    return ev


F = TypeVar("F", bound=Callable[..., Any])


def on_side_stream(method: F) -> F:
    """Decorate a backend collective whose first argument is its tensor: for a CUDA tensor it runs
    with the device's side stream current, after the calling thread's current stream (a tensor a
    user wrote there), and the calling thread's current stream then waits for the side stream, as
    it waited for NCCL before (docs/backends.md#cuda-streams). Host tensors run as they are."""
    @functools.wraps(method)
    def run(self: Any, buf: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(buf, torch.Tensor) and buf.is_cuda):
            return method(self, buf, *args, **kwargs)
        device = buf.device
        caller = torch.cuda.current_stream(device)
        side = side_stream(device)
        if caller == side:  # issued with the side stream current already
            return method(self, buf, *args, **kwargs)
        entry, leave = _events(device)
        entry.record(caller)
        side.wait_event(entry)
        try:
            with torch.cuda.stream(side):
                return method(self, buf, *args, **kwargs)
        finally:
            leave.record(side)
            caller.wait_event(leave)
    return run  # type: ignore[return-value]
