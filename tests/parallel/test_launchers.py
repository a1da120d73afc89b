"""The same script under torchrun, mpirun and our launcher trains to the same weights, bit for
bit (2 ranks: a sum of two gradients is one addition, whatever the transport's algorithm), and each
launcher gets the backend documented in docs/backends.md#choice (docs/backends.md#one-host here)."""
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.launch import ROOT, run_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

SCRIPT = str(ROOT / "tests/parallel/launcher_train.py")


def _weights(out: str, np: int) -> dict[int, tuple[str, str, str]]:
    found = {int(m[0]): m[1:] for m in re.findall(r"rank (\d+) of %d: backend (\S+) control (\S+) weights ([0-9a-f]+)" % np, out)}
    assert sorted(found) == list(range(np)), out[-3000:]
    return found


def _torchrun(np: int) -> str:
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not found next to this Python")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HVD_COMMOPT_TIMEOUT="120")
    env.pop("HVD_COMMOPT_BACKEND", None)
    with socket.socket() as s:  # torchrun's env:// rendezvous needs a real port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([str(torchrun), "--nproc-per-node", str(np), "--master-addr", "127.0.0.1",
                           "--master-port", str(port), SCRIPT], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_torchrun_mpirun_and_our_launcher_give_the_same_weights():
    np = 2
    by_torchrun = _weights(_torchrun(np), np)
    by_mpirun = _weights(run_mpi(np, [sys.executable, SCRIPT], timeout=240).stdout, np)
    by_gloo = _weights(run_mpi(np, [sys.executable, SCRIPT], timeout=240,
                               env={"HVD_COMMOPT_BACKEND": "gloo"}).stdout, np)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HVD_COMMOPT_TIMEOUT="120")
    env.pop("HVD_COMMOPT_BACKEND", None)
    proc = subprocess.run([sys.executable, "-m", "hvd_commopt.run", "-np", str(np), SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by_launcher = _weights(proc.stdout, np)
    # the documented choice: Gloo under torchrun; CPU tensors with every rank on this one host take
    # MPI's shared memory under mpirun and our launcher; Gloo asked for keeps MPI as control plane
    assert {v[:2] for v in by_torchrun.values()} == {("gloo", "None")}
    assert {v[:2] for v in by_mpirun.values()} == {("mpi", "None")}
    assert {v[:2] for v in by_launcher.values()} == {("mpi", "None")}
    assert {v[:2] for v in by_gloo.values()} == {("gloo", "mpi")}
    # every rank of every launch holds the same weights
    digests = {v[2] for d in (by_torchrun, by_mpirun, by_launcher, by_gloo) for v in d.values()}
    assert len(digests) == 1, (by_torchrun, by_mpirun, by_launcher, by_gloo)
