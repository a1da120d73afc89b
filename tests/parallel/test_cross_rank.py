"""Settings that differ across ranks are refused on every rank under a real mpirun
(docs/cross-rank-check.md#settings): a fusion threshold set by environment variable on one node
only, gTop-k densities that differ, different compression kinds (PyTorch and TensorFlow). Each
used to corrupt memory or hang."""
import sys
import time

import pytest

from tests.parallel.launch import ROOT, run_mpi

SCRIPT = str(ROOT / "tests/parallel/mpi_cross_rank.py")
_TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}

EXPECT = {
    "threshold_env": "fusion_threshold differs across ranks: rank 0: 26214400 (default); rank 1: 1048576 (from "
                     "HVD_COMMOPT_FUSION_THRESHOLD) (pass the same fusion_threshold= on every rank, or set "
                     "HVD_COMMOPT_FUSION_THRESHOLD (or HOROVOD_FUSION_THRESHOLD) the same on every node)",
    "density": "compression.compressor.density differs across ranks: rank 0: 0.01; rank 1: 0.02 (pass the same "
               "compression= on every rank",
    "kind": "compression differs across ranks: rank 0: {'reducer': 'sparse_allgather'",
}


def _run(scenario: str, framework: str, env: dict | None = None):
    # MPMD: rank 1 gets HVD_COMMOPT_FUSION_THRESHOLD from mpirun, as a node with its own setting would
    argv = [sys.executable, SCRIPT, scenario, framework]
    second = [":", "-np", "1"] + (["-x", "HVD_COMMOPT_FUSION_THRESHOLD=1048576"] if scenario == "threshold_env" else [])
    t0 = time.monotonic()
    proc = run_mpi(1, argv + second + argv, timeout=300, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if "RankMismatchError" in ln]
    assert sorted(ln.split(":")[0] for ln in lines) == ["rank 0", "rank 1"], proc.stdout + proc.stderr
    assert all(EXPECT[scenario] in ln for ln in lines), lines
    return time.monotonic() - t0


@pytest.mark.parametrize("scenario", sorted(EXPECT))
def test_torch_settings_differing_across_ranks_are_refused_on_every_rank(scenario):
    _run(scenario, "torch")


@pytest.mark.parametrize("scenario", ["density", "threshold_env"])  # the kinds: torch only (TF starts slowly)
def test_tf_settings_differing_across_ranks_are_refused_on_every_rank(scenario):
    pytest.importorskip("tensorflow")
    _run(scenario, "tf", _TF_ENV)
