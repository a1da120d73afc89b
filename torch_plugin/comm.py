"""torch.distributed backend (Gloo for CPU tensors, NCCL for CUDA tensors) for the core's Communicator.

Registered with the core as backends ``gloo`` and ``nccl``; :func:`.devices.native_backend` is the torch
adapter's default under every launcher (docs/backends.md#choice): ``nccl`` when CUDA is
available (our group is then ``cpu:gloo,cuda:nccl``, so host buffers still work), else ``gloo``.

Under ``mpirun`` (or our launcher, which runs mpirun) MPI stays the *control plane*
(docs/backends.md#control-plane): it carries the rendezvous (:mod:`torch_plugin.rendezvous`), and
the timeout diagnosis and failure notices of :class:`hvd_commopt.comm.mpi.MPIBackend`, so a
Gloo/NCCL collective that cannot complete still names the rank that is missing. There, when the
runtime chose Gloo, small CPU collectives go over MPI (:mod:`torch_plugin.mpi_lane`,
docs/backends.md#small-on-mpi). Under ``torchrun`` there is no MPI: the rendezvous is torchrun's,
and a timeout says the backend cannot tell which rank.

Every call waits with ``Work.wait(timeout)`` until the communicator's deadline, and the process
group is created with the same timeout: nothing blocks forever.

Transports for particular cases, picked per collective, each live in a module of their own:
:mod:`.pair_sum` (docs/backends.md#pair-sum), :mod:`.mpi_lane` (docs/backends.md#small-on-mpi),
:mod:`.int16_wire` (docs/backends.md#int16-wire), :mod:`.cuda_staging` and :mod:`.staged_collectives`
(docs/backends.md#cuda-on-gloo).
"""
from __future__ import annotations

import copy
import datetime
import time

import numpy as np
import torch
import torch.distributed as dist

from hvd_commopt import env
from hvd_commopt.comm import register_backend
from hvd_commopt.comm.base import Backend
from hvd_commopt.errors import CollectiveTimeoutError, LaunchEnvironmentError, RankFailedError

from . import pair_sum
from .cuda_staging import HostStaging
from .devices import check_one_gpu_per_rank, cuda_device_id, native_backend, rank_cuda_index
from .int16_wire import movable, restore
from .join_follow import ControlPlaneServices, described
from .mpi_lane import MPILane
from .pair_sum import gather_single
from .sendrecv_sized import SizedSendrecv
from .staged_collectives import StagedCollectives, takes as staged
from .rendezvous import control_plane, init_default_group
from .streams import on_collective_stream

__all__ = ["TorchDistBackend", "register", "native_backend"]

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}
# How long a broken connection waits for the control plane's notice naming the peer: a "left"
# notice counts after 1 s (comm/mpi.py's confirmation delay), a "failed" one at once.
_PEER_NOTICE_S = 3.0


class TorchDistBackend(SizedSendrecv, StagedCollectives, ControlPlaneServices, Backend):
    """Collectives on our own torch.distributed group; MPI as control plane when launched by it."""

    buffer_kind = "native"
    starts_on_caller = True  # start_allreduce / start_allgather_equal (docs/backends.md#direct-start)

    def __init__(self, kind: str = "gloo", timeout_s: float | None = None, control=None, chosen: bool = False,
                 mpi_small_bytes: int | None = None):
        """``mpi_small_bytes``: the MPI lane's size (docs/backends.md#small-on-mpi); None reads
        HVD_COMMOPT_MPI_SMALL_BYTES, whose default depends on whether the runtime ``chosen`` Gloo."""
        if kind not in ("gloo", "nccl"):
            raise LaunchEnvironmentError(f"torch.distributed backend {kind!r} unknown; use 'gloo' or 'nccl'")
        if kind == "nccl" and not torch.cuda.is_available():
            raise LaunchEnvironmentError(
                "backend 'nccl' needs CUDA GPUs and a CUDA build of torch, and this process sees none; "
                "choose 'gloo' (CPU tensors, HVD_COMMOPT_BACKEND=gloo) or 'mpi', or install torch with CUDA")
        self.name = kind
        launch = env.detect_launch()
        self._timeout = datetime.timedelta(seconds=env.collective_timeout_s(timeout_s))
        self._control = control if control is not None else control_plane(launch)
        self.follows_joined = self._control is not None  # the control plane reports the peers' positions
        self._own_default = False
        if kind == "nccl":  # cuda:<local rank>, as Horovod's examples set it
            torch.cuda.set_device(rank_cuda_index(launch.local_rank, torch.cuda.device_count()))
        if not dist.is_initialized():
            init_default_group(kind, launch, self._timeout, self._control)
            self._own_default = True
        # Our own group: collectives from our progress thread must never interleave with the
        # user's (or DDP's) on the default group, which could order them differently per rank
        # (seen as a Gloo "received data size doesn't match" when DDP ran beside us). Its timeout
        # is ours, whatever the user's default group has.
        self._pg = dist.new_group(backend="cpu:gloo,cuda:nccl" if kind == "nccl" else kind, timeout=self._timeout)
        # Object exchanges (negotiation rounds) have a group of their own: a rank in one while another
        # is still in a step's bucket waits, where on one group Gloo would abort on the mismatched
        # sizes, and the stall check names the step (docs/horovod_api.md#one-rank-step).
        self._objects = dist.new_group(backend="gloo", timeout=self._timeout) if self._control is not None else self._pg
        self._device = torch.device("cuda", torch.cuda.current_device()) if kind == "nccl" else torch.device("cpu")
        self._local_rank, self._local_size = launch.local_rank, launch.local_size
        if kind == "nccl":  # before any CUDA collective: one error naming the fix, not NCCL's own
            check_one_gpu_per_rank(self._pg, cuda_device_id(self._device.index), kind)
        self._staging = HostStaging()  # CUDA buckets on Gloo (docs/backends.md#cuda-on-gloo)
        # a group's rank and size never change: read once, not per collective (the sparse
        # reducers ask for the size once per bucket and step)
        self._rank, self._size = dist.get_rank(self._pg), dist.get_world_size(self._pg)
        # small CPU collectives over the MPI control plane's transport (docs/backends.md#small-on-mpi)
        self._lane = (MPILane.open(self._control, env.mpi_small_bytes(chosen, mpi_small_bytes))
                      if kind == "gloo" else None)

    @property
    def lane(self) -> MPILane | None:
        """The MPI lane carrying small CPU collectives, or None (docs/backends.md#small-on-mpi)."""
        return self._lane

    @property
    def mpi_small_bytes(self) -> int:
        """The largest CPU collective (bytes per rank) carried over MPI; 0: none
        (docs/backends.md#small-on-mpi)."""
        return self._lane.limit_bytes if self._lane is not None else 0

    def _on_lane(self, op: str, name: str, call, desc=None):
        """Run ``call()``, a blocking collective of the MPI lane, marked on the control plane."""
        self._enter(op, name, desc)
        out = call()
        self._control.leave()
        return out

    @property
    def control(self):
        """The MPI backend carrying diagnosis and failure notices, or None."""
        return self._control

    @property
    def rank(self): return self._rank
    @property
    def size(self): return self._size
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

    def _run(self, op: str, name: str, deadline: float, start, desc=None) -> None:
        """Start one collective (``start()`` returns its Work) and wait for it, marked on the
        control plane so that a peer's question "where are you?" gets this collective (and ``desc``,
        what a joined rank needs to take part: :mod:`.join_follow`)."""
        self._enter(op, name, desc)
        self._finish(start(), op, name, deadline)

    def _finish(self, work, op: str, name: str, deadline: float) -> None:
        """Wait for ``work``, a collective already marked on the control plane, then unmark it."""
        self._wait(work, op, name, deadline)
        self._finish_marked()

    def _finish_marked(self) -> None:
        if self._control is not None:
            self._control.leave()

    def _start_reduce(self, buf, op):
        """(the async work reducing ``buf``, ``done()``: completes it into ``buf`` and returns it).
        A small CPU sum on 2 Gloo ranks is one allgather and a local add (docs/backends.md#pair-sum)."""
        if self.name == "gloo" and pair_sum.takes(buf, op, self.size):
            return pair_sum.start(buf, self._pg)
        return dist.all_reduce(buf, op=_OPS[op], group=self._pg, async_op=True), lambda: buf

    @on_collective_stream  # CUDA: issued and waited for on the collective stream (docs/backends.md#cuda-streams)
    def allreduce_(self, buf, op, name, deadline):
        if self._lane is not None and self._lane.takes_reduce(buf, op):
            return self._on_lane("allreduce", name, lambda: self._lane.allreduce_(buf, op), described(buf, op))
        if self.name == "gloo" and buf.is_cuda and buf.is_contiguous():
            self._enter("allreduce", name, described(buf, op))
            self._staging.allreduce_(buf, op, self._pg, self.size,
                                     lambda w: self._wait(w, "allreduce", name, deadline))
            self._finish_marked()
            return buf
        done = None

        def start():
            nonlocal done
            work, done = self._start_reduce(buf, op)
            return work
        self._run("allreduce", name, deadline, start, described(buf, op))
        return done()

    def _start_on_caller(self, op: str, name: str, deadline: float, work, done):
        """(is_completed, finish) of ``work``, a collective this thread has just started
        (docs/backends.md#direct-start): ``finish()`` waits for it as :meth:`_run` does and returns
        ``done()``."""
        def finish():
            self._finish(work, op, name, deadline)
            return done()
        return work.is_completed, finish

    def _enter(self, op: str, name: str, desc=None) -> None:
        """Mark a collective started on the calling thread on the control plane from its start."""
        if self._control is not None:
            self._control.enter(op, name, desc)

    def start_allreduce(self, buf, op, name, deadline):
        """Start an allreduce on the calling thread (:meth:`_start_on_caller`); ``finish()`` waits
        as :meth:`allreduce_` does and returns ``buf``. None for a CUDA tensor, which keeps the
        progress thread (NCCL's stream semantics are untested here), and for one that the MPI lane
        carries (queued: docs/backends.md#small-on-mpi)."""
        if buf.device.type != "cpu" or (self._lane is not None and self._lane.takes_reduce(buf, op)):
            return None
        self._enter("allreduce", name, described(buf, op))
        work, done = self._start_reduce(buf, op)
        return self._start_on_caller("allreduce", name, deadline, work, done)

    def start_allgather_equal(self, buf, name, deadline):
        """Start an allgather whose every rank sends as many elements as this one (an exact top-k's
        selection, docs/topk.md#equal-sizes) on the calling thread (:meth:`_start_on_caller`);
        ``finish()`` gives what :meth:`allgather_equal` gives. None for a CUDA tensor, and for one
        that the MPI lane carries."""
        if buf.device.type != "cpu" or (self._lane is not None and self._lane.takes_gather(buf)):
            return None
        gather, done = self._gather_equal(buf)
        self._enter("allgather", name, described(buf, True))
        return self._start_on_caller("allgather", name, deadline, gather(), done)

    @on_collective_stream  # CUDA: issued and waited for on the collective stream (docs/backends.md#cuda-streams)
    def allgather(self, buf, name, deadline, op="allgather", pg=None):
        lane, desc = (self._lane if buf.device.type == "cpu" and pg is None else None), described(buf, False)
        pg = self._pg if pg is None else pg
        if lane is not None:
            # the sizes over MPI; the largest decides the data's transport alike on every rank
            counts = self._on_lane(op, name, lambda: lane.counts(buf.numel()), desc)
            if lane.takes_sizes(counts, buf.element_size()):
                return self._on_lane(op, name, lambda: lane.allgatherv(buf, counts)), counts
        if staged(self.name, buf) and pg is self._pg:  # pinned host staging (docs/backends.md#cuda-on-gloo)
            return self._staged_allgather(buf, name, deadline, op, desc)
        buf, dtype = movable(buf.reshape(-1))
        if lane is None:
            n = torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device)
            counts = [torch.zeros_like(n) for _ in range(self.size)]
            self._run(op, name, deadline, lambda: dist.all_gather(counts, n, group=pg, async_op=True), desc)
            counts = [int(c) for c in torch.cat(counts).tolist()]  # one device sync, not one per rank
        # each rank's part padded to the largest
        m = max(counts)
        if buf.numel() == m:
            padded = buf.contiguous()
        else:
            padded = torch.zeros(m, dtype=buf.dtype, device=buf.device)
            padded[: buf.numel()] = buf
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._run(op, name, deadline, lambda: dist.all_gather(parts, padded, group=pg, async_op=True))
        if all(c == m for c in counts):
            return restore(torch.cat(parts), dtype), counts
        return restore(torch.cat([p[:c] for p, c in zip(parts, counts)]), dtype), counts

    @on_collective_stream  # CUDA: issued and waited for on the collective stream (docs/backends.md#cuda-streams)
    def allgather_equal(self, buf, name, deadline):
        # one collective: the caller promised every rank's size (docs/topk.md#equal-sizes)
        if self._lane is not None and self._lane.takes_gather(buf):
            return self._on_lane("allgather", name, lambda: self._lane.allgather_equal(buf), described(buf, True))
        gather, done = self._gather_equal(buf)
        self._run("allgather", name, deadline, gather, described(buf, True))
        return done()

    def _gather_equal(self, buf):
        """(``gather()``: starts the allgather of ``buf`` whose every rank sends as many elements,
        into one buffer, and returns its Work; ``done()``: (the gathered buffer, counts))."""
        wire, dtype = movable(buf.reshape(-1))
        wire, counts = wire.contiguous(), [wire.numel()] * self.size
        if self.name == "gloo" and wire.is_cuda:  # pinned host staging (docs/backends.md#cuda-on-gloo)
            return self._staging.gather_equal(wire, self.size, self._pg, lambda out: (restore(out, dtype), counts))
        out = torch.empty(self.size * wire.numel(), dtype=wire.dtype, device=wire.device)
        return (lambda: gather_single(out, wire, group=self._pg, async_op=True),
                lambda: (restore(out, dtype), counts))

    def allgather_host(self, data: np.ndarray, name, deadline):
        # host bytes on a Gloo group of their own (docs/horovod_api.md#one-rank-step)
        out, counts = self.allgather(torch.from_numpy(data.copy()), name, deadline, "allgather_object", self._objects)
        return out.numpy(), counts

    @on_collective_stream  # CUDA: issued and waited for on the collective stream (docs/backends.md#cuda-streams)
    def broadcast_(self, buf, root, name, deadline):
        wire, _ = movable(buf)  # a view: the broadcast lands in buf
        src = dist.get_global_rank(self._pg, root)
        self._run("broadcast", name, deadline, lambda: dist.broadcast(wire, src=src, group=self._pg, async_op=True),
                  described(buf, root))
        return buf

    @on_collective_stream  # CUDA: issued and waited for on the collective stream (docs/backends.md#cuda-streams)
    def alltoall(self, buf, counts, name, deadline):
        buf, dtype = movable(buf.reshape(-1).contiguous())
        out, rc = self._alltoall(buf, counts, name, deadline)
        return restore(out, dtype), rc

    def _alltoall(self, buf, counts, name, deadline):
        send = torch.tensor(counts, dtype=torch.int64, device=buf.device)
        recv = torch.empty_like(send)
        self._run("alltoall", name, deadline, lambda: dist.all_to_all_single(recv, send, group=self._pg, async_op=True),
                  described(buf, None))
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
        objects = dist.new_group(ranks=list(ranks), backend="gloo", timeout=self._timeout) if self._control else pg
        if dist.get_rank() not in ranks:
            return None
        sub = copy.copy(self)
        sub._pg, sub._objects, sub._owns_world = pg, objects, False
        sub._rank, sub._size = dist.get_rank(pg), dist.get_world_size(pg)  # the set's, not the world's
        sub._lane, sub.follows_joined = None, False  # the lane and the positions span the world
        return sub

    def barrier(self, name, deadline):
        # a CPU tensor allreduce, not dist.barrier: NCCL's barrier guesses a device per rank
        t = torch.zeros(1)
        self._run("barrier", name, deadline, lambda: dist.all_reduce(t, group=self._pg, async_op=True), ())

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self._pg, r) if r >= 0 else r

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
            if self._objects is not self._pg:
                dist.destroy_process_group(self._objects)
            if self._own_default:
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def register() -> None:
    register_backend("gloo", lambda timeout_s=None, chosen=False: TorchDistBackend("gloo", timeout_s, chosen=chosen))
    register_backend("nccl", lambda timeout_s=None, chosen=False: TorchDistBackend("nccl", timeout_s, chosen=chosen))
