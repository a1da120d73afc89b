"""Thread-rank doubles of the native communicator and link for the device-route tests: torch tensors
cross between thread-ranks as they are (no host staging, as NCCL's collectives of device tensors),
and sums run in rank order so every rank makes the same additions; plus the tied-value leaves the
merge tests feed them."""
from __future__ import annotations

import queue
import threading

import numpy as np
import torch


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


def rank_order_sum(shared: dict, barrier: threading.Barrier, rank: int, size: int, t):
    """Every thread-rank's ``t`` summed in rank order (the same additions on every rank)."""
    shared[rank] = t.clone()
    barrier.wait()
    acc = shared[0].clone()
    for r in range(1, size):
        acc = acc.add_(shared[r])
    barrier.wait()
    return acc


class TensorLink:
    """A native link double: torch tensors cross between thread-ranks as they are (``host`` False);
    ``allreduce_`` sums in rank order."""

    host = False

    def __init__(self, boxes: dict, rank: int, size: int, shared: dict | None = None,
                 barrier: threading.Barrier | None = None):
        self.boxes, self.rank, self.size = boxes, rank, size
        self.shared, self.barrier = shared, barrier

    def sendrecv(self, send, dest, source, name=None):
        if dest >= 0:
            self.boxes[(self.rank, dest)].put(send.clone())
        return None if source < 0 else self.boxes[(source, self.rank)].get(timeout=60)

    def sendrecv_sized(self, send, dest, source, count):
        got = self.sendrecv(send, dest, source)
        assert got is None or got.numel() == count, (got.numel(), count)
        return got

    def allgather_equal(self, buf, name=None):
        """Every thread-rank's ``buf`` (as many elements each) in rank order, as they are."""
        for d in range(self.size):
            if d != self.rank:
                self.boxes[(self.rank, d)].put(buf.clone())
        parts = [buf if s == self.rank else self.boxes[(s, self.rank)].get(timeout=60) for s in range(self.size)]
        return torch.cat(parts), [buf.numel()] * self.size

    def allreduce_(self, buf, op="sum", name=None):
        assert op == "sum" and self.shared is not None and self.barrier is not None
        return buf.copy_(rank_order_sum(self.shared, self.barrier, self.rank, self.size, buf))


class TensorComm:
    """A native communicator double for the dense reducers: torch tensors are summed in rank order
    across thread-ranks as they are (no host staging, as NCCL's allreduce of device tensors)."""

    def __init__(self, shared: dict, barrier: threading.Barrier, rank: int, size: int):
        self.shared, self.barrier, self.rank, self.size = shared, barrier, rank, size

    def allreduce_tensor_async(self, ops_, t, op, name):
        return rank_order_sum(self.shared, self.barrier, self.rank, self.size, t)

    def wait(self, handle):
        return handle


def run_comms(P: int, body):
    shared, barrier = {}, threading.Barrier(P)
    return _threads(P, lambda r: body(TensorComm(shared, barrier, r, P)))


def run_links(P: int, body):
    boxes = {(a, b): queue.Queue() for a in range(P) for b in range(P)}
    shared, barrier = {}, threading.Barrier(P)
    return _threads(P, lambda r: body(TensorLink(boxes, r, P, shared, barrier)))


def _threads(P: int, body):
    out: list = [None] * P
    errs: list = []

    def target(r):
        try:
            out[r] = body(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)
    threads = [threading.Thread(target=target, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errs:
        raise errs[0]
    return out


def tied_leaves(P: int, n: int, k: int, dtype, seed: int, nonfinite: bool = False):
    """Each rank's (ascending int64 indices, values): small integers, so sums tie and merge exactly;
    -0.0 entries; with ``nonfinite`` a +Inf (the marker's value) and a NaN from Inf + -Inf."""
    rng = np.random.default_rng(seed)
    leaves = []
    for r in range(P):
        i = torch.from_numpy(np.sort(rng.choice(n, k, replace=False)).astype(np.int64))
        v = torch.from_numpy(rng.integers(-3, 4, k).astype(np.float64)).to(dtype)
        v[int(rng.integers(0, k))] = -0.0
        if nonfinite:
            v[0] = float("inf") if r % 2 == 0 else float("-inf")
        leaves.append((i, v))
    return leaves
