"""The one-GPU-per-rank check's wiring and the host-staged Gloo allreduce under a real
``mpirun -np 2`` (docs/backends.md#one-gpu-per-rank, docs/backends.md#cuda-on-gloo)."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


def test_device_ids_and_host_staging_on_two_ranks():
    run_pytest_mpi(2, "tests/parallel/mpi_devices.py", timeout=300, env={"HVD_COMMOPT_BACKEND": "gloo"})
