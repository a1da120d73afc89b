"""The convergence matrix's section of benchmarks/REPORT.md: the gap table and the curves.

``benchmarks/report.py`` calls :func:`section`; it reads the matrix's CONV files
(``benchmarks/results/matrix/*.txt``, git-ignored, written by ``python -m benchmarks.convergence
matrix``), and draws ``report_convergence.png`` beside the report: one panel per (task, optimizer,
ranks), each algorithm's mean curve over seeds, S-SGD in black. Measured results stay out of the
repository; what is kept is the generated REPORT.md and its plot.

    python -m benchmarks.convergence_report   # print the section from benchmarks/results/matrix/
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hvd_commopt.host import ADAPTIVE
from hvd_commopt.reduce.known_gaps import KNOWN_GAPS

from .convergence_matrix import TARGET_PCT, TARGET_PT, gaps, load, pivot, table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "matrix"
PNG = "report_convergence.png"
# the wrap-time warning that covers each benchmark variant (docs/convergence-matrix.md#warnings): the
# compressor's for LAGS, SSD + Top-k and OD + DGC, whose lag is their compressor's; random-k has its own
WARNED_AS = {"topk": "topk", "lags": "topk", "ssd_topk": "topk", "gtopk": "gtopk", "oktopk": "oktopk", "dgc": "dgc",
             "od_dgc": "dgc", "cocod": "cocod", "local_sgd": "local_sgd", "od": "od", "ssd": "ssd", "cd": "cd"}
OWN_WARNING = {"randomk"}  # docs/topk.md#randomk-momentum, docs/adaptive-optimizers.md#randomk


def records(results: Path = RESULTS) -> tuple[list[dict], str]:
    """The matrix's records and where they came from (the results folder)."""
    files = sorted(str(p) for p in results.glob("*.txt")) if results.is_dir() else []
    if files:
        return load(files), str(results.relative_to(ROOT) if results.is_relative_to(ROOT) else results)
    return [], ""


def plot(recs: list[dict], path: Path) -> bool:
    """Mean curve over seeds of every algorithm, one panel per (task, optimizer, ranks)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups: dict[tuple, dict[str, list[list[float]]]] = {}
    for r in recs:
        key = (r["task"], r.get("optimizer", "sgd"), r["ranks"])
        groups.setdefault(key, {}).setdefault(r["variant"], []).append(r["curve"])
    if not groups:
        return False
    cols = 3
    rows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    cmap = plt.get_cmap("tab20")
    names = sorted({v for g in groups.values() for v in g if v != "ssgd"})
    for ax, (key, res) in zip(axes.flat, sorted(groups.items())):
        loss = key[0] == "transformer"
        ends = []
        for name, curves in res.items():
            n = min(len(c) for c in curves)
            mean = [statistics.mean(c[i] for c in curves) for i in range(n)]
            style = dict(color="black", lw=2.2) if name == "ssgd" else dict(color=cmap(names.index(name) % 20), lw=1)
            ax.plot(range(1, n + 1), mean, label="S-SGD" if name == "ssgd" else name, **style)
            ends.append(mean[-1])
        ref = res.get("ssgd")
        if ref and not loss:  # zoom on the end of training, where the gaps are (diverged runs leave the panel)
            base = statistics.mean(c[-1] for c in ref)
            lo = min([e for e in ends if e > base - 10] + [base]) - 12  # and the catching-up epochs
            ax.set_ylim(max(lo, 0), 100)
        elif ref:  # the loss panels: S-SGD's range, so that a diverged run does not flatten the others
            top = statistics.mean(c[0] for c in ref) * 1.1
            ax.set_ylim(min(min(e for e in ends), statistics.mean(c[-1] for c in ref)) * 0.98, top)
        ax.set_title(f"{key[0]}, {key[1]}, {key[2]} ranks", fontsize=9)
        every = [r["steps"] // max(1, len(r["curve"])) for r in recs if r["task"] == key[0] and "steps" in r]
        ax.set_xlabel(f"evaluation (every {every[0]} steps)" if loss and every else "epoch", fontsize=8)
        ax.set_ylabel("validation loss" if loss else "test accuracy %", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=8, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return True


def warned(variant: str, optimizer: str) -> bool:
    """Whether wrapping ``variant`` (at density 1 %) under ``optimizer`` warns of a measured gap."""
    if variant in OWN_WARNING:
        return True
    method = WARNED_AS.get(variant)
    return method is not None and (method, ADAPTIVE if optimizer == "adamw" else "sgd") in KNOWN_GAPS


def misses(recs: list[dict]) -> list[str]:
    """One line per (task, optimizer, ranks): the algorithms whose gap misses the target, each
    marked with whether wrapping it warns (docs/convergence-matrix.md#warnings)."""
    out = []
    for (task, opt, ranks, length), res in gaps(recs).items():
        bad = [f"{n} ({r['gap']:+.2f}, {'warned' if warned(n, opt) else '**not warned**'})"
               for n, r in res.items() if n != "ssgd" and r["ok"] is False]
        out.append(f"* {task}, {opt}, {ranks} ranks, {length}: " + (", ".join(bad) if bad else "all within target"))
    return out


def section(report_dir: Path, results: Path = RESULTS) -> list[str]:
    """The report's lines for the matrix (and its PNG written into ``report_dir``)."""
    recs, source = records(results)
    lines = ["", "## Convergence matrix", ""]
    if not recs:
        return lines + ["No results: run `python -m benchmarks.convergence matrix` (docs/convergence-matrix.md#target)."]
    tmp = report_dir / ".convergence_matrix.txt"
    tmp.write_text("".join("CONV " + json.dumps(r) + "\n" for r in recs))
    try:
        tab, grid = table([str(tmp)]), pivot([str(tmp)])
    finally:
        tmp.unlink()
    lines += [f"`python -m benchmarks.convergence matrix` (results: `{source}`): every algorithm at the library's "
              f"defaults (density 1 %), SGD lr 0.1 momentum 0.9 (AdamW lr 1e-3 on the rows so labelled), cosine "
              f"decay, the same initial weights and data order as S-SGD per seed. Gap of the means to S-SGD's "
              f"(accuracy: points; transformer: % of S-SGD's validation loss, positive = worse); the per-seed "
              f"gap's min–max is the seed spread. Target: within {TARGET_PT} point / {TARGET_PCT:g} %. "
              "How each default was chosen from it: docs/convergence-matrix.md.", "",
              "The matrix: gap of the means to S-SGD (S-SGD's own row: its mean), per-seed gap min..max and "
              "the seed count in brackets, **bold** where it misses the target.", "", grid,
              "Outside the target, and whether wrapping that combination warns (`MeasuredGapWarning`, "
              "docs/convergence-matrix.md#warnings):", "", *misses(recs), "", tab]
    if plot(recs, report_dir / PNG):
        lines += ["", f"![convergence curves]({PNG})"]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--report-dir", default=str(ROOT / "benchmarks"))
    a = ap.parse_args(argv)
    print("\n".join(section(Path(a.report_dir), Path(a.results))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
