"""Synchronous path under a real ``mpirun`` (2 and 4 ranks, oversubscribed), and its errors."""
import re
import sys
import time

import pytest

from tests.parallel.launch import ROOT, run_mpi, run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


@pytest.mark.parametrize("np", [2, 4])
def test_sync_training_under_mpirun(np):
    run_pytest_mpi(np, "tests/parallel/mpi_sync.py", timeout=400)


def test_sync_training_over_gloo_under_mpirun():
    run_pytest_mpi(2, "tests/parallel/mpi_sync.py", timeout=300, env={"HVD_COMMOPT_BACKEND": "gloo"},
                   extra=["-k", "threshold or closed_form or equal_size or direct_allreduce or small_sums"])


def test_sync_training_over_gloo_on_three_ranks():
    # an odd rank count: Gloo's ring splits unevenly and the 2-rank pair sum is off
    run_pytest_mpi(3, "tests/parallel/mpi_sync.py", timeout=400, env={"HVD_COMMOPT_BACKEND": "gloo"})


def test_model_differing_across_ranks_is_refused_on_every_rank():
    proc = run_mpi(3, [sys.executable, str(ROOT / "tests/parallel/mpi_errors.py"), "mismatch"], timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if "RankMismatchError" in ln]
    assert len(lines) == 3, proc.stdout
    assert all("tensor #0 is '0.weight' shape (8, 4) float32 on rank 0 but '0.weight' shape (9, 4) float32 on rank 2" in ln for ln in lines)


def test_rank_skipping_a_step_times_out_naming_it_and_the_job_ends():
    proc = run_mpi(3, [sys.executable, str(ROOT / "tests/parallel/mpi_errors.py"), "skip_step"], timeout=280,
                   env={"HVD_COMMOPT_TIMEOUT": "5"}, check=False)
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    skipped_at = float(re.search(r"skipping step 2 at t=([0-9.]+)", out).group(1))
    # timeout 5 s + 3 s peer query + abort; rank 1 would sleep 150 s: only the abort ends the job
    assert ended - skipped_at < 60, f"the job ended {ended - skipped_at:.0f}s after the skip: it hung past the timeout"
    assert "CollectiveTimeoutError" in out, out
    assert "missing=[1]" in out, out
    assert "rank 1 is idle" in out, out


@pytest.mark.parametrize("lane", ["0", "65536"])
def test_rank_skipping_a_step_over_gloo_is_named_by_the_mpi_control_plane(lane):
    # Gloo carries the gradients; the timeout's diagnosis travels over MPI (docs/backends.md#control-plane).
    # With the MPI lane the gradient (10 floats) crosses MPI instead (docs/backends.md#small-on-mpi):
    # a blocking MPI call that only the abort can end
    proc = run_mpi(3, [sys.executable, str(ROOT / "tests/parallel/mpi_errors.py"), "skip_step"], timeout=280,
                   env={"HVD_COMMOPT_TIMEOUT": "5", "HVD_COMMOPT_BACKEND": "gloo",
                        "HVD_COMMOPT_MPI_SMALL_BYTES": lane}, check=False)
    ended = time.time()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    skipped_at = float(re.search(r"skipping step 2 at t=([0-9.]+)", out).group(1))
    assert ended - skipped_at < 60, f"the job ended {ended - skipped_at:.0f}s after the skip: it hung past the timeout"
    assert "CollectiveTimeoutError" in out and "missing=[1]" in out and "rank 1 is idle" in out, out


def test_launcher_runs_a_job():
    proc = run_mpi(1, [sys.executable, "-c", "print('unused')"], timeout=60)  # mpirun itself works
    assert "unused" in proc.stdout
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = "import torch_plugin as h; h.init(); print('rank', h.rank(), 'of', h.size())"
    out = subprocess.run([sys.executable, "-m", "hvd_commopt.run", "-np", "2", "--verbose", sys.executable, "-c", code],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rank 0 of 2" in out.stdout and "rank 1 of 2" in out.stdout
    assert out.stdout.splitlines()[0].split()[1:3] == ["-np", "2"]
