"""End to end check of ``python -m benchmarks.gpu_bench --device cpu --tiny``: the GPU
benchmark's code (models, every variant, the interleaved timing, the selection passes, the JSON
the report reads) on tiny sizes on the CPU. The harness, not the speed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from benchmarks.gpu_bench import VARIANTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_cpu_run_writes_every_variant_and_the_selection_passes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HVD_COMMOPT_BACKEND", None)
    cmd = [sys.executable, "-m", "benchmarks.gpu_bench", "--device", "cpu", "--tiny", "--blocks", "1",
           "--steps", "1", "--reps", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert res["device"] == "cpu" and res["tiny"] and res["ranks"] == 1
    assert res["skipped"] == {"ddp_bf16": "bf16_compress_hook needs CUDA and NCCL"}
    for model in ("resnet50", "gpt2"):
        m = res["models"][model]
        ran = [v for v in VARIANTS if v != "ddp_bf16"]
        assert sorted(m["median_step_ms"]) == sorted(ran), m
        assert m["ratio_vs_compute"]["compute"] == 1.0
        assert all(v > 0 for v in m["median_step_ms"].values())
        assert f"\n{model}: " in proc.stdout
    (sel,) = res["selection"]
    assert sel["n"] == 65536 and sel["k"] == 655
    for col in ("torch.topk", "exact", "reuse", "ef_exact"):
        assert sel[col] > 0
    assert "ddp_bf16: not run" in proc.stdout
