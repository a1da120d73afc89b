"""compression="auto" under a real ``mpirun -np 2``: every rank uses rank 0's choice, and the
verbose report is printed by rank 0 only (docs/auto-compression.md#policy)."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


@pytest.mark.slow
def test_auto_compression_under_mpirun():
    proc = run_pytest_mpi(2, "tests/parallel/mpi_autocompress.py", timeout=400, extra=["-s", "--color=no"])
    out = proc.stdout
    # verbose: printed at the decision and once measured, by rank 0 only
    assert out.count("compression='auto' (decision 1)") == 2, out[-4000:]
