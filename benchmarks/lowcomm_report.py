"""The low-communication section of benchmarks/REPORT.md: the tables of benchmarks/lowcomm_bench.py's
merged runs (docs/diloco.md#measured), read from its JSONs under ``benchmarks/results/lowcomm/``
(git-ignored; copy a run's ``lowcomm_p*.json`` there to report it).

    python -m benchmarks.lowcomm_report [results dir]     # print the section
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "lowcomm"


def _table(path: Path, data: dict) -> list[str]:
    a = data["args"]
    rows = data["summary"]
    base = next(r for r in rows if r["variant"] == "ddp")
    lines = ["", f"`{path.relative_to(path.parents[1])}`: {a['ranks']} ranks, {a['steps']} steps of "
             f"{a['batch']}x{a['context']} tokens per rank, seed {a.get('seed', 0)}, {data['params']} parameters "
             f"(layers {a['layers']}, width {a['width']}), inner AdamW lr {a['lr']}"
             f"{', cosine' if a.get('cosine') else ''}; S-SGD's final validation loss {base['final_val_loss']:.4f}.",
             "", "| variant | val loss | vs S-SGD | bytes/step/rank | x S-SGD |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['final_val_loss']:.4f} | {100 * r['loss_vs_ddp']:+.2f} % | "
                     f"{r['bytes_per_step_per_rank']:.0f} | {r['bytes_ratio_vs_ddp']:.5f} |")
    return lines


def section(results: Path = RESULTS) -> list[str]:
    """The report's lines: one table per summarised run (a JSON with S-SGD in it)."""
    lines = ["", "## Low-communication training (DiLoCo, SparseLoCo)", "",
             "`python -m benchmarks.lowcomm_bench`: validation loss at equal tokens and bytes per step per rank "
             "against S-SGD of the same run (convergence, not time: the figures do not depend on the machine's "
             "load). Set-ups, targets and reading: docs/diloco.md#measured, docs/quantize.md#measured."]
    files = sorted(p for p in results.glob("**/lowcomm_p*.json")) if results.is_dir() else []
    found = False
    for p in files:
        data = json.loads(p.read_text())
        if data.get("summary"):
            lines += _table(p, data)
            found = True
    if not found:
        lines += ["", f"No results under `{results.relative_to(ROOT) if results.is_relative_to(ROOT) else results}`: "
                      "run `python -m benchmarks.lowcomm_bench` (docs/diloco.md#measured)."]
    return lines


if __name__ == "__main__":
    print("\n".join(section(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else RESULTS)))
