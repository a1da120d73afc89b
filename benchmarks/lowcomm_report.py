"""The low-communication section of benchmarks/REPORT.md: the tables of benchmarks/lowcomm_bench.py's
merged runs (docs/diloco.md#measured), read from its JSONs under ``benchmarks/results/lowcomm/``
(git-ignored; copy a run's ``lowcomm_p*.json`` there to report it), and the times to S-SGD's
final loss on an emulated link from benchmarks/lowcomm_netemu.py's ``netemu_summary.json``, with
their curves as one plot (:func:`plot_section`: validation loss against tokens and against time on
the link, ``benchmarks/report_lowcomm.png``).

    python -m benchmarks.lowcomm_report [results dir]     # print the section
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "lowcomm"
PNG = "report_lowcomm.png"


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


def _time_table(path: Path, data: dict) -> list[str]:
    """The time to S-SGD's final validation loss on an emulated link (benchmarks/lowcomm_netemu.py
    with ``--curves``): each variant's measured step time x the steps its loss curve took."""
    a = data.get("args", {})
    ratio = data.get("comm_over_compute_ddp")
    base = "DDP" if data.get("baseline") == "torch_ddp" else "S-SGD"  # the ratios' baseline (lowcomm_netemu)
    given = data.get("target_from") == "given"  # --target: a loss every variant reaches, not S-SGD's final one
    goal = (f"the validation loss {data['target']:.4f} (given; S-SGD's final loss {data['ddp_final_loss']:.4f} "
            f"is not reached by every curve)") if given else f"S-SGD's final validation loss {data['target']:.4f}"
    to = "the loss" if given else "S-SGD's loss"
    lines = ["", f"`{path.relative_to(path.parents[1])}`: step times on the emulated {data['net']} link ({a.get('hosts', 2)} ranks, "
             f"layers {a.get('layers', '?')}, width {a.get('width', '?')}, {a.get('batch', '?')}x{a.get('context', '?')} "
             f"tokens per rank and step, median of {a.get('repeats', 1)}), the time to {goal} "
             f"= steps to it x step time; ratios against {base}"
             + ("" if ratio is None else f"; {base}'s communication / compute per step {ratio:.1f}") + ".",
             "", f"| variant | ms/step | x {base} per step | steps to {to} (run length) | time to it (s) | "
             f"x {base} |", "|---|---:|---:|---:|---:|---:|"]
    for v, r in data["results"].items():
        steps, t, x = r.get("steps_to_ddp_loss"), r.get("time_to_ddp_loss_s"), r.get("time_to_loss_speedup_vs_ddp")
        run = "" if r.get("run_steps") is None else f" ({r['run_steps']})"
        lines.append(f"| {v} | {1e3 * r['step_s']:.1f} | {r.get('step_speedup_vs_ddp', float('nan')):.2f} | "
                     f"{'-' if steps is None else steps}{run} | {'-' if t is None else format(t, '.1f')} | "
                     f"{'-' if x is None else format(x, '.2f')} |")
    return lines


def section(results: Path = RESULTS) -> list[str]:
    """The report's lines: one table per summarised run (a JSON with S-SGD in it), and one per
    emulated-link time-to-loss summary (lowcomm_netemu's ``netemu_summary.json`` with a target)."""
    lines = ["", "## Low-communication training (DiLoCo, SparseLoCo)", "",
             "`python -m benchmarks.lowcomm_bench`: validation loss at equal tokens and bytes per step per rank "
             "against S-SGD of the same run (convergence, not time: the figures do not depend on the machine's "
             "load); the emulated-link tables are times (`python -m benchmarks.lowcomm_netemu --curves`, measured with "
             "the machine to themselves). Set-ups, targets and reading: docs/diloco.md#measured, "
             "docs/diloco.md#measured-time-to-loss, docs/quantize.md#measured."]
    files = sorted(p for p in results.glob("**/lowcomm_p*.json")) if results.is_dir() else []
    found = False
    for p in files:
        data = json.loads(p.read_text())
        if data.get("summary"):
            lines += _table(p, data)
            found = True
    for p in sorted(results.glob("**/netemu_summary.json")) if results.is_dir() else []:
        data = json.loads(p.read_text())
        if "target" in data:  # run with --curves
            lines += _time_table(p, data)
            found = True
    if not found:
        lines += ["", f"No results under `{results.relative_to(ROOT) if results.is_relative_to(ROOT) else results}`: "
                      "run `python -m benchmarks.lowcomm_bench` (docs/diloco.md#measured)."]
    return lines


def _summaries_with_curves(results: Path) -> list[tuple[Path, dict]]:
    """The emulated-link summaries run with ``--curves`` that carry their loss curves."""
    found = []
    for p in sorted(results.glob("**/netemu_summary.json")) if results.is_dir() else []:
        data = json.loads(p.read_text())
        if "target" in data and data.get("curves"):
            found.append((p, data))
    return found


def plot(results: Path, png: Path) -> bool:
    """One PNG, one row per emulated-link time-to-loss summary: validation loss against tokens (all
    ranks) and against time on the link (each evaluation's step x the variant's measured step
    time), S-SGD's final loss dotted (the target). False (no file) without such summaries or
    without matplotlib."""
    runs = _summaries_with_curves(results)
    if not runs:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(runs), 2, figsize=(13, 4.2 * len(runs)), squeeze=False)
    for (path, data), (ax_tok, ax_time) in zip(runs, axes):
        a = data.get("args", {})
        dotted = "the given target loss" if data.get("target_from") == "given" else "S-SGD's final loss"
        for v, curve in data["curves"].items():
            step_s = data["results"][v]["step_s"]
            pts = [p for p in curve if p.get("val_loss") is not None]
            line, = ax_tok.plot([p["tokens"] if p.get("tokens") is not None else p["step"] for p in pts],
                                [p["val_loss"] for p in pts], marker=".", ms=3, label=v)
            timed = [p for p in pts if p["step"] > 0]  # the time axis is logarithmic
            ax_time.plot([p["step"] * step_s for p in timed], [p["val_loss"] for p in timed], marker=".", ms=3,
                         color=line.get_color(), label=f"{v} ({1e3 * step_s:.1f} ms/step)")
        ax_tok.set_xlabel("tokens (all ranks)")
        ax_time.set_xlabel(f"time on the emulated {data['net']} link (s): steps x measured step time")
        ax_time.set_xscale("log")
        for ax in (ax_tok, ax_time):
            ax.axhline(data["target"], color="grey", lw=0.8, ls=":")
            ax.set_ylabel("validation loss (nats/byte)")
            ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
            ax.grid(alpha=0.3)
        ax_time.legend(fontsize=7, loc="upper right")
        ax_tok.set_title(f"{path.parent.name}: {data['net']}, {a.get('hosts', 2)} ranks, layers {a.get('layers', '?')}, "
                         f"width {a.get('width', '?')}, {a.get('batch', '?')}x{a.get('context', '?')} tokens per rank "
                         f"(dotted: {dotted})", fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def plot_section(report_dir: Path, results: Path = RESULTS) -> list[str]:
    """The report's plot of the time-to-loss curves (written to ``report_dir``/report_lowcomm.png)
    and the line that embeds it; nothing when no summary carries curves."""
    if not plot(results, report_dir / PNG):
        return []
    return ["", "Validation loss against tokens and against time on the emulated link, for the time-to-loss "
            "runs above (time = steps x the variant's measured step time):", "", f"![low-communication curves]({PNG})"]


if __name__ == "__main__":
    print("\n".join(section(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else RESULTS)))
