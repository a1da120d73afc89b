"""torch.distributed backend (Gloo for CPU tensors, NCCL for CUDA tensors) for the core's Communicator.

Registered with the core as backends ``gloo`` and ``nccl``; :func:`native_backend` is the torch
adapter's default under every launcher (docs/backends.md#choice): ``nccl`` when CUDA is
available (our group is then ``cpu:gloo,cuda:nccl``, so host buffers still work), else ``gloo``.

Under ``mpirun`` (or our launcher, which runs mpirun) MPI stays the *control plane*
(docs/backends.md#control-plane): it carries the rendezvous (rank 0 opens a TCPStore on a free
port and broadcasts its address when MASTER_ADDR/MASTER_PORT are absent), and the timeout
diagnosis and failure notices of :class:`hvd_commopt.comm.mpi.MPIBackend`, so a Gloo/NCCL
collective that cannot complete still names the rank that is missing. Under ``torchrun`` there
is no MPI: the rendezvous is torchrun's, and a timeout says the backend cannot tell which rank.

Every call waits with ``Work.wait(timeout)`` until the communicator's deadline, and the process
group itself is created with the same timeout, so nothing blocks forever.
"""
from __future__ import annotations

import copy
import datetime
import fcntl
import os
import socket
import struct
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from hvd_commopt import env
from hvd_commopt.comm import register_backend
from hvd_commopt.comm.base import Backend
from hvd_commopt.errors import CollectiveTimeoutError, LaunchEnvironmentError, RankFailedError

__all__ = ["TorchDistBackend", "register", "native_backend"]

# Gloo moves no int16 ("Invalid scalar type"): collectives that only move data (allgather,
# broadcast, alltoall, sendrecv) carry such buffers as float16 of the same bits; the core
# reduces small integers in int32 on native backends.
_MOVE_AS = {torch.int16: torch.float16}


def _movable(t):
    alias = _MOVE_AS.get(t.dtype)
    return (t, None) if alias is None else (t.view(alias), t.dtype)


def _restore(t, dtype):
    return t if dtype is None or t is None else t.view(dtype)


def _sleeper(work, mode: str):
    """``sleep(seconds) -> bool`` for a direct collective's waiter (docs/backends.md#direct-start),
    or None (the waiter polls):

    * "block": ``Work.wait`` bounded by the slice, the GIL released. A wait that runs out raises
      "Operation timed out!" and leaves the work running, so the next slice waits again; an error
      of the work itself (a peer's connection closed, Gloo's own timeout) completes the work, and
      the handle's bounded wait reports it.
    * "event": an event the work's future sets when it ends, with or without an error (on the
      backend's thread, which needs the GIL for it); None where the work has no future.
    """
    if mode == "block":
        def block(seconds: float) -> bool:
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(seconds, 0.001)))
            except RuntimeError:
                return bool(work.is_completed())
            return True
        return block
    if mode == "event":
        ready = threading.Event()
        try:
            work.get_future().add_done_callback(lambda _f: ready.set())
        except (RuntimeError, AttributeError):
            return None
        return ready.wait
    return None


# At 2 ranks a small sum is exchanged by one allgather and added locally: a + b is the same bits
# in either order, the bytes are the ring allreduce's, and Gloo's allreduce of 48 KB took 1.5-2.9 ms
# on the emulated links where the allgather took 0.55-0.8 ms (docs/backends.md#pair-sum).
PAIR_SUM_MAX_BYTES = 64 * 1024
_PAIR_SUM_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8)
# newer torch deprecates all_gather_into_tensor in favour of all_gather_single (same call)
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}
_MPI_LAUNCHERS = ("openmpi", "mpich")
# How long a broken connection waits for the control plane's notice naming the peer: a "left"
# notice counts after 1 s (comm/mpi.py's confirmation delay), a "failed" one at once.
_PEER_NOTICE_S = 3.0


def native_backend() -> str:
    """The torch.distributed backend for this process's tensors: ``nccl`` with CUDA, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _control_plane(launch: env.LaunchInfo):
    """The MPI backend used as control plane under an MPI launcher (None elsewhere, or without
    mpi4py when torch's variables make the rendezvous possible without it)."""
    if launch.launcher not in _MPI_LAUNCHERS or launch.size == 1:
        return None
    try:
        from hvd_commopt.comm.mpi import MPIBackend
        return MPIBackend()
    except LaunchEnvironmentError:
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            return None  # the data plane can start; timeouts then cannot name the missing rank
        raise LaunchEnvironmentError(
            "this job runs under mpirun, and torch.distributed's rendezvous needs mpi4py there (rank 0 "
            "shares its address over MPI): pip install mpi4py, or export MASTER_ADDR and MASTER_PORT "
            "(rank 0's address and a free port), or launch with torchrun") from None


def _ifname_of(ip: str) -> str | None:
    """Name of the local interface holding IPv4 address ``ip`` (Gloo binds by interface name)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


def _route_source(dest: str) -> str:
    """The local address the kernel would use to reach ``dest`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((dest, 9))
        return s.getsockname()[0]


def _my_ips() -> list[str]:
    """This host's IPv4 addresses other than loopback (how peers may reach it)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            ip = socket.inet_ntoa(raw[20:24])
            if not ip.startswith("127."):
                out.append(ip)
    return out


def _mpi_rendezvous(launch: env.LaunchInfo, timeout: datetime.timedelta):
    """A TCPStore for init_process_group, its address found over MPI.

    All ranks on one host (local size == size): loopback. Otherwise rank 0 picks, for rank 1's
    first address, the local address its route uses (what the others can reach), so it works
    across hosts and across the emulated hosts' namespaces; every rank binds Gloo to the
    interface it reaches rank 0 through (unless GLOO_SOCKET_IFNAME is set)."""
    from hvd_commopt.comm.mpi import import_mpi
    world = import_mpi().COMM_WORLD
    ips = world.allgather(_my_ips())
    host = None
    if launch.rank == 0:
        single = launch.local_size == launch.size or not ips[1]
        host = "127.0.0.1" if single else _route_source(ips[1][0])
        store = dist.TCPStore(host, 0, launch.size, True, timeout=timeout, wait_for_workers=False)
        addr = (host, store.port)
    addr = world.bcast(addr if launch.rank == 0 else None, root=0)
    if launch.rank != 0:
        store = dist.TCPStore(addr[0], addr[1], launch.size, False, timeout=timeout)
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        name = "lo" if addr[0].startswith("127.") else _ifname_of(_route_source(addr[0]))
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    return store


def _init_default_group(kind: str, launch: env.LaunchInfo, timeout: datetime.timedelta, control) -> None:
    spec = "cpu:gloo,cuda:nccl" if kind == "nccl" else kind
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        dist.init_process_group(spec, init_method="env://", rank=launch.rank, world_size=launch.size, timeout=timeout)
        return
    if control is not None:
        store = _mpi_rendezvous(launch, timeout)
    elif launch.size == 1:
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout)
    else:
        raise LaunchEnvironmentError("torch.distributed needs MASTER_ADDR and MASTER_PORT (torchrun sets "
                                     "them), or launch with mpirun so rank 0 can share its address")
    dist.init_process_group(spec, store=store, rank=launch.rank, world_size=launch.size, timeout=timeout)


class TorchDistBackend(Backend):
    """Collectives on our own torch.distributed group; MPI as control plane when launched by it."""

    buffer_kind = "native"

    def __init__(self, kind: str = "gloo", timeout_s: float | None = None, control=None):
        if kind not in ("gloo", "nccl"):
            raise LaunchEnvironmentError(f"torch.distributed backend {kind!r} unknown; use 'gloo' or 'nccl'")
        if kind == "nccl" and not torch.cuda.is_available():
            raise LaunchEnvironmentError(
                "backend 'nccl' needs CUDA GPUs and a CUDA build of torch, and this process sees none; "
                "choose 'gloo' (CPU tensors, HVD_COMMOPT_BACKEND=gloo) or 'mpi', or install torch with CUDA")
        self.name = kind
        launch = env.detect_launch()
        self._timeout = datetime.timedelta(seconds=env.collective_timeout_s(timeout_s))
        self._control = control if control is not None else _control_plane(launch)
        self._own_default = False
        if kind == "nccl":
            torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        if not dist.is_initialized():
            _init_default_group(kind, launch, self._timeout, self._control)
            self._own_default = True
        # Our own group: collectives from our progress thread must never interleave with the
        # user's (or DDP's) on the default group, which could order them differently per rank
        # (seen as a Gloo "received data size doesn't match" when DDP ran beside us). Its timeout
        # is ours, whatever the user's default group has.
        self._pg = dist.new_group(backend="cpu:gloo,cuda:nccl" if kind == "nccl" else kind, timeout=self._timeout)
        self._device = torch.device("cuda", torch.cuda.current_device()) if kind == "nccl" else torch.device("cpu")
        self._local_rank, self._local_size = launch.local_rank, launch.local_size

    @property
    def control(self):
        """The MPI backend carrying diagnosis and failure notices, or None."""
        return self._control

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
            text = str(e).lower()
            if "timed out" not in text and "timeout" not in text:
                self._raise_peer_failure(op, name, e)
                raise
            missing, detail = None, f"the {self.name} backend cannot tell which rank is missing"
            if self._control is not None:
                missing, detail = self._control.diagnose()
            raise CollectiveTimeoutError(
                f"rank {self.rank}: {op} '{name}' did not complete within {self._timeout.total_seconds():g} s; "
                f"{detail}. Ranks must run the same collectives in the same order: a rank skipped a step, "
                f"raised an error, or its model or data differ. Raise HVD_COMMOPT_TIMEOUT (or timeout_s) "
                f"if the job is only slow. (backend {self.name})", op=op, name=name, missing_ranks=missing) from None

    def _raise_peer_failure(self, op: str, name: str, err: BaseException) -> None:
        """A Gloo/NCCL error other than a timeout (a peer's connection closed): when the control
        plane hears within a few seconds that a peer failed or left, name that rank instead."""
        if self._control is None:
            return
        end = time.monotonic() + _PEER_NOTICE_S
        while time.monotonic() < end:
            failed = self._control.peer_failure()
            if failed is not None:
                raise RankFailedError(f"rank {self.rank}: {op} '{name}' cannot complete: {failed[1]}",
                                      failed_rank=failed[0], op=op, name=name) from err
            time.sleep(0.1)

    def _run(self, op: str, name: str, deadline: float, start) -> None:
        """Start one collective (``start()`` returns its Work) and wait for it, marked on the
        control plane so that a peer's question "where are you?" gets this collective."""
        self._enter(op, name)
        self._finish(start(), op, name, deadline)

    def _finish(self, work, op: str, name: str, deadline: float) -> None:
        """Wait for ``work``, a collective already marked on the control plane, then unmark it."""
        self._wait(work, op, name, deadline)
        if self._control is not None:
            self._control.leave()

    #: the largest sum (bytes) a 2-rank Gloo group exchanges by allgather (0: never; the
    #: benchmarks compare the two)
    pair_sum_max_bytes = PAIR_SUM_MAX_BYTES

    def _pair_sum(self, buf, op) -> bool:
        """Whether this reduction is a small CPU sum on 2 ranks, which an allgather and a local add
        replace (docs/backends.md#pair-sum). Every rank decides alike: the size, dtype and op are
        the same everywhere."""
        return (op == "sum" and self.name == "gloo" and buf.device.type == "cpu" and buf.dtype in _PAIR_SUM_DTYPES
                and buf.numel() * buf.element_size() <= self.pair_sum_max_bytes and buf.is_contiguous()
                and self.size == 2)

    def _start_reduce(self, buf, op):
        """(the async work reducing ``buf``, ``done()``: completes it into ``buf`` and returns it)."""
        if not self._pair_sum(buf, op):
            return dist.all_reduce(buf, op=_OPS[op], group=self._pg, async_op=True), lambda: buf
        n, flat = buf.numel(), buf.reshape(-1)
        both = torch.empty(2 * n, dtype=buf.dtype)
        work = _gather_single(both, flat, group=self._pg, async_op=True)
        # rank 0's part first on both ranks: the same sum, bit for bit, as the allreduce's
        return work, lambda: (torch.add(both[:n], both[n:], out=flat), buf)[1]

    def allreduce_(self, buf, op, name, deadline):
        done = None

        def start():
            nonlocal done
            work, done = self._start_reduce(buf, op)
            return work
        self._run("allreduce", name, deadline, start)
        return done()

    def _start_on_caller(self, op: str, name: str, deadline: float, work, done):
        """(is_completed, finish, sleeper) of ``work``, a collective this thread has just started
        (docs/backends.md#direct-start): ``finish()`` waits for it as :meth:`_run` does and returns
        ``done()``; ``sleeper(mode)`` is :func:`_sleeper` of the work, asked for only by a waiter
        that does not poll."""
        def finish():
            self._finish(work, op, name, deadline)
            return done()
        return work.is_completed, finish, lambda mode: _sleeper(work, mode)

    def _enter(self, op: str, name: str) -> None:
        """Mark a collective started on the calling thread on the control plane from its start."""
        if self._control is not None:
            self._control.enter(op, name)

    def start_allreduce(self, buf, op, name, deadline):
        """Start an allreduce on the calling thread (:meth:`_start_on_caller`); ``finish()`` waits
        as :meth:`allreduce_` does and returns ``buf``. None for a CUDA tensor, which keeps the
        progress thread (NCCL's stream semantics are untested here)."""
        if buf.device.type != "cpu":
            return None
        self._enter("allreduce", name)
        work, done = self._start_reduce(buf, op)
        return self._start_on_caller("allreduce", name, deadline, work, done)

    def start_allgather_equal(self, buf, name, deadline):
        """Start an allgather whose every rank sends as many elements as this one (an exact top-k's
        selection, docs/topk.md#equal-sizes) on the calling thread (:meth:`_start_on_caller`);
        ``finish()`` gives what :meth:`allgather_equal` gives. None for a CUDA tensor."""
        if buf.device.type != "cpu":
            return None
        gather, done = self._gather_equal(buf)
        self._enter("allgather", name)
        return self._start_on_caller("allgather", name, deadline, gather(), done)

    def allgather(self, buf, name, deadline):
        buf, dtype = _movable(buf.reshape(-1))
        n = torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device)
        counts = [torch.zeros_like(n) for _ in range(self.size)]
        self._run("allgather", name, deadline, lambda: dist.all_gather(counts, n, group=self._pg, async_op=True))
        counts = [int(c) for c in torch.cat(counts).tolist()]  # one device sync, not one per rank
        m = max(counts)
        if buf.numel() == m:
            padded = buf.contiguous()
        else:
            padded = torch.zeros(m, dtype=buf.dtype, device=buf.device)
            padded[: buf.numel()] = buf
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._run("allgather", name, deadline, lambda: dist.all_gather(parts, padded, group=self._pg, async_op=True))
        if all(c == m for c in counts):
            return _restore(torch.cat(parts), dtype), counts
        return _restore(torch.cat([p[:c] for p, c in zip(parts, counts)]), dtype), counts

    def allgather_equal(self, buf, name, deadline):
        # one Gloo/NCCL collective: the caller promised every rank's size (docs/topk.md#equal-sizes)
        gather, done = self._gather_equal(buf)
        self._run("allgather", name, deadline, gather)
        return done()

    def _gather_equal(self, buf):
        """(``gather()``: starts the allgather of ``buf`` whose every rank sends as many elements,
        into one buffer, and returns its Work; ``done()``: (the gathered buffer, counts))."""
        wire, dtype = _movable(buf.reshape(-1))
        wire = wire.contiguous()
        out = torch.empty(self.size * wire.numel(), dtype=wire.dtype, device=wire.device)
        counts = [wire.numel()] * self.size
        return (lambda: _gather_single(out, wire, group=self._pg, async_op=True),
                lambda: (_restore(out, dtype), counts))

    def allgather_host(self, data: np.ndarray, name, deadline):
        # our group has Gloo for CPU tensors in both modes: host bytes stay on the host
        out, counts = self.allgather(torch.from_numpy(data.copy()), name, deadline)
        return out.numpy(), counts

    def broadcast_(self, buf, root, name, deadline):
        wire, _ = _movable(buf)  # a view: the broadcast lands in buf
        src = dist.get_global_rank(self._pg, root)
        self._run("broadcast", name, deadline, lambda: dist.broadcast(wire, src=src, group=self._pg, async_op=True))
        return buf

    def alltoall(self, buf, counts, name, deadline):
        buf, dtype = _movable(buf.reshape(-1).contiguous())
        out, rc = self._alltoall(buf, counts, name, deadline)
        return _restore(out, dtype), rc

    def _alltoall(self, buf, counts, name, deadline):
        send = torch.tensor(counts, dtype=torch.int64, device=buf.device)
        recv = torch.empty_like(send)
        self._run("alltoall", name, deadline, lambda: dist.all_to_all_single(recv, send, group=self._pg, async_op=True))
        rc = [int(c) for c in recv.tolist()]
        out = torch.empty(sum(rc), dtype=buf.dtype, device=buf.device)
        self._run("alltoall", name, deadline,
                  lambda: dist.all_to_all_single(out, buf, rc, list(counts), group=self._pg, async_op=True))
        return out, rc

    def split(self, ranks: list[int]):
        """A backend over the sub-group ``ranks`` (world ranks); every rank must call it (a new
        torch.distributed group is collective). None on the ranks outside it. Used for process
        sets (hvd_commopt/process_sets.py)."""
        pg = dist.new_group(ranks=list(ranks), backend=self.name, timeout=self._timeout)
        if dist.get_rank() not in ranks:
            return None
        sub = copy.copy(self)
        sub._pg, sub._owns_world = pg, False
        return sub

    def barrier(self, name, deadline):
        # a CPU tensor allreduce, not dist.barrier: NCCL's barrier guesses a device per rank
        t = torch.zeros(1)
        self._run("barrier", name, deadline, lambda: dist.all_reduce(t, group=self._pg, async_op=True))

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self._pg, r) if r >= 0 else r

    def sendrecv(self, send, dest, source, name, deadline):
        send, dtype = _movable(send)
        c = self._control
        if c is not None:
            c.enter("sendrecv", name)
        out = self._sendrecv(send, dest, source, name, deadline)
        if c is not None:
            c.leave()
        return _restore(out, dtype)

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

    # -- the control plane's services (no-ops without one, as in the base class) -------------------
    def diagnose(self):
        if self._control is not None:
            return self._control.diagnose()
        return super().diagnose()

    def peer_failure(self):
        return self._control.peer_failure() if self._control is not None else None

    def announce_failure(self, text: str) -> None:
        if self._control is not None:
            self._control.announce_failure(text)

    def abort_job(self, code: int) -> None:
        if self._control is not None:
            self._control.abort_job(code)  # MPI_Abort: mpirun ends every rank
        super().abort_job(code)

    def close(self) -> None:
        if not getattr(self, "_owns_world", True):
            return  # a process set's view of the world backend: that one closes the groups
        if self._control is not None:
            self._control.close()  # the "left" notice: a peer waiting for us stops waiting
        if not dist.is_initialized():
            return
        try:
            dist.destroy_process_group(self._pg)
            if self._own_default:
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def register() -> None:
    register_backend("gloo", lambda timeout_s=None: TorchDistBackend("gloo", timeout_s))
    register_backend("nccl", lambda timeout_s=None: TorchDistBackend("nccl", timeout_s))
