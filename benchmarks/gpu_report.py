"""The GPU section of benchmarks/REPORT.md, from the outputs of ``python -m benchmarks.gpu_bench``.

``benchmarks/gpu_check.sh`` runs the benchmark on a GPU machine and writes ``gpu_bench.json``
(one process) and ``gpu_bench_2r_gloo.json`` (2 ranks sharing the GPU over Gloo); copied into
``benchmarks/results/`` (or named with ``python -m benchmarks.report --gpu-results DIR``) they
appear in the report. Without them the section says the GPU figures are not measured. A run on
the CPU (``--device cpu``, the tests' tiny run) is never shown as a GPU figure.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["gpu_section", "SINGLE", "GLOO_PAIR"]

SINGLE, GLOO_PAIR = "gpu_bench.json", "gpu_bench_2r_gloo.json"
_NAMES = {"compute": "compute-only", "ddp": "DDP", "ddp_bf16": "DDP + bf16_compress_hook", "none": "ours, no compression",
          "fp16": "ours, fp16", "bf16": "ours, bf16", "topk": "ours, Top-k 1 %", "dgc": "ours, DGC 1 %",
          "topk_thr": "ours, Top-k 1 % threshold reuse"}
_TARGETS = "Top-k 1 % and DGC 1 % <= 1.05x compute-only in one process, on both models"


def _load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    res = json.loads(path.read_text())
    return None if res.get("device") == "cpu" or res.get("tiny") else res


def _model_table(res: dict[str, Any]) -> list[str]:
    lines = []
    for name, m in res["models"].items():
        lines += ["", f"**{name}** ({m['params'] / 1e6:.1f}M parameters, {m['note']}):", "",
                  "| variant | step (ms) | vs compute-only |", "|---|---:|---:|"]
        for k, v in m["median_step_ms"].items():
            lines.append(f"| {_NAMES.get(k, k)} | {v:.1f} | {m['ratio_vs_compute'][k]:.3f}x |")
        for k, why in res.get("skipped", {}).items():
            lines.append(f"| {_NAMES.get(k, k)} | not run: {why} | |")
    return lines


def gpu_section(results: Path) -> list[str]:
    """The report's lines for the GPU run found under ``results``."""
    lines = ["", "## On a GPU", ""]
    single, pair = _load(results / SINGLE), _load(results / GLOO_PAIR)
    if single is None and pair is None:
        return lines + [f"Not measured: no GPU run's outputs (`{SINGLE}`, `{GLOO_PAIR}`) under `{results.name}/`. "
                        "`benchmarks/gpu_check.sh` runs the CUDA tests and `python -m benchmarks.gpu_bench` on a "
                        f"GPU machine (benchmarks/README.md); targets: {_TARGETS}; with 2 processes over Gloo on "
                        "one GPU, our S-SGD >= 0.97x DDP(gloo) and Top-k/DGC faster than DDP(gloo)."]
    for res, title in ((single, "one process"), (pair, "2 processes sharing the GPU over Gloo")):
        if res is None:
            lines += ["", f"{title}: not measured."]
            continue
        lines += ["", f"### {title}: {res['device']}, torch {res.get('torch', '?')}, backend {res['backend']}", "",
                  f"`python -m benchmarks.gpu_bench`: every variant interleaved block by block in one job "
                  f"({res['blocks']} blocks x {res['steps']} steps, median, slowest rank), density "
                  f"{res['density'] * 100:g} %."]
        lines += _model_table(res)
        if res.get("selection"):
            lines += ["", "Selection, time / one `abs` pass over the buffer (float32, k = 1 %):", "",
                      "| elements | pass (ms) | torch.topk | exact | threshold reuse | exact + error feedback "
                      "| Triton | exact, torch ops | reuse, torch ops | EF exact, torch ops |",
                      "|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|"]
            for r in res["selection"]:
                torch_route = " | ".join(f"{r[c]:.1f}" if c in r else "-" for c in ("exact_torch", "reuse_torch", "ef_exact_torch"))
                lines.append(f"| {r['n'] / 1e6:g}M | {r['pass_ms']:.3f} | {r['torch.topk']:.1f} | {r['exact']:.1f} | "
                             f"{r['reuse']:.1f} | {r['ef_exact']:.1f} | {'yes' if r.get('triton') else 'no'} | {torch_route} |")
    return lines
