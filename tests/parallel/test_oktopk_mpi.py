"""Ok-Topk under a real ``mpirun -np P`` for P = 2..8 (docs/oktopk.md#traffic)."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("mpi4py")


@pytest.mark.parametrize("np", [2, 3, 4, 5, 8])
def test_oktopk_under_mpirun(np):
    run_pytest_mpi(np, "tests/parallel/mpi_oktopk.py", timeout=400)


@pytest.mark.parametrize("np", [2, 3])
def test_oktopk_over_gloo_native_tensors(np):
    """Ok-Topk over torch.distributed (Gloo), the default backend for CPU tensors across hosts."""
    pytest.importorskip("torch")
    run_pytest_mpi(np, "tests/parallel/mpi_oktopk.py", timeout=400, env={"HVD_COMMOPT_BACKEND": "gloo"},
                   extra=["-k", "torch"])
