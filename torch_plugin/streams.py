"""CUDA streams for the engine's buckets and for the collectives the progress thread issues
(docs/backends.md#cuda-streams).

* :class:`CudaStreams` is the torch adapter's :class:`hvd_commopt.streams.DeviceStreams` for a
  model on one CUDA device: each bucket gets a :class:`CudaBucketStream`, the device's side
  stream plus two events made once per bucket and plan (nothing is allocated per step, so a
  captured CUDA graph replays the same objects). A bucket's start waits on the GPU for an event
  recorded on the compute stream when its gradients are ready, then compresses on the side
  stream; at ``step()`` the compute stream waits for the bucket's event; the host never does.
  Tensors that cross streams get ``record_stream``.
* :func:`on_collective_stream` wraps the torch.distributed backend's collectives on CUDA tensors: they
  are issued, and waited for, with the device's *collective stream* current on the progress
  thread. NCCL's internal stream waits for the *issuing thread's current stream*, and
  ``Work.wait`` makes the *waiting thread's current stream* wait for NCCL; on the progress thread
  both would otherwise be the default (compute) stream, which neither orders the collective after
  the side stream's compression nor keeps the compute stream free of the collective.

Two streams per device and process, made once: the side stream carries every bucket's compression
and finish, the collective stream every collective's issue and wait (the collectives themselves
run on NCCL's stream); each is ordered as its work is issued.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

from hvd_commopt.buckets import Bucket

__all__ = ["CudaStreams", "CudaBucketStream", "side_stream", "collective_stream", "on_collective_stream", "streams_for"]

_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()
_LOCAL = threading.local()  # per thread and device: the events on_collective_stream records


def _stream(device: torch.device, role: str) -> torch.cuda.Stream:
    with _STREAMS_LOCK:
        s = _STREAMS.get((device, role))
        if s is None:
            s = _STREAMS[(device, role)] = torch.cuda.Stream(device=device)
        return s


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's side stream on ``device`` (a CUDA device): the buckets' compression and
    finish. Made on first use."""
    return _stream(device, "side")


def collective_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's collective stream on ``device``: the progress thread issues and waits for
    collectives with it current. Made on first use."""
    return _stream(device, "collective")


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


def _events(device: torch.device) -> tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]:
    """This thread's three events for ``device`` (made once per thread and device)."""
    per = getattr(_LOCAL, "events", None)
    if per is None:
        per = _LOCAL.events = {}
    ev = per.get(device)
    if ev is None:
        ev = per[device] = (torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event())
    return ev


F = TypeVar("F", bound=Callable[..., Any])


def on_collective_stream(method: F) -> F:
    """Decorate a backend collective whose first argument is its tensor: for a CUDA tensor it runs
    with the device's collective stream current, after the calling thread's current stream (a
    tensor a user wrote there, what NCCL waited for before) and after the side stream (a bucket's
    compression, issued before the bucket's collective was submitted). Then the calling thread's
    current stream waits for the collective stream, as it waited for NCCL before, and so does the
    side stream, where a bucket's finish reads the result (docs/backends.md#cuda-streams). Host
    tensors run as they are."""
    @functools.wraps(method)
    def run(self: Any, buf: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(buf, torch.Tensor) and buf.is_cuda):
            return method(self, buf, *args, **kwargs)
        device = buf.device
        caller = torch.cuda.current_stream(device)
        coll, side = collective_stream(device), side_stream(device)
        if caller == coll:  # nested: issued with the collective stream current already
            return method(self, buf, *args, **kwargs)
        from_caller, from_side, leave = _events(device)
        from_caller.record(caller)
        coll.wait_event(from_caller)
        from_side.record(side)
        coll.wait_event(from_side)
        buf.record_stream(coll)
        try:
            with torch.cuda.stream(coll):
                out = method(self, buf, *args, **kwargs)
        finally:
            leave.record(coll)
            caller.wait_event(leave)
            side.wait_event(leave)
        # what the collective made on the collective stream is read on the other two
        for t in _cuda_tensors(out if isinstance(out, (tuple, list)) else (out,)):
            t.record_stream(caller)
            t.record_stream(side)
        return out
    return run  # type: ignore[return-value]
