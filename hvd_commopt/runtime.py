"""Process-wide runtime: ``init()`` picks a backend and holds the communicator.

The backend follows the tensors (docs/backends.md#choice), decided here and nowhere else, in
order: the ``backend`` argument, ``HVD_COMMOPT_BACKEND``, then

* no launcher -> ``local`` (size 1, no MPI needed, so ``python train.py`` works);
* an adapter whose framework has its own collectives names them (``native``): the torch adapter
  passes ``nccl`` when CUDA is available, else ``gloo``, under every launcher (``mpirun``, our
  launcher, ``torchrun``). With NCCL each rank uses ``cuda:<local rank>``, and two ranks that
  would share a GPU get one error naming the fix when the backend starts
  (docs/backends.md#one-gpu-per-rank); Gloo may share one (docs/backends.md#cuda-on-gloo). Under an MPI launcher MPI stays the control plane (rendezvous, the
  timeout diagnosis naming the missing rank, failure notices: docs/backends.md#control-plane).
  One exception, by measurement: CPU tensors with every rank on one host under an MPI launcher
  take ``mpi`` (shared memory; docs/backends.md#one-host);
* otherwise (TensorFlow, NumPy) ``mpi`` under ``mpirun``/our launcher/``horovodrun``, and
  ``gloo`` under ``torchrun``.

With ``HVD_COMMOPT_VERBOSE`` rank 0 prints the choice and why, once.

With more than one rank, ``init()`` also makes an uncaught exception on any rank end the whole
job within seconds, naming the failed rank on the others (:mod:`hvd_commopt.faults`).
"""
from __future__ import annotations

import atexit
import importlib.util
import threading
from typing import Any, Protocol, runtime_checkable

from . import env, faults, timeline
from .comm import Communicator, create_backend
from .errors import ConfigError, HvdCommoptError, LaunchEnvironmentError

__all__ = ["init", "choose_backend", "backend_name", "shutdown", "is_initialized", "communicator", "rank", "size", "local_rank", "local_size",
           "SplitPlanes"]


@runtime_checkable
class SplitPlanes(Protocol):
    """A backend whose control plane is not its data plane (torch.distributed under mpirun keeps
    MPI for control, and may carry small CPU collectives over it: docs/backends.md#control-plane,
    docs/backends.md#small-on-mpi); the verbose start-up line names both."""

    @property
    def control(self) -> Any:
        """The control plane (it has a ``name``)."""
        ...

    @property
    def mpi_small_bytes(self) -> int:
        """The largest CPU collective (bytes per rank) carried over MPI; 0: none."""
        ...

_lock = threading.Lock()
_comm: Communicator | None = None
_backend: str | None = None  # the backend name init() chose


def choose_backend(launch: env.LaunchInfo, explicit: str | None = None,
                   native: str | None = None) -> tuple[str, str]:
    """(backend name, why): the one place the backend is chosen (see the module docstring)."""
    asked = env.backend_name(explicit)
    if asked:
        how = "init(backend=...)" if explicit else "HVD_COMMOPT_BACKEND"
        return asked, f"asked for by {how}"
    if launch.launcher == "none":
        return "local", "no launcher: one process"
    if native:
        if (native == "gloo" and launch.launcher in ("openmpi", "mpich") and launch.size > 1
                and launch.local_size == launch.size and importlib.util.find_spec("mpi4py") is not None):
            # measured: on one host MPI's shared memory beats Gloo's TCP over loopback (DDP's too)
            return "mpi", (f"CPU tensors with all {launch.size} ranks on one host under {launch.launcher}: "
                           f"MPI's shared memory (docs/backends.md#one-host)")
        return native, f"the tensors' own collectives under {launch.launcher}"
    if launch.launcher == "torchrun":
        return "gloo", "torchrun"
    return "mpi", launch.launcher


def init(backend: str | None = None, timeout_s: float | None = None, *, native: str | None = None) -> Communicator:
    """Initialise once per process (later calls return the same communicator).

    Args:
        backend: "mpi", "gloo", "nccl" or "local"; default: HVD_COMMOPT_BACKEND, else chosen
            from the launcher and ``native`` (module docstring).
        timeout_s: seconds a collective may wait (a number or a ``datetime.timedelta``); default:
            HVD_COMMOPT_TIMEOUT, else 300.
        native: set by an adapter: the backend of its framework's own collectives for the
            tensors it will reduce (torch: "nccl" with CUDA, else "gloo"); None keeps MPI.

    A later call with no arguments, or the same ones, returns the running communicator (as
    Horovod's ``init()`` does, so a library and the script may both call it). A later call asking
    for a *different* backend or timeout raises ConfigError rather than silently keeping the first
    (the user would believe a 5 s timeout is in force) or switching mid-run (collectives already
    queued, and the torch process group, keep the first): call ``shutdown()`` first.

    Raises:
        ConfigError: a bad ``timeout_s`` or ``HVD_COMMOPT_TIMEOUT``, or settings that differ from
            the running ones.
        LaunchEnvironmentError: the launcher's variables disagree with the backend's view of the
            world (for instance ``mpirun -np 2`` with a stale ``WORLD_SIZE=4``).
    """
    global _comm, _backend
    with _lock:
        if _comm is not None:
            _check_same(backend, timeout_s)
            return _comm
        timeout = env.collective_timeout_s(timeout_s)  # checked before any MPI starts
        launch = env.detect_launch()
        name, why = choose_backend(launch, backend, native)
        be = create_backend(name, timeout, chosen=env.backend_name(backend) is None)
        if launch.launcher != "none" and (be.rank, be.size) != (launch.rank, launch.size):
            raise LaunchEnvironmentError(
                f"the {name} backend sees rank {be.rank} of {be.size}, but the {launch.launcher} "
                f"launcher says rank {launch.rank} of {launch.size}. Start every rank with the same "
                f"launcher, or choose the backend matching it with HVD_COMMOPT_BACKEND.")
        if launch.launcher == "none" and name == "local" and be.size != 1:
            raise LaunchEnvironmentError("internal: the local backend must have size 1")
        _comm, _backend = Communicator(be, timeout), name
        if env.verbose() and be.rank == 0:
            plane = ""
            if isinstance(be, SplitPlanes):
                plane = f"; control plane: {be.control.name}" if be.control is not None else ""
                small = be.mpi_small_bytes
                plane += f"; CPU collectives of <= {small} bytes per rank over MPI" if small else ""
            print(f"hvd_commopt: backend {name} ({why}{plane}); {be.size} ranks. Override with "
                  f"HVD_COMMOPT_BACKEND or init(backend=...)", flush=True)
        # atexit runs the last registered first: registered after the backend's own handler, the
        # shutdown drains the queued collectives and closes the backend (the MPI backend's "left"
        # notice must come after all of them) before that handler stops it at exit.
        atexit.unregister(shutdown)
        atexit.register(shutdown)
        if be.size > 1:
            faults.install(lambda: _comm)
        return _comm


def _check_same(backend: str | None, timeout_s) -> None:
    fix = ("init() keeps the first call's settings: pass them to the first init() (or set "
           "HVD_COMMOPT_BACKEND / HVD_COMMOPT_TIMEOUT), or call shutdown() before init() with new ones")
    if timeout_s is not None:
        asked = env.collective_timeout_s(timeout_s)
        if asked != _comm.timeout_s:
            raise ConfigError(f"init(timeout_s={timeout_s!r}) but hvd_commopt is already initialised "
                              f"with timeout_s={_comm.timeout_s:g}; {fix}")
    if backend is not None and backend != _backend:
        raise ConfigError(f"init(backend={backend!r}) but hvd_commopt is already initialised with "
                          f"backend {_backend!r}; {fix}")


def backend_name() -> str | None:
    """The name of the backend init() chose (None before init)."""
    return _backend


def is_initialized() -> bool:
    return _comm is not None


def communicator() -> Communicator:
    if _comm is None:
        raise HvdCommoptError("hvd_commopt is not initialised: call init() first (hco.init() in the adapters)")
    return _comm


def _initialized_for_timeline() -> Communicator:
    """The communicator; Horovod's timeline calls raise ValueError before ``init()``."""
    if _comm is None:
        raise ValueError("hvd_commopt has not been initialized; use hvd.init()")
    return _comm


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's ``start_timeline`` (docs/horovod_api.md#timeline): start recording this
    process's trace. Rank 0 writes ``file_path`` itself (Horovod's one file is its coordinator's);
    rank r > 0 writes ``timeline.rank_path(file_path, r)``. As in Horovod, it needs ``init()``
    and ``HOROVOD_TIMELINE`` (or ``HVD_COMMOPT_TIMELINE``) set, ``DYNAMIC`` to start with no trace.
    ``mark_cycles`` is accepted and has nothing to mark: there is no background negotiation cycle
    here (each collective and step is its own event)."""
    comm = _initialized_for_timeline()
    if not isinstance(file_path, str) or not file_path:
        raise ConfigError(f"start_timeline(file_path=...) takes a file path, got {file_path!r}")
    if not isinstance(mark_cycles, bool):
        raise ConfigError(f"start_timeline(mark_cycles=...) takes True or False, got {mark_cycles!r}")
    if not env.timeline_path():
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC (or HVD_COMMOPT_TIMELINE=DYNAMIC) to enable dynamic "
                         "timeline usage")
    timeline.start(file_path, comm.rank, exact=comm.rank == 0)


def stop_timeline() -> None:
    """Horovod's ``stop_timeline``: stop recording and close the file (nothing if none records)."""
    _initialized_for_timeline()
    timeline.stop()


def shutdown() -> None:
    global _comm, _backend
    with _lock:
        if _comm is not None:
            _comm.shutdown()
            _comm, _backend = None, None


atexit.register(shutdown)


def rank() -> int: return communicator().rank
def size() -> int: return communicator().size
def local_rank() -> int: return communicator().local_rank
def local_size() -> int: return communicator().local_size
