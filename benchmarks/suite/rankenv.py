"""What every benchmark rank sets up: our runtime, a Gloo group for DDP, link counters, progress.

Why one place: the throughput and time-to-accuracy workers must start the same way inside the
emulated hosts (one thread per rank, our default backend, Gloo for DDP rendezvousing at the
address the launcher passes), and read the same byte counters.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RankEnv", "setup", "link_counter"]


def link_counter() -> tuple[str, Path | None]:
    """(interface, tx_bytes file) of this rank's emulated link: ``veth0`` inside a netemu host
    (``ip netns exec`` mounts the namespace's own /sys), else ``lo``, which on loopback is shared
    by all ranks and any other local traffic."""
    for dev in ("veth0", "lo"):
        p = Path(f"/sys/class/net/{dev}/statistics/tx_bytes")
        if p.exists():
            return dev, p
    return "none", None


@dataclass
class RankEnv:
    """Handles for one rank of a benchmark job."""

    rank: int
    size: int
    comm: Any
    backend: str
    mpi_library: str
    ddp_group: Any
    iface: str
    _tx: Path | None
    progress_path: str | None

    def tx_bytes(self) -> int:
        return int(self._tx.read_text()) if self._tx is not None else 0

    def new_gloo_group(self) -> Any:
        """A fresh Gloo process group over all ranks (every rank must call it, in the same order)."""
        import torch.distributed as dist
        return dist.new_group(backend="gloo")

    def barrier(self) -> None:
        self.comm.barrier()

    def gloo_comm(self) -> Any:
        """Our Communicator over torch.distributed's default (Gloo) group, created on first use."""
        if not hasattr(self, "_gloo"):
            self._gloo = self.comm if self.backend == "gloo" else self.fresh_comm(lane=False)
        return self._gloo

    def fresh_comm(self, lane: bool = True) -> Any:
        """A new Communicator of ours on a Gloo group of its own (every rank calls it in the same order),
        set up as the runtime's: with the MPI lane unless the job named its backend, or never where
        ``lane`` is False (a variant pinned to Gloo, the *_nolane A/Bs, docs/backends.md#small-on-mpi)."""
        from hvd_commopt import env
        from hvd_commopt.comm import Communicator
        from torch_plugin.comm import TorchDistBackend
        backend = TorchDistBackend("gloo", chosen=lane and env.backend_name() is None,
                                   mpi_small_bytes=None if lane else 0)
        return Communicator(backend, timeout_s=600)

    def backend_comm(self, name: str) -> Any:
        """Our Communicator on backend ``name`` ("mpi" or "gloo"): the runtime's when it is that
        backend, else one made on first use (every rank calls it in the same order)."""
        if name == self.backend:
            return self.comm
        if name == "gloo":
            return self.gloo_comm()
        if not hasattr(self, "_mpi"):
            from hvd_commopt.comm import Communicator
            from hvd_commopt.comm.mpi import MPIBackend
            self._mpi = Communicator(MPIBackend(), timeout_s=600)
        return self._mpi

    def progress(self, **kw: Any) -> None:
        """Rank 0 appends one JSON line for the launcher's progress bar."""
        if self.rank == 0 and self.progress_path:
            with open(self.progress_path, "a") as f:
                f.write(json.dumps({"t": time.time(), **kw}) + "\n")

    def max_over_ranks(self, value: Any) -> Any:
        return max(self.comm.allgather_object(value))

    def gather(self, value: Any) -> list[Any]:
        return self.comm.allgather_object(value)


def setup(progress_path: str | None = None) -> RankEnv:
    """Initialise our runtime (the default backend, HVD_COMMOPT_BACKEND honoured) and a separate
    Gloo group for DDP, so DDP's collectives never interleave with ours on one group."""
    import torch
    import torch.distributed as dist

    import torch_plugin as hco
    torch.set_num_threads(1)
    comm = hco.init()
    backend = type(comm.backend).__name__
    backend = "gloo" if "Torch" in backend else ("mpi" if "MPI" in backend else backend)
    mpi_lib = "n/a"
    try:
        from mpi4py import MPI
        mpi_lib = MPI.Get_library_version().strip().splitlines()[0].strip()
        mpi_lib = " ".join(mpi_lib.replace("Version:", "").split()).split(", package")[0]
    except Exception:  # noqa: BLE001 - informational only
        pass
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError("the benchmark launcher must pass MASTER_ADDR/MASTER_PORT for Gloo (DDP)")
        dist.init_process_group("gloo", init_method="env://", rank=comm.rank, world_size=comm.size)
    ddp_group = dist.new_group(backend="gloo")
    iface, tx = link_counter()
    return RankEnv(comm.rank, comm.size, comm, backend, mpi_lib, ddp_group, iface, tx, progress_path)
