"""The Gloo backend's MPI lane for small collectives (docs/backends.md#small-on-mpi) under a real
``mpirun``: results, transports, order, and the errors when a rank is missing from a lane collective."""
import re
import sys
import time

import pytest

from tests.parallel.launch import ROOT, run_mpi, run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

LANE = {"HVD_COMMOPT_BACKEND": "gloo", "HVD_COMMOPT_MPI_SMALL_BYTES": "4096"}


@pytest.mark.parametrize("np", [2, 3])
def test_small_collectives_over_the_mpi_lane(np):
    run_pytest_mpi(np, "tests/parallel/mpi_lane.py", timeout=400, env=LANE)


def test_rank_skipping_a_lane_collective_is_named_and_the_job_ends():
    # the gradient (10 floats) crosses the lane: a blocking MPI call that only the abort can end
    proc = run_mpi(3, [sys.executable, str(ROOT / "tests/parallel/mpi_errors.py"), "skip_step"], timeout=280,
                   env={**LANE, "HVD_COMMOPT_TIMEOUT": "5"}, check=False)
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    skipped_at = float(re.search(r"skipping step 2 at t=([0-9.]+)", out).group(1))
    assert ended - skipped_at < 60, f"the job ended {ended - skipped_at:.0f}s after the skip: it hung past the timeout"
    assert "CollectiveTimeoutError" in out and "missing=[1]" in out and "rank 1 is idle" in out, out
