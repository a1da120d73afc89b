"""Horovod API compatibility (mismatch errors, uint16, ops, gradients, alltoall, reducescatter,
async, join, process sets) on 2 real MPI ranks; the assertions are in mpi_hvd_api.py."""
from tests.parallel.launch import run_pytest_mpi


def test_horovod_api_on_two_mpi_ranks():
    run_pytest_mpi(2, "tests/parallel/mpi_hvd_api.py", timeout=300, env={"HVD_COMMOPT_TIMEOUT": "60"})


def test_horovod_api_over_gloo():
    run_pytest_mpi(2, "tests/parallel/mpi_hvd_api.py", timeout=300,
                   env={"HVD_COMMOPT_TIMEOUT": "60", "HVD_COMMOPT_BACKEND": "gloo"})
