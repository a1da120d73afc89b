"""``benchmarks.suite.step_profile --net``: the profile runs on emulated hosts, as a trust row does.

Slow (it launches ranks); skips where namespaces or MPI are missing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_step_profile_on_an_emulated_link_runs_our_variants_on_gloo(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    cmd = [sys.executable, "-m", "benchmarks.suite.step_profile", "--net", "1gbit", "--model", "deep_mlp",
           "--variants", "ssgd,ddp", "--blocks", "1", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    if "(network: netns-1gbit)" not in r.stdout:
        pytest.skip(f"network namespaces unavailable: {r.stdout.strip().splitlines()[-1]}")
    ranks = [json.loads((tmp_path / f"deep_mlp.rank{i}.json").read_text()) for i in (0, 1)]
    for res in ranks:
        assert res["backend"] == "gloo" and res["size"] == 2  # across hosts our default is Gloo, as DDP's
        assert set(res["results"]) == {"ssgd", "ddp"}
        for row in res["results"].values():
            assert row["cpu_process"] >= row["cpu_main"] > 0 and row["wall"] > 0
    assert "variant" in r.stdout and "ssgd" in r.stdout  # rank 0's table
