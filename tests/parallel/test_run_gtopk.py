"""gTop-k and the other sparse reducers under a real ``mpirun -np P`` (oversubscribed).

Each case launches ``mpirun -np P python -m pytest tests/parallel/test_gtopk_mpi.py``; every rank
asserts (oracle equality, identical ranks, conservation, traffic) and a failing rank fails the
job. P covers powers of two and the fold/unfold path for the others (docs/gtopk.md#t-gt-4).
"""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("mpi4py")


@pytest.mark.parametrize("np", [2, 3, 4, 5, 6, 8])
def test_sparse_reducers_under_mpirun(np):
    # Importing torch on 8 oversubscribed ranks is slow; the torch check runs up to 4 ranks.
    extra = ["-k", "not torch"] if np > 4 else None
    run_pytest_mpi(np, "tests/parallel/test_gtopk_mpi.py", timeout=500, extra=extra)


@pytest.mark.parametrize("np", [3, 4])
def test_gtopk_over_gloo_native_tensors(np):
    """The same reducer over torch.distributed (Gloo): torch tensors on the wire, no host packing."""
    pytest.importorskip("torch")
    run_pytest_mpi(np, "tests/parallel/test_gtopk_mpi.py", timeout=400, env={"HVD_COMMOPT_BACKEND": "gloo"},
                   extra=["-k", "torch"])
