"""Launch tests/parallel/test_tf_hvd_ranks.py (tf_plugin's Horovod API) under ``mpirun -np 2``."""
import pytest

from tests.parallel.launch import run_pytest_mpi

pytest.importorskip("tensorflow")
pytest.importorskip("mpi4py")

_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def test_tf_horovod_api_under_mpirun_np2():
    run_pytest_mpi(2, "tests/parallel/test_tf_hvd_ranks.py", timeout=500, env=_ENV)
