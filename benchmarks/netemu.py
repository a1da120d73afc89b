#!/usr/bin/env python3
"""Emulate a small bandwidth-limited cluster on one machine and run ranks across it.

Each emulated host is a network namespace ``<prefix>h<i>`` with one veth ``veth0`` at
``198.18.0.<i+1>/24`` (RFC 2544 benchmarking range), plugged into a Linux bridge that lives in its
own "switch" namespace ``<prefix>sw``. Nothing is attached to the root namespace, so emulated
traffic cannot reach the machine's real interfaces or any address outside the namespaces. Every
link is shaped in both directions with ``tc tbf`` (host TX on ``veth0``, host RX on the switch
port), burst = 2 ms of line rate: smaller bursts under-deliver on 2 cores (late tbf timers),
larger ones let small messages through unshaped. netem is not in this kernel, hence tbf only.
Recipe, usage and measurements: benchmarks/netemu/README.md.

Launchers: Open MPI (one PRRTE daemon per namespace started through the fake ssh
``netemu/netns-rsh``, hostname per namespace, ``--bind-to none``), MPICH (hydra through the same
agent, UCX pinned to TCP on veth0 so it cannot use shared memory) and torch.distributed (one
process per namespace with MASTER_ADDR/RANK/WORLD_SIZE). Every run returns the shaped links'
byte counters, so a benchmark can prove its traffic crossed the emulated links.

Without root, iproute2 or namespace support, the cluster falls back to running the ranks on
loopback and says so (``network == "loopback"``) instead of failing, unless ``fallback=False``.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent / "netemu"))
from netemu_support import (  # noqa: E402  (helper module lives in benchmarks/netemu/)
    BWCHECK, MpiInstall, NetemuError, NetemuUnavailable, RunResult, burst_bytes, delta, find_mpi,
    format_check, format_links, kill_pids, last_json, mpi_argv, parse_rate, run_cmd, run_procs,
)

__all__ = ["EmulatedCluster", "RunResult", "NetemuError", "NetemuUnavailable", "parse_rate",
           "cleanup_stale", "main"]

DEFAULT_SUBNET = "198.18.0"  # first three octets; /24; only ever configured inside our namespaces
TBF_LATENCY = "20ms"  # 0 qdisc drops in every measured run
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
_NAME_RE = re.compile(r"^hvd(\d+)x[0-9a-f]{4}(?:h\d+|sw)$")


def _teardown(namespaces: list[str]) -> None:
    """Kill whatever still runs in our namespaces, then delete them; safe to call repeatedly."""
    for ns in namespaces:
        r = run_cmd(["ip", "netns", "pids", ns], check=False)
        kill_pids(int(p) for p in r.stdout.split() if p.isdigit())
    for ns in reversed(namespaces):
        run_cmd(["ip", "netns", "del", ns], check=False)
    namespaces.clear()


def cleanup_stale() -> list[str]:
    """Delete namespaces left by netemu processes that died without teardown (e.g. SIGKILL)."""
    if shutil.which("ip") is None:
        return []
    names = [line.split()[0] for line in run_cmd(["ip", "netns", "list"], check=False).stdout.splitlines()
             if line.strip()]
    stale = [n for n in names if (m := _NAME_RE.match(n)) and not Path(f"/proc/{m.group(1)}").exists()]
    _teardown(list(stale))
    return stale


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmulatedCluster:
    """N emulated hosts joined by shaped links; a context manager that always tears down.

    ``with EmulatedCluster(n=2, rate="1gbit") as cl: res = cl.run_mpi([sys.executable, "x.py"])``.
    ``rate`` is a tc rate ("100mbit", "1gbit", "10gbit") or None/"none" for unshaped veth.
    ``fallback=True`` runs on loopback when namespaces are impossible (``fallback_reason`` says
    why); ``force_loopback=True`` skips the namespaces (baselines, tests). ``mpi`` is "auto"
    (MPICH when installed, because it fills the link better, else Open MPI), "openmpi" or "mpich".
    """

    def __init__(self, n: int = 2, rate: str | None = "1gbit", *, burst: int | None = None,
                 subnet: str = DEFAULT_SUBNET, fallback: bool = True, force_loopback: bool = False,
                 mpi: str = "auto", mpich_prefix: str | None = None, ranks_per_host: int = 1) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"n={n}: need 1..200 emulated hosts (one /24)")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet={subnet!r}: give the first three octets, e.g. '198.18.0'")
        self.n = n
        self.ranks_per_host = ranks_per_host  # run_mpi: n x ranks_per_host ranks, dealt to the hosts in turn
        self.rate = None if rate in (None, "", "none") else rate
        self.rate_bps = parse_rate(self.rate) if self.rate else None
        self.burst = burst if burst is not None else (burst_bytes(self.rate_bps) if self.rate_bps else None)
        self.subnet = subnet
        self.fallback = fallback
        self.force_loopback = force_loopback
        self.mpi = mpi
        self.mpich_prefix = mpich_prefix
        self.prefix = f"hvd{os.getpid()}x{random.randrange(1 << 16):04x}"
        self.fallback_reason: str | None = None
        self._namespaces: list[str] = []  # created so far, in creation order (teardown list)
        self._finalizer = weakref.finalize(self, _teardown, self._namespaces)
        self._workdir: str | None = None
        self._up = False

    # ----------------------------------------------------------------- topology
    @property
    def netns(self) -> bool:
        """True when the ranks really run in shaped namespaces (False: loopback fallback)."""
        return self._up and self.fallback_reason is None

    @property
    def network(self) -> str:
        """``"netns-<rate>"``, ``"netns-unshaped"`` or ``"loopback"``: label for results."""
        if not self.netns:
            return "loopback"
        return f"netns-{self.rate}" if self.rate else "netns-unshaped"

    @property
    def hosts(self) -> list[str]:
        """Address of each emulated host (``127.0.0.1`` for every rank on loopback)."""
        if not self.netns:
            return ["127.0.0.1"] * self.n
        return [f"{self.subnet}.{i + 1}" for i in range(self.n)]

    @property
    def namespaces(self) -> list[str]:
        return [f"{self.prefix}h{i}" for i in range(self.n)] if self.netns else []

    def _preflight(self) -> str | None:
        """Why namespaces cannot work here (with the fix), or None."""
        if self.force_loopback:
            return "loopback requested (force_loopback=True)"
        if not sys.platform.startswith("linux"):
            return "network namespaces need Linux"
        if os.geteuid() != 0:
            return "not root: run as root (ip netns needs CAP_NET_ADMIN and CAP_SYS_ADMIN)"
        for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
            if shutil.which(tool) is None:
                return f"`{tool}` not found: apt-get install {pkg}"
        return None

    def up(self) -> EmulatedCluster:
        """Create and shape the namespaces (or choose loopback); idempotent."""
        if self._up:
            return self
        self._workdir = tempfile.mkdtemp(prefix="hvd-netemu-")
        self._up = True
        self.fallback_reason = None
        reason = self._preflight()
        if reason is None:
            try:
                self._create()
            except NetemuError as e:
                _teardown(self._namespaces)
                reason = (f"namespace setup failed: {e} (needs root with CAP_NET_ADMIN and "
                          "CAP_SYS_ADMIN; unprivileged containers cannot do this)")
        if reason is not None:
            self.fallback_reason = reason
            if not self.fallback:
                self.down()
                raise NetemuUnavailable(f"emulated cluster unavailable: {reason}")
        return self

    def _create(self) -> None:
        sw = f"{self.prefix}sw"
        for ns in [sw] + [f"{self.prefix}h{i}" for i in range(self.n)]:
            run_cmd(["ip", "netns", "add", ns])
            self._namespaces.append(ns)
            run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        run_cmd(["ip", "-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        run_cmd(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i in range(self.n):
            ns = f"{self.prefix}h{i}"
            run_cmd(["ip", "-n", ns, "link", "add", "veth0", "type", "veth", "peer", "name", f"p{i}", "netns", sw])
            run_cmd(["ip", "-n", sw, "link", "set", f"p{i}", "master", "br0"])
            run_cmd(["ip", "-n", sw, "link", "set", f"p{i}", "up"])
            run_cmd(["ip", "-n", ns, "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", "veth0"])
            run_cmd(["ip", "-n", ns, "link", "set", "veth0", "up"])
        self._shape()

    def _shape(self) -> None:
        sw = f"{self.prefix}sw"
        for i in range(self.n):
            for ns, dev in ((f"{self.prefix}h{i}", "veth0"), (sw, f"p{i}")):
                if self.rate is None:
                    run_cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                else:
                    run_cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.rate,
                             "burst", str(self.burst), "latency", TBF_LATENCY])

    def set_rate(self, rate: str | None, burst: int | None = None) -> None:
        """Reshape every link in place (e.g. to sweep rates without rebuilding the cluster)."""
        self.rate = None if rate in (None, "", "none") else rate
        self.rate_bps = parse_rate(self.rate) if self.rate else None
        self.burst = burst if burst is not None else (burst_bytes(self.rate_bps) if self.rate_bps else None)
        if self.netns:
            self._shape()

    def down(self) -> None:
        """Kill leftover processes and delete every namespace we created; safe to repeat."""
        _teardown(self._namespaces)
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self._up = False

    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ----------------------------------------------------------------- counters
    def counters(self) -> dict[str, dict[str, int]]:
        """Byte counters of the emulated links, per host ``h<i>`` (or ``lo`` on loopback).

        ``tx_bytes``/``rx_bytes`` are the host's veth0 counters; ``shaped_tx_bytes`` and
        ``shaped_rx_bytes`` are what the tbf qdiscs (host side, switch side) have sent, i.e. the
        traffic that was rate limited. On loopback: the root namespace's ``lo`` counters, which
        include any other local traffic.
        """
        if not self.netns:
            base = Path("/sys/class/net/lo/statistics")
            return {"lo": {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes")}}
        sw = f"{self.prefix}sw"
        qsw = {q.get("dev"): q for q in json.loads(run_cmd(["tc", "-s", "-j", "-n", sw, "qdisc", "show"]).stdout)
               if q.get("root")}
        out: dict[str, dict[str, int]] = {}
        for i, ns in enumerate(self.namespaces):
            link = json.loads(run_cmd(["ip", "-s", "-j", "-n", ns, "link", "show", "dev", "veth0"]).stdout)[0]
            qh = [q for q in json.loads(run_cmd(["tc", "-s", "-j", "-n", ns, "qdisc", "show", "dev", "veth0"]).stdout)
                  if q.get("root")]
            stats = link.get("stats64", link.get("stats", {}))
            out[f"h{i}"] = {
                "tx_bytes": int(stats["tx"]["bytes"]), "rx_bytes": int(stats["rx"]["bytes"]),
                "shaped_tx_bytes": int(qh[0].get("bytes", 0)) if qh and qh[0].get("kind") == "tbf" else 0,
                "shaped_rx_bytes": int(qsw.get(f"p{i}", {}).get("bytes", 0))
                if qsw.get(f"p{i}", {}).get("kind") == "tbf" else 0,
            }
        return out

    # ----------------------------------------------------------------- processes
    def host_argv(self, i: int, cmd: Sequence[str]) -> list[str]:
        """argv that runs ``cmd`` on emulated host ``i`` (own netns + hostname; local on loopback)."""
        if not self.netns:
            return list(cmd)
        ns = f"{self.prefix}h{i}"
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "/bin/sh", "-c",
                f'hostname {ns}; exec "$@"', "sh", *cmd]

    def _require_up(self) -> str:
        if not self._up or self._workdir is None:
            raise NetemuError("cluster is not up: use `with EmulatedCluster(...) as cl:` or call cl.up()")
        return self._workdir

    def _result(self, launcher: str, version: str, cmd: Sequence[str], procs: tuple, before: dict,
                t0: float, notes: list[str]) -> RunResult:
        rcs, outs, errs, timed_out = procs
        if timed_out:  # mpirun/prted or a rank may have outlived its process group
            for ns in self.namespaces:
                r = run_cmd(["ip", "netns", "pids", ns], check=False)
                kill_pids(int(p) for p in r.stdout.split() if p.isdigit())
        after = self.counters()
        rc = 124 if timed_out else next((c for c in rcs if c != 0), 0)
        return RunResult(
            returncode=rc, stdout="".join(outs), stderr="".join(errs), network=self.network,
            launcher=launcher, launcher_version=version, ranks=self.n, elapsed_s=time.perf_counter() - t0,
            timed_out=timed_out, rank_returncodes=rcs, rank_stdout=outs, rank_stderr=errs,
            link_bytes=delta(before, after), link_bytes_before=before, link_bytes_after=after,
            command=list(cmd), fallback_reason=self.fallback_reason, notes=notes)

    def run_mpi(self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 300.0,
                mpi: str | None = None, mpirun_args: Sequence[str] = ()) -> RunResult:
        """Run ``cmd`` as ``n`` MPI ranks, rank i on host i; output is mpirun's combined output.

        ``mpi`` overrides the cluster's choice for this run; ``mpirun_args`` go to the launcher
        before the program (e.g. Open MPI's ring allreduce: ``["--mca",
        "coll_tuned_use_dynamic_rules", "1", "--mca", "coll_tuned_allreduce_algorithm", "4"]``).
        """
        work = self._require_up()
        inst: MpiInstall = find_mpi(mpi or self.mpi, self.mpich_prefix)
        argv, notes, launch_env = mpi_argv(inst, self.n * self.ranks_per_host, self.hosts if self.netns else None,
                                           self.subnet, work, list(MALLOC_ENV) + list(env or {}),
                                           slots=self.ranks_per_host)
        full_env = {**os.environ, **MALLOC_ENV, **inst.env, **launch_env, **(env or {})}
        full_env["PATH"] = f"{inst.bin_dir}{os.pathsep}{full_env.get('PATH', '')}"
        argv += list(mpirun_args) + list(cmd)
        if self.netns:
            full_env["HVD_NETEMU_PREFIX"] = self.prefix
            argv = self.host_argv(0, argv)  # mpirun/mpiexec itself runs on host 0
        before = self.counters()
        t0 = time.perf_counter()
        procs = run_procs([argv], full_env, timeout, work)
        return self._result(inst.kind, inst.version, cmd, procs, before, t0, notes)

    def run_torch(self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 300.0,
                  port: int | None = None) -> RunResult:
        """Start ``cmd`` once per host with torch.distributed env:// variables (Gloo over veth0)."""
        work = self._require_up()
        port = port or (29500 if self.netns else _free_port())
        argvs, envs = [], []
        for r in range(self.n):
            e = {**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(self.n),
                 "LOCAL_RANK": "0" if self.netns else str(r), "LOCAL_WORLD_SIZE": "1" if self.netns else str(self.n),
                 "MASTER_ADDR": self.hosts[0], "MASTER_PORT": str(port),
                 "GLOO_SOCKET_IFNAME": "veth0" if self.netns else "lo"}
            argvs.append(self.host_argv(r, cmd))
            envs.append(e)
        before = self.counters()
        t0 = time.perf_counter()
        procs = run_procs(argvs, envs, timeout, work)
        import importlib.metadata as md
        try:
            version = f"torch {md.version('torch')}"
        except md.PackageNotFoundError:
            version = "torch (not installed in the launcher's Python)"
        return self._result("gloo", version, cmd, procs, before, t0, [])

    # ----------------------------------------------------------------- check
    def check(self, seconds: float = 1.5, with_mpi: bool = True, timeout: float = 60.0) -> dict:
        """Quick bandwidth probe: one TCP stream host0 -> host1, then an MPI allreduce if possible."""
        work = self._require_up()
        out: dict = {"network": self.network, "hosts": self.n, "rate": self.rate if self.netns else None,
                     "burst_bytes": self.burst if self.netns else None,
                     "fallback_reason": self.fallback_reason}
        if self.n >= 2:
            port = 5201 if self.netns else _free_port()
            dst = self.hosts[1]
            srv = self.host_argv(1, [sys.executable, str(BWCHECK), "sock-server", "--bind", dst, "--port", str(port),
                                     "--timeout", str(timeout)])
            cli = self.host_argv(0, [sys.executable, str(BWCHECK), "sock-client", "--host", dst, "--port", str(port),
                                     "--seconds", str(seconds)])
            before = self.counters()
            rcs, outs, errs, to = run_procs([srv, cli], dict(os.environ), timeout, work)
            stream = last_json(outs[0])
            if stream is None or to or any(rcs):
                raise NetemuError(f"socket check failed (rc={rcs}, timed_out={to}): {errs}")
            stream["link_bytes"] = delta(before, self.counters())
            out["socket"] = stream
        if with_mpi:
            try:
                nbytes = 4 << 20
                per_rep = nbytes * 2 * (self.n - 1) / self.n  # bytes each rank sends per allreduce
                reps = 20
                if self.rate_bps and self.netns and per_rep > 0:  # about `seconds` of line-rate traffic
                    reps = max(3, min(50, int(self.rate_bps / 8 * seconds / per_rep)))
                res = self.run_mpi([sys.executable, str(BWCHECK), "mpi-allreduce", "--bytes", str(nbytes),
                                    "--reps", str(reps)], timeout=timeout)
                mpi = last_json(res.stdout)
                if res.returncode != 0 or mpi is None:
                    raise NetemuError(f"rc={res.returncode}: {res.stderr.strip()[-2000:]}")
                mpi.update(launcher=res.launcher, launcher_version=res.launcher_version, link_bytes=res.link_bytes)
                out["mpi"] = mpi
            except NetemuError as e:
                out["mpi_error"] = str(e)
        return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``netemu.py --ranks 2 --rate 1gbit [--torch] -- python script.py`` or ``--check``."""
    import argparse
    ap = argparse.ArgumentParser(description="Run a command across an emulated, bandwidth-limited cluster.")
    ap.add_argument("--ranks", "-n", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="tc rate per link, e.g. 100mbit, 1gbit, 10gbit, none")
    ap.add_argument("--burst", type=int, default=None, help="tbf burst in bytes (default: 2 ms of line rate)")
    ap.add_argument("--torch", action="store_true", help="launch with torch.distributed env (Gloo) instead of MPI")
    ap.add_argument("--mpi", default="auto", choices=["auto", "openmpi", "mpich"])
    ap.add_argument("--mpich-prefix", default=None, help="MPICH install prefix (or env HVD_NETEMU_MPICH)")
    ap.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                    help="extra launcher argument before the program (repeat for each word)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are killed")
    ap.add_argument("--no-fallback", action="store_true", help="fail instead of falling back to loopback")
    ap.add_argument("--loopback", action="store_true", help="run on loopback even if namespaces work")
    ap.add_argument("--check", action="store_true", help="measure the achieved bandwidth and exit")
    ap.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    ap.add_argument("--cleanup", action="store_true", help="delete namespaces left by dead netemu runs")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run on every rank")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if a.cleanup:
        print(f"netemu: removed stale namespaces: {cleanup_stale() or 'none'}")
        if not (cmd or a.check):
            return 0
    if not cmd and not a.check:
        ap.error("give a command after -- (or --check)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the context manager tears down
    try:
        with EmulatedCluster(a.ranks, a.rate, burst=a.burst, fallback=not a.no_fallback,
                             force_loopback=a.loopback, mpi=a.mpi, mpich_prefix=a.mpich_prefix) as cl:
            if cl.fallback_reason:
                print(f"netemu: falling back to loopback: {cl.fallback_reason}", file=sys.stderr)
            if a.check:
                r = cl.check(timeout=min(a.timeout, 120.0))
                print(json.dumps(r, indent=1) if a.json else format_check(r))
                return 1 if "mpi_error" in r else 0
            if a.torch:
                res = cl.run_torch(cmd, timeout=a.timeout)
            else:
                res = cl.run_mpi(cmd, timeout=a.timeout, mpirun_args=a.mpi_arg)
    except NetemuError as e:
        print(f"netemu: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("netemu: interrupted; cluster torn down", file=sys.stderr)
        return 130
    if a.json:
        print(json.dumps(res.to_dict(), indent=1))
    else:
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        print(f"netemu: network={res.network} launcher={res.launcher_version} rc={res.returncode} "
              f"elapsed={res.elapsed_s:.1f}s{' TIMED OUT' if res.timed_out else ''}; "
              f"{format_links(res.link_bytes)}", file=sys.stderr)
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
