"""NaN/Inf handling and Horovod-idiom checkpoints under a real mpirun (docs/wrapper.md#nonfinite,
docs/wrapper.md#checkpoints)."""
import sys

import pytest

from tests.parallel.launch import ROOT, run_mpi, run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


def test_dgc_nonfinite_under_mpirun():
    run_pytest_mpi(2, "tests/parallel/mpi_reliability.py", timeout=300, extra=["-k", "dgc_nan"])


def test_horovod_idiom_checkpoints_resume_bit_exactly_under_mpirun():
    run_pytest_mpi(2, "tests/parallel/mpi_reliability.py", timeout=500, extra=["-k", "horovod_idiom"])


def test_two_rank_checkpoint_into_four_ranks(tmp_path):
    env = {"HCO_TEST_CKPT": str(tmp_path / "ck.pt")}
    run_pytest_mpi(2, "tests/parallel/mpi_reliability.py", timeout=300, env=env, extra=["-k", "save_for_resize"])
    proc = run_pytest_mpi(4, "tests/parallel/mpi_reliability.py", timeout=300, env=env,
                          extra=["-k", "load_resized", "-s"])
    assert proc.stdout.count("resized load ok") == 4, proc.stdout


def test_nonfinite_raise_ends_the_job_naming_rank_and_bucket():
    proc = run_mpi(2, [sys.executable, str(ROOT / "tests/parallel/mpi_reliability.py"), "raise_on_nan"],
                   timeout=200, env={"HVD_COMMOPT_TIMEOUT": "60"}, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "NonFiniteGradientError: rank 0: the gradient of bucket" in out, out[-4000:]
    assert "finished, which it must not" not in out
