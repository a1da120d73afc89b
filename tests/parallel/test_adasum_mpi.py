"""Adasum under a real ``mpirun`` with 2, 3 (folded) and 4 ranks (tests/parallel/mpi_adasum.py)."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("mpi4py")


@pytest.mark.parametrize("np", [2, 3, 4])
def test_adasum_under_mpirun(np):
    run_pytest_mpi(np, "tests/parallel/mpi_adasum.py", timeout=400)
