"""NaN/Inf handling and Horovod-idiom checkpoints under a real mpirun (docs/wrapper.md#nonfinite,
docs/wrapper.md#checkpoints)."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


def test_dgc_nonfinite_under_mpirun():
    run_pytest_mpi(2, "tests/parallel/mpi_reliability.py", timeout=300, extra=["-k", "dgc_nan"])
