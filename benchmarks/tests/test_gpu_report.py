"""The report's GPU section (benchmarks/gpu_report.py): a GPU run's figures when its outputs
exist, "not measured" otherwise, and never a CPU or tiny run shown as a GPU figure."""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report
from benchmarks.gpu_report import GLOO_PAIR, SINGLE, gpu_section
from benchmarks.tests.test_report import _outputs


def _run(device="NVIDIA H100 80GB HBM3", tiny=False, ranks=1, backend="local"):
    return {"device": device, "tiny": tiny, "ranks": ranks, "backend": backend, "density": 0.01, "blocks": 3,
            "steps": 5, "torch": "2.11.0+cu130", "skipped": {},
            "models": {"resnet50": {"params": 25_557_032, "note": "torchvision ResNet-50, batch 64 of 3x224x224",
                                    "median_step_ms": {"compute": 38.0, "topk": 39.9},
                                    "ratio_vs_compute": {"compute": 1.0, "topk": 39.9 / 38.0}}},
            "selection": [{"n": 25_000_000, "k": 250_000, "density": 0.01, "pass_ms": 0.04, "torch.topk": 8.0,
                           "exact": 2.9, "reuse": 1.4, "ef_exact": 3.8}] if ranks == 1 else []}


def test_without_a_gpu_run_the_section_says_not_measured(tmp_path: Path) -> None:
    text = "\n".join(gpu_section(tmp_path))
    assert "## On a GPU" in text and "Not measured" in text and "gpu_check.sh" in text


def test_a_cpu_or_tiny_run_is_not_shown_as_a_gpu_figure(tmp_path: Path) -> None:
    (tmp_path / SINGLE).write_text(json.dumps(_run(device="cpu", tiny=True)))
    assert "Not measured" in "\n".join(gpu_section(tmp_path))


def test_a_gpu_run_shows_its_steps_ratios_and_selection_passes(tmp_path: Path) -> None:
    (tmp_path / SINGLE).write_text(json.dumps(_run()))
    text = "\n".join(gpu_section(tmp_path))
    assert "### one process: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, backend local" in text
    assert "| ours, Top-k 1 % | 39.9 | 1.050x |" in text
    assert "| 25M | 0.040 | 8.0 | 2.9 | 1.4 | 3.8 |" in text
    assert "2 processes sharing the GPU over Gloo: not measured." in text
    (tmp_path / GLOO_PAIR).write_text(json.dumps(_run(ranks=2, backend="gloo")))
    assert "### 2 processes sharing the GPU over Gloo: NVIDIA H100 80GB HBM3" in "\n".join(gpu_section(tmp_path))


def test_the_report_carries_the_gpu_section(tmp_path: Path) -> None:
    out, gpu = tmp_path / "out", tmp_path / "gpu"
    _outputs(out, load_end="0.9, 0.5, 0.3")
    gpu.mkdir()
    doc = tmp_path / "REPORT.md"
    report.main(["--out", str(out), "--report", str(doc), "--readme", "", "--from-out", "--nets", "1gbit",
                 "--gpu-results", str(gpu)])
    assert "## On a GPU" in doc.read_text() and "Not measured" in doc.read_text()
    (gpu / SINGLE).write_text(json.dumps(_run()))
    report.main(["--out", str(out), "--report", str(doc), "--readme", "", "--from-out", "--nets", "1gbit",
                 "--gpu-results", str(gpu)])
    assert "| ours, Top-k 1 % | 39.9 | 1.050x |" in doc.read_text()
