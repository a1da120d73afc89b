"""Rendezvous of torch.distributed's default group, and the MPI control plane beside it.

Under ``mpirun`` (or our launcher, which runs mpirun) MPI is the control plane
(docs/backends.md#control-plane): rank 0 opens a TCPStore on a free port and broadcasts its
address over MPI when MASTER_ADDR/MASTER_PORT are absent, and every rank binds Gloo to the
interface through which it reaches rank 0. Under ``torchrun`` the rendezvous is torchrun's.
"""
from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct

import torch.distributed as dist

from hvd_commopt import env
from hvd_commopt.errors import LaunchEnvironmentError

__all__ = ["control_plane", "init_default_group"]

_MPI_LAUNCHERS = ("openmpi", "mpich")


def control_plane(launch: env.LaunchInfo):
    """The MPI backend used as control plane under an MPI launcher (None elsewhere, or without
    mpi4py when torch's variables make the rendezvous possible without it)."""
    if launch.launcher not in _MPI_LAUNCHERS or launch.size == 1:
        return None
    try:
        from hvd_commopt.comm.mpi import MPIBackend
        return MPIBackend()
    except LaunchEnvironmentError:
        if env.torch_rendezvous_vars():
            return None  # the data plane can start; timeouts then cannot name the missing rank
        raise LaunchEnvironmentError(
            "this job runs under mpirun, and torch.distributed's rendezvous needs mpi4py there (rank 0 "
            "shares its address over MPI): pip install mpi4py, or export MASTER_ADDR and MASTER_PORT "
            "(rank 0's address and a free port), or launch with torchrun") from None


def _if_addrs():
    """(interface name, IPv4 address) of each local interface that has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            yield name, socket.inet_ntoa(raw[20:24])


def _ifname_of(ip: str) -> str | None:
    """Name of the local interface holding IPv4 address ``ip`` (Gloo binds by interface name)."""
    return next((name for name, addr in _if_addrs() if addr == ip), None)


def _route_source(dest: str) -> str:
    """The local address the kernel would use to reach ``dest`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((dest, 9))
        return s.getsockname()[0]


def _my_ips() -> list[str]:
    """This host's IPv4 addresses other than loopback (how peers may reach it)."""
    return [addr for _, addr in _if_addrs() if not addr.startswith("127.")]


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
    if env.gloo_socket_ifname() is None:
        name = "lo" if addr[0].startswith("127.") else _ifname_of(_route_source(addr[0]))
        if name:
            # a write, not a read: Gloo takes its interface from this variable when the process
            # group is created below, and offers no argument for it
            os.environ["GLOO_SOCKET_IFNAME"] = name
    return store


def init_default_group(kind: str, launch: env.LaunchInfo, timeout: datetime.timedelta, control) -> None:
    spec = "cpu:gloo,cuda:nccl" if kind == "nccl" else kind
    if env.torch_rendezvous_vars():
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
