#!/usr/bin/env python3
"""Tiny bandwidth probes run *inside* the emulated hosts by ``benchmarks/netemu.py``.

Each mode prints one JSON line (rank 0 / the receiver only) so the launcher can parse it:

* ``mpi-allreduce``: float32 SUM allreduce of ``--bytes`` (mpi4py), timed reps with a barrier
  before each; reports the total time and ``busbw = bytes/t * 2(n-1)/n`` (nccl-tests convention;
  for 2 ranks that is the bytes each rank sent per second, i.e. the load on each link direction).
* ``sock-server`` / ``sock-client``: one TCP stream, client -> server, for ``--seconds``; the
  server times first byte to EOF (receiver-side goodput, immune to socket-buffer fill).

Why a separate file: the launcher must start these as fresh processes inside the network
namespaces (under mpirun, or via ``ip netns exec``), so they cannot be functions of netemu.py.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time


def mpi_allreduce(nbytes: int, reps: int, warmup: int) -> None:
    """Time ``reps`` allreduces of ``nbytes`` and print a JSON summary on rank 0."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    sbuf = np.ones(max(1, nbytes // 4), dtype=np.float32)
    rbuf = np.empty_like(sbuf)
    for _ in range(warmup):
        comm.Allreduce(sbuf, rbuf, op=MPI.SUM)
    times = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(sbuf, rbuf, op=MPI.SUM)
        times.append(time.perf_counter() - t0)
    ok = bool(rbuf[0] == n and rbuf[-1] == n)
    tmax = comm.allreduce(sum(times), op=MPI.MAX)
    if comm.Get_rank() == 0:
        size = sbuf.nbytes
        busbw = size * reps / tmax * 2 * (n - 1) / n * 8 / 1e9
        print(json.dumps({
            "mode": "mpi-allreduce", "ranks": n, "bytes": size, "reps": reps,
            "warmup": warmup, "seconds": tmax, "busbw_gbit": busbw, "correct": ok,
            "mpi": MPI.Get_library_version().splitlines()[0].strip().rstrip("\x00"),
        }), flush=True)


def sock_server(bind: str, port: int, timeout: float) -> None:
    """Accept one connection, read to EOF, print received bytes and first-byte-to-EOF time."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, port))
    srv.listen(1)
    srv.settimeout(timeout)
    print(json.dumps({"mode": "sock-server", "listening": f"{bind}:{port}"}), file=sys.stderr, flush=True)
    conn, _ = srv.accept()
    conn.settimeout(timeout)
    buf = bytearray(1 << 20)
    total, t0 = 0, None
    while True:
        k = conn.recv_into(buf)
        if k == 0:
            break
        if t0 is None:
            t0 = time.perf_counter()
        total += k
    t1 = time.perf_counter()
    conn.close()
    srv.close()
    secs = (t1 - t0) if t0 is not None else 0.0
    print(json.dumps({"mode": "sock-stream", "bytes": total, "seconds": secs,
                      "gbit": total * 8 / secs / 1e9 if secs > 0 else 0.0}), flush=True)


def sock_client(host: str, port: int, seconds: float, connect_timeout: float) -> None:
    """Connect (retrying until the server listens) and send zeros for ``seconds``."""
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = bytes(1 << 20)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sock.sendall(payload)
    sock.shutdown(socket.SHUT_WR)
    sock.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("mpi-allreduce")
    m.add_argument("--bytes", type=int, default=4 << 20)
    m.add_argument("--reps", type=int, default=5)
    m.add_argument("--warmup", type=int, default=1)
    s = sub.add_parser("sock-server")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--timeout", type=float, default=30.0)
    c = sub.add_parser("sock-client")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=1.5)
    c.add_argument("--connect-timeout", type=float, default=10.0)
    a = ap.parse_args(argv)
    if a.mode == "mpi-allreduce":
        mpi_allreduce(a.bytes, a.reps, a.warmup)
    elif a.mode == "sock-server":
        sock_server(a.bind, a.port, a.timeout)
    else:
        sock_client(a.host, a.port, a.seconds, a.connect_timeout)


if __name__ == "__main__":
    main()
