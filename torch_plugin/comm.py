"""torch.distributed backend (Gloo on CPU, NCCL on GPU) for the core's Communicator.

Registered with the core as backends ``gloo`` and ``nccl``. Rendezvous: torchrun's
MASTER_ADDR/MASTER_PORT when present; under ``mpirun`` (no MASTER_ADDR) rank 0 picks a free port
and tells the others through MPI, so ``HVD_COMMOPT_BACKEND=gloo mpirun ...`` works too.
Every call waits with ``Work.wait(timeout)`` so nothing blocks forever.
"""
from __future__ import annotations

import copy
import datetime
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

from hvd_commopt import env
from hvd_commopt.comm import register_backend
from hvd_commopt.comm.base import Backend
from hvd_commopt.errors import CollectiveTimeoutError, LaunchEnvironmentError

__all__ = ["TorchDistBackend", "register"]

# Gloo moves no int16 ("Invalid scalar type"): collectives that only move data (allgather,
# broadcast, alltoall, sendrecv) carry such buffers as float16 of the same bits; the core
# reduces small integers in int32 on native backends.
_MOVE_AS = {torch.int16: torch.float16}


def _movable(t):
    alias = _MOVE_AS.get(t.dtype)
    return (t, None) if alias is None else (t.view(alias), t.dtype)


def _restore(t, dtype):
    return t if dtype is None or t is None else t.view(dtype)


_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}


def _rendezvous(launch: env.LaunchInfo) -> str:
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return "env://"
    if launch.launcher in ("openmpi", "mpich"):
        from hvd_commopt.comm.mpi import import_mpi
        MPI = import_mpi()
        addr = None
        if launch.rank == 0:
            host = socket.gethostname()
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            try:
                ip = socket.gethostbyname(host)
            except OSError:
                ip = "127.0.0.1"
            addr = f"tcp://{ip}:{port}"
        return MPI.COMM_WORLD.bcast(addr, root=0)
    if launch.size == 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"tcp://127.0.0.1:{s.getsockname()[1]}"
    raise LaunchEnvironmentError("torch.distributed needs MASTER_ADDR and MASTER_PORT (torchrun sets "
                                 "them), or launch with mpirun so rank 0 can share its address")


class TorchDistBackend(Backend):
    buffer_kind = "native"

    def __init__(self, kind: str = "gloo", timeout_s: float | None = None):
        if kind == "nccl" and not torch.cuda.is_available():
            raise LaunchEnvironmentError("backend 'nccl' needs CUDA GPUs; use 'gloo' (CPU) or 'mpi'")
        self.name = kind
        launch = env.detect_launch()
        self._timeout = datetime.timedelta(seconds=env.collective_timeout_s(timeout_s))
        if not dist.is_initialized():
            if kind == "nccl":
                torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
            dist.init_process_group(kind, init_method=_rendezvous(launch), rank=launch.rank,
                                    world_size=launch.size, timeout=self._timeout)
        # Our own group: collectives from our progress thread must never interleave with the
        # user's (or DDP's) on the default group, which could order them differently per rank
        # (seen as a Gloo "received data size doesn't match" when DDP ran beside us).
        self._pg = dist.new_group(backend=kind)
        self._device = torch.device("cuda", torch.cuda.current_device()) if kind == "nccl" else torch.device("cpu")
        self._local_rank, self._local_size = launch.local_rank, launch.local_size

    @property
    def rank(self): return dist.get_rank(self._pg)
    @property
    def size(self): return dist.get_world_size(self._pg)
    @property
    def local_rank(self): return self._local_rank
    @property
    def local_size(self): return self._local_size

    def _wait(self, work, op: str, name: str, deadline: float) -> None:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise CollectiveTimeoutError(
                    f"{op} '{name}' timed out on rank {self.rank} ({self.name}: {e}). A rank skipped a "
                    f"step or stopped; the {self.name} backend cannot tell which.", op=op, name=name) from e
            raise

    def allreduce_(self, buf, op, name, deadline):
        self._wait(dist.all_reduce(buf, op=_OPS[op], group=self._pg, async_op=True), "allreduce", name, deadline)
        return buf

    def allgather(self, buf, name, deadline):
        buf, dtype = _movable(buf.reshape(-1))
        out, counts = self._allgather(buf, name, deadline)
        return _restore(out, dtype), counts

    def _allgather(self, buf, name, deadline):
        n = torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device)
        counts = [torch.zeros_like(n) for _ in range(self.size)]
        self._wait(dist.all_gather(counts, n, group=self._pg, async_op=True), "allgather", name, deadline)
        counts = [int(c.item()) for c in counts]
        m = max(counts)
        padded = torch.zeros(m, dtype=buf.dtype, device=buf.device)
        padded[: buf.numel()] = buf
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, padded, group=self._pg, async_op=True), "allgather", name, deadline)
        return torch.cat([p[:c] for p, c in zip(parts, counts)]), counts

    def allgather_host(self, data: np.ndarray, name, deadline):
        out, counts = self.allgather(torch.from_numpy(data.copy()).to(self._device), name, deadline)
        return out.cpu().numpy(), counts

    def broadcast_(self, buf, root, name, deadline):
        src = dist.get_global_rank(self._pg, root)
        wire, _ = _movable(buf)  # a view: the broadcast lands in buf
        self._wait(dist.broadcast(wire, src=src, group=self._pg, async_op=True), "broadcast", name, deadline)
        return buf

    def alltoall(self, buf, counts, name, deadline):
        buf, dtype = _movable(buf.reshape(-1).contiguous())
        out, rc = self._alltoall(buf, counts, name, deadline)
        return _restore(out, dtype), rc

    def _alltoall(self, buf, counts, name, deadline):
        send = torch.tensor(counts, dtype=torch.int64, device=buf.device)
        recv = torch.empty_like(send)
        self._wait(dist.all_to_all_single(recv, send, group=self._pg, async_op=True), "alltoall", name, deadline)
        rc = [int(c) for c in recv.tolist()]
        out = torch.empty(sum(rc), dtype=buf.dtype, device=buf.device)
        self._wait(dist.all_to_all_single(out, buf, rc, list(counts), group=self._pg, async_op=True),
                   "alltoall", name, deadline)
        return out, rc

    def split(self, ranks: list[int]):
        """A backend over the sub-group ``ranks`` (world ranks); every rank must call it (a new
        torch.distributed group is collective). None on the ranks outside it. Used for process
        sets (hvd_commopt/process_sets.py)."""
        pg = dist.new_group(ranks=list(ranks), backend=self.name)
        if dist.get_rank() not in ranks:
            return None
        sub = copy.copy(self)
        sub._pg, sub._owns_world = pg, False
        return sub

    def barrier(self, name, deadline):
        self._wait(dist.barrier(group=self._pg, async_op=True), "barrier", name, deadline)

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self._pg, r) if r >= 0 else r

    def sendrecv(self, send, dest, source, name, deadline):
        send, dtype = _movable(send)
        return _restore(self._sendrecv(send, dest, source, name, deadline), dtype)

    def _sendrecv(self, send, dest, source, name, deadline):
        ops, n_in = [], torch.zeros(1, dtype=torch.int64, device=send.device)
        dest, source = self._global(dest), self._global(source)
        if dest >= 0:
            send = send.reshape(-1).contiguous()
            ops.append(dist.P2POp(dist.isend, torch.tensor([send.numel()], dtype=torch.int64, device=send.device), dest, group=self._pg))
        if source >= 0:
            ops.append(dist.P2POp(dist.irecv, n_in, source, group=self._pg))
        for w in dist.batch_isend_irecv(ops):
            self._wait(w, "sendrecv", name, deadline)
        ops, out = [], None
        if dest >= 0:
            ops.append(dist.P2POp(dist.isend, send, dest, group=self._pg))
        if source >= 0:
            out = torch.empty(int(n_in.item()), dtype=send.dtype, device=send.device)
            ops.append(dist.P2POp(dist.irecv, out, source, group=self._pg))
        for w in dist.batch_isend_irecv(ops):
            self._wait(w, "sendrecv", name, deadline)
        return out

    def close(self) -> None:
        if getattr(self, "_owns_world", True) and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def register() -> None:
    register_backend("gloo", lambda: TorchDistBackend("gloo"))
    register_backend("nccl", lambda: TorchDistBackend("nccl"))
