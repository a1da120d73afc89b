"""The Gloo backend's MPI lane for small collectives (docs/backends.md#small-on-mpi) under a real
``mpirun``: results, transports and order."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

LANE = {"HVD_COMMOPT_BACKEND": "gloo", "HVD_COMMOPT_MPI_SMALL_BYTES": "4096"}


@pytest.mark.parametrize("np", [2, 3])
def test_small_collectives_over_the_mpi_lane(np):
    run_pytest_mpi(np, "tests/parallel/mpi_lane.py", timeout=400, env=LANE)
    # a rank missing from a lane collective: test_parallel_sync.py's skip-a-step test, lane on;
    # a failing or leaving rank: test_faults.py's Gloo control-plane test, lane on
