"""Launch tests/parallel/test_tf_ranks.py under a real ``mpirun -np 2`` (every rank runs pytest)."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("tensorflow")
pytest.importorskip("mpi4py")

_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def test_tf_plugin_under_mpirun_np2():
    run_pytest_mpi(2, "tests/parallel/test_tf_ranks.py", timeout=500, env=_ENV)
