"""What DDP and Horovod users rely on, under a real ``mpirun -np 2``: GradScaler's plain idiom
(docs/usage.md#amp), the optimizer state compared across ranks after a load
(docs/cross-rank-check.md#state), buffers broadcast as DDP does (docs/usage.md#buffers). Each
scenario failed silently before: NaN weights, drifting ranks, buffers never mentioned."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


@pytest.mark.slow
def test_user_state_under_mpirun():
    run_pytest_mpi(2, "tests/parallel/mpi_user_state.py", timeout=400)
