"""CUDA tensors reduced over Gloo through pinned host memory (docs/backends.md#cuda-on-gloo).

Where the backend is Gloo and the bucket is on a GPU (several ranks sharing one GPU, which NCCL
refuses), Gloo's own CUDA path stages every tensor through host memory one call at a time. Here
a bucket crosses PCIe in chunks of :data:`CHUNK_BYTES`, pipelined:

1. every chunk's device-to-host copy is queued at once on a copy stream (after the producing
   stream's work), into pinned host buffers kept between steps, each with an event;
2. chunk j's host allreduce starts as soon as its copy's event has fired, while later chunks are
   still crossing, so the copies overlap the collective;
3. as each collective completes, its chunk is copied back on the caller's stream (no host wait:
   later work on that stream is ordered after the copy).

The order is NCCL's: the copies out wait for the calling thread's current stream, and the
copies back are queued on it, so a caller that issues the collective from a side stream (with
``torch.cuda.stream(...)``) gets it ordered there, as an NCCL collective would be.

The bucket crosses in its own dtype: a float16/bfloat16 bucket (``Compression.fp16``/``bf16``,
cast on the device before it gets here) moves half the bytes over PCIe and the wire. Gloo sums
halves in float32 one element at a time, so on two ranks a half-precision sum is exchanged by an
allgather and the two parts are added on the device, rank 0's first: the same single rounding
of ``a + b``, bit for bit, as Gloo's allreduce (docs/backends.md#pair-sum).

The sparse paths' equal-size allgather (each rank's k (index, value) pairs, docs/topk.md#equal-sizes)
is staged the same way (:meth:`HostStaging.gather_equal`): one copy out on the copy stream, Gloo's
allgather of the pinned buffers, one copy back on the caller's stream. So are the variable-size
allgather (:meth:`HostStaging.allgather_`, each rank's part padded to the largest, the sizes
exchanged as host integers beforehand) and the point-to-point exchange (:meth:`HostStaging.sendrecv`,
gTop-k's rounds; the size, where the receiver does not know it, sent first as a host integer):
no size is read from the device, and Gloo's ``send``/``recv``/``all_gather``, which take host
tensors only, never see a CUDA tensor (torch_plugin/staged_collectives.py routes the backend's calls here).

The logic runs on CPU tensors too (no streams, no pinning), which is how the tests check it
without a GPU; the backend sends only CUDA buckets here.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .pair_sum import gather_single

__all__ = ["CHUNK_BYTES", "HostStaging"]

#: bytes per pipelined chunk; tests set it small to exercise several chunks
CHUNK_BYTES = 4 * 1024 * 1024
_HALVES = (torch.float16, torch.bfloat16)
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}


class HostStaging:
    """Pinned host buffers reused between steps, and the pipelined staged allreduce."""

    def __init__(self) -> None:
        # (dtype, elements, role) -> (host buffer, the event after the last copy back from it, or
        # None); the role keeps apart two buffers of one size that a call uses at once
        self._pool: dict[tuple[torch.dtype, int, str], tuple[torch.Tensor, object]] = {}
        self._copy_stream = None

    def host_buffers(self) -> list[torch.Tensor]:
        """The host buffers kept between steps (pinned for CUDA buckets)."""
        return [host for host, _ in self._pool.values()]

    def _host(self, like: torch.Tensor, n: int, role: str = "") -> torch.Tensor:
        key = (like.dtype, n, role)
        held = self._pool.get(key)
        if held is not None:
            host, done = held
            if done is not None:
                done.synchronize()  # the previous step's copy back out of it (long finished)
            return host
        host = torch.empty(n, dtype=like.dtype, pin_memory=like.is_cuda)
        self._pool[key] = (host, None)
        return host

    def _released(self, host: torch.Tensor, event, role: str = "") -> None:
        self._pool[(host.dtype, host.numel(), role)] = (host, event)

    def allreduce_(self, buf: torch.Tensor, op: str, group, group_size: int,
                   wait: Callable[[object], None]) -> torch.Tensor:
        """Reduce ``buf`` (contiguous) over ``group`` through host memory; ``wait(work)`` waits for
        one collective within the caller's deadline. Returns ``buf``, reduced."""
        flat = buf.view(-1)
        if op == "sum" and group_size == 2 and buf.dtype in _HALVES:
            return self._pair_sum(buf, flat, group, wait)
        n = flat.numel()
        host = self._host(flat, n)
        step = max(1, CHUNK_BYTES // flat.element_size())
        spans = [(i, min(i + step, n)) for i in range(0, n, step)]
        ready = self._to_host(flat, host, spans)
        works = []
        for (a, b), ev in zip(spans, ready):
            if ev is not None:
                ev.synchronize()  # this chunk is on the host; later ones are still crossing
            works.append(dist.all_reduce(host[a:b], op=_OPS[op], group=group, async_op=True))
        for (a, b), w in zip(spans, works):
            wait(w)
            flat[a:b].copy_(host[a:b], non_blocking=flat.is_cuda)
        self._released(host, self._record(flat))
        return buf

    def _pair_sum(self, buf, flat, group, wait):
        n = flat.numel()
        host = self._host(flat, n)
        (ev,) = self._to_host(flat, host, [(0, n)])
        if ev is not None:
            ev.synchronize()
        both = self._host(flat, 2 * n)
        w = gather_single(both, host, group=group, async_op=True)
        wait(w)
        parts = both.to(flat.device, non_blocking=flat.is_cuda) if flat.is_cuda else both
        torch.add(parts[:n], parts[n:], out=flat)  # rank 0's part first, as the allreduce's sum
        ev = self._record(flat)
        self._released(host, ev)
        self._released(both, ev)
        return buf

    def gather_equal(self, wire: torch.Tensor, group_size: int, group,
                     finish: Callable[[torch.Tensor], object]):
        """(``gather()``, ``done()``) of an allgather of the contiguous 1-D ``wire`` whose every rank
        sends as many elements, through host memory (the sparse paths' exchange: k (index, value)
        pairs): the device-to-host copy is queued on the copy stream now; ``gather()`` waits for
        its event and starts Gloo's allgather of the host buffers, returning the Work; ``done()``
        (after it completed) copies the gathered buffer back to the device on the caller's stream
        (no host wait) and returns ``finish(gathered)``. The host buffers are kept between steps."""
        n = wire.numel()
        host = self._host(wire, n)
        (ev,) = self._to_host(wire, host, [(0, n)])
        both = self._host(wire, group_size * n) if group_size > 1 else torch.empty_like(host)

        def gather():
            if ev is not None:
                ev.synchronize()  # this rank's part is on the host
            return gather_single(both, host, group=group, async_op=True)

        def done():
            out = both.to(wire.device, non_blocking=True) if wire.is_cuda else both.clone()
            ev_back = self._record(out)
            self._released(host, ev_back)
            self._released(both, ev_back)
            return finish(out)
        return gather, done

    def allgather_(self, wire: torch.Tensor, counts: list[int], group, wait: Callable[[object], None]) -> torch.Tensor:
        """Gloo's allgather of the contiguous 1-D ``wire`` whose rank r sends ``counts[r]`` elements
        (host integers, exchanged beforehand), through host memory: this rank's part is copied out
        on the copy stream into a host buffer of the largest size, Gloo gathers the padded parts
        into one host buffer (``wait(work)`` waits for it), which is copied back on the caller's
        stream in one copy; the parts are then cut out on the device. Returns every rank's part,
        in rank order, on ``wire``'s device."""
        n, m, size = wire.numel(), max(counts), len(counts)
        if m == 0:
            return wire.new_empty(0)
        host = self._host(wire, m, "part")
        (ev,) = self._to_host(wire, host, [(0, n)])
        both = self._host(wire, size * m, "gathered")
        if ev is not None:
            ev.synchronize()  # this rank's part is on the host
        wait(gather_single(both, host, group=group, async_op=True))
        out = both.to(wire.device, non_blocking=True) if wire.is_cuda else both.clone()
        ev_back = self._record(out)
        self._released(host, ev_back, "part")
        self._released(both, ev_back, "gathered")
        if all(c == m for c in counts):
            return out
        return torch.cat([out[r * m:r * m + c] for r, c in enumerate(counts)])

    def sendrecv(self, send: torch.Tensor, sending: bool, receiving: bool, count: int | None,
                 p2p: Callable[[torch.Tensor | None, torch.Tensor | None], None]) -> torch.Tensor | None:
        """A point-to-point exchange through host memory: ``send`` (contiguous 1-D, its dtype also
        the received one's) goes out when ``sending``, ``count`` elements come in when
        ``receiving`` (None: the sender's size comes first, as a host integer, so nothing is read
        from the device); ``p2p(out, in)`` sends the host tensor ``out`` and receives into ``in``
        (either None) and waits. Returns the received tensor on ``send``'s device (None when not
        receiving); the host buffers are kept between calls."""
        if count is None:
            n_in = torch.zeros(1, dtype=torch.int64)
            p2p(torch.tensor([send.numel()], dtype=torch.int64) if sending else None, n_in if receiving else None)
            count = int(n_in[0])  # a host tensor: no device synchronisation
        host_out = self._host(send, send.numel(), "send") if sending else None
        if host_out is not None:
            (ev,) = self._to_host(send, host_out, [(0, send.numel())])
            if ev is not None:
                ev.synchronize()
        host_in = self._host(send, count, "recv") if receiving else None
        p2p(host_out, host_in)
        out = None
        if host_in is not None:
            out = host_in.to(send.device, non_blocking=True) if send.is_cuda else host_in.clone()
        ev_back = self._record(send if out is None else out)
        if host_out is not None:
            self._released(host_out, ev_back, "send")
        if host_in is not None:
            self._released(host_in, ev_back, "recv")
        return out

    def _to_host(self, flat: torch.Tensor, host: torch.Tensor, spans) -> list:
        """Queue the device-to-host copy of each span; one event per span (None on CPU)."""
        if not flat.is_cuda:
            for a, b in spans:
                host[a:b].copy_(flat[a:b])
            return [None] * len(spans)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=flat.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(flat.device))  # after the bucket is written
        events = []
        with torch.cuda.stream(stream):
            for a, b in spans:
                host[a:b].copy_(flat[a:b], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)
        # the caller's stream may reuse the bucket only after the copies have read it
        torch.cuda.current_stream(flat.device).wait_stream(stream)
        return events

    @staticmethod
    def _record(flat: torch.Tensor):
        """An event on the caller's stream after the copies back (None on CPU)."""
        if not flat.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(flat.device))
        return ev
