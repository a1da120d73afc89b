"""DiLoCo, Streaming DiLoCo, compressed pseudo-gradients and the low-bit quantiser under a real
``mpirun`` with 2 and 4 ranks."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


@pytest.mark.parametrize("np", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_diloco_and_quantiser_under_mpirun(np):
    run_pytest_mpi(np, "tests/parallel/mpi_diloco.py", timeout=500)
