"""fusion="mgwfbp"/"optimal"/"auto" under a real ``mpirun -np 2`` (T-MG-6), and the verbose
report printed once, by rank 0."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")


def test_planned_fusion_under_mpirun():
    proc = run_pytest_mpi(2, "tests/parallel/mpi_fusion.py", timeout=400, env={"HVD_COMMOPT_VERBOSE": "1"},
                          extra=["-s", "--color=no"])
    out = proc.stdout
    assert out.count("hvd_commopt fusion: strategy=") == 4, out[-4000:]  # one per planned optimizer, rank 0 only
    assert out.count("strategy=mgwfbp -> omgs") == 1 and out.count("strategy=auto -> ") == 1


def test_planned_fusion_over_gloo_calibrates_with_native_buffers():
    run_pytest_mpi(2, "tests/parallel/mpi_fusion.py", timeout=300, env={"HVD_COMMOPT_BACKEND": "gloo"},
                   extra=["-k", "auto or layerwise"])
