"""A failing or departing rank ends the whole job within seconds, under mpirun and our launcher.

Each scenario runs tests/parallel/mpi_faults.py on real ranks. The collective timeout stays at
120 s (run_mpi's default), so a job that ends within 10 s of the failure was ended by the
failure notice, not by the timeout. Times are measured from the timestamp the failing rank
prints just before it fails to the moment the launcher returns.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from tests.parallel.launch import ROOT, run_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

SCRIPT = str(ROOT / "tests/parallel/mpi_faults.py")
LIMIT_S = 10.0


def run_job(args, np=2, launcher=False, env=None):
    """(exit code, stdout + stderr, time the launcher returned) of mpi_faults.py ``args``."""
    if not launcher:
        proc = run_mpi(np, [sys.executable, SCRIPT, *args], timeout=240, env=env, check=False)
    else:
        # No "python" before the script: the launcher runs a .py with its own interpreter.
        full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                    OMP_NUM_THREADS="1", HVD_COMMOPT_TIMEOUT="120", **(env or {}))
        proc = subprocess.run([sys.executable, "-m", "hvd_commopt.run", "-np", str(np), SCRIPT, *args],
                              cwd=ROOT, env=full, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr, time.time()


@pytest.mark.slow
def test_timeout_in_different_collectives_says_which_rank_is_in_which():
    rc, out, ended = run_job(["mismatch"], env={"HVD_COMMOPT_TIMEOUT": "5"})
    assert rc != 0, out
    assert re.search(r"rank 0: allgather '(\S+)' did not complete within 5 s; stuck in collective #\d+ allgather "
                     r"'\1': rank 1 is in a different one, collective #\d+ allreduce 'bucket0", out), out
    assert "ranks issue different collectives" in out, out
    assert "every rank is inside it" not in out, out
