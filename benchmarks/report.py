"""Write benchmarks/REPORT.md from a fresh, short run of the benchmarks behind the README's figures.

    python -m benchmarks.report                    # about 5-8 minutes on 2 cores
    python -m benchmarks.report --quick            # fewer blocks, two links: about 2-3 minutes
    python -m benchmarks.report --conditions "loaded by other test runs"
    python -m benchmarks.report --from-out         # re-render REPORT.md (and README.md's table) only

It runs, in this order, each as its own job:

* ``python -m benchmarks.run`` on the deep MLP (48 layers, 3.05M parameters) at every link of
  ``--nets``, with the variants ``compute`` (no communication), ``ddp`` (``DDP(model)``),
  ``ddp_powersgd1``, our ``ssgd``, ``topk`` and ``dgc`` interleaved block by block;
* ``python -m benchmarks.compress_step_bench`` on loopback (the 25x512 MLP): Top-k 1 % and DGC 1 %
  against the compute-only step.

The GPU section shows a GPU run's outputs (``benchmarks/gpu_check.sh``, ``--gpu-results``;
benchmarks/gpu_report.py) when they exist, and says "not measured" otherwise.

Every figure in the report is a ratio against a baseline that ran in the same job (DDP, DDP +
PowerSGD or the compute-only step: docs/benchmarking.md#interleaving), so the report holds on a
machine whose absolute speed moves. The run's own outputs go to ``--out`` (default
``benchmarks/results/report/``, git-ignored); only REPORT.md and its two PNGs are kept, and the
performance table of README.md (between its ``benchmarks.report`` markers) is rewritten from them.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, machine_info  # noqa: E402
from benchmarks.convergence_report import section as convergence_section  # noqa: E402
from benchmarks.gpu_report import gpu_section  # noqa: E402
from benchmarks.lowcomm_report import section as lowcomm_section  # noqa: E402
from benchmarks.lowcomm_report import plot_section as lowcomm_plot_section  # noqa: E402
from benchmarks.suite.report import paired_ratio  # noqa: E402
from benchmarks import trust_table  # noqa: E402

__all__ = ["main", "parse_args", "render", "TARGETS"]

SUITE_VARIANTS = ("compute", "ddp", "ddp_powersgd1", "ssgd", "topk", "dgc")
STEP_VARIANTS = ("compute", "dense", "topk", "dgc")
LINKS = {"loopback": "loopback (one host)", "10gbit": "10 Gbit/s", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}
# The speed targets the project holds itself to (README.md, "Performance").
TARGETS = {
    "step": "loopback, 25x512 MLP: Top-k 1 % and DGC 1 % step <= 1.3x the compute-only step",
    "1gbit": "1 Gbit/s, deep MLP: the best sparse variant >= 3x DDP and >= 1.5x DDP + PowerSGD rank 1",
    "10gbit": "10 Gbit/s, deep MLP: no sparse variant below 0.9x DDP",
    "parity": "dense S-SGD >= 0.97x DDP on every link",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 blocks, links 10gbit,1gbit, 3 blocks of the step bench")
    ap.add_argument("--nets", default=None, help="links of the suite job (default loopback,10gbit,1gbit,100mbit)")
    ap.add_argument("--blocks", type=int, default=None, help="interleaved blocks per variant (default 6; quick 3)")
    ap.add_argument("--conditions", default="", help="what else ran on the machine (stated in the report's header)")
    ap.add_argument("--out", default=str(RESULTS / "report"), help="where the run's raw outputs go")
    ap.add_argument("--report", default=str(ROOT / "benchmarks" / "REPORT.md"), help="the report to write")
    ap.add_argument("--readme", default=str(ROOT / "README.md"),
                    help="whose marked performance table to rewrite from this run ('' for none)")
    ap.add_argument("--from-out", action="store_true", help="rebuild the report from --out without running")
    ap.add_argument("--gpu-results", default=str(RESULTS), help="where a GPU run's gpu_bench*.json lie "
                    "(benchmarks/gpu_check.sh; the report's GPU section says 'not measured' without them)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                    help="first wait up to S seconds for the 1-minute load average to fall below the core count")
    a = ap.parse_args(argv)
    a.nets = a.nets or ("10gbit,1gbit" if a.quick else "loopback,10gbit,1gbit,100mbit")
    a.blocks = a.blocks or (3 if a.quick else 6)
    return a


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _load() -> str:
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _load1() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def wait_quiet(limit_s: float) -> None:
    """Wait (up to ``limit_s``) until the 1-minute load average is below the core count."""
    end = time.time() + limit_s
    while time.time() < end and _load1() >= (os.cpu_count() or 1):
        time.sleep(10)


def _run(cmd: list[str], log: Path, timeout: float) -> int:
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    with log.open("w") as f:
        try:
            return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def run_all(a: argparse.Namespace, out: Path, cmd: str) -> dict[str, Any]:
    """Run the two jobs; return what the report needs to say about the run itself."""
    out.mkdir(parents=True, exist_ok=True)
    wait_quiet(a.wait_quiet)
    meta: dict[str, Any] = {"cmd": cmd, "conditions": a.conditions, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_start": _load()}
    t0 = time.time()
    suite = [sys.executable, "-m", "benchmarks.run", "--net", a.nets, "--models", "deep_mlp", "--variants",
             ",".join(SUITE_VARIANTS), "--no-tta", "--blocks", str(a.blocks), "--out", str(out / "suite"),
             "--no-progress", "--no-plots"]
    meta["suite_rc"] = _run(suite, out / "suite.log", timeout=900)
    step = [sys.executable, "-m", "benchmarks.compress_step_bench", "--variants", ",".join(STEP_VARIANTS),
            "--blocks", str(a.blocks + 2)]
    stale = RESULTS / "compress_step_bench.json"
    stale.unlink(missing_ok=True)
    meta["step_rc"] = _run(step, out / "compress_step.log", timeout=600)
    if stale.exists():
        (out / "compress_step_bench.json").write_text(stale.read_text())
    meta["minutes"] = (time.time() - t0) / 60
    meta["load_end"] = _load()
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _x(v: float | None, paired: float | None = None) -> str:
    if v is None:
        return "–"
    return f"{v:.2f}x" + (f" ({paired:.2f})" if paired is not None else "")


def suite_rows(out: Path, nets: list[str]) -> list[dict[str, Any]]:
    """Per link, the deep MLP job's ratios (step of the baseline / step of the variant)."""
    rows = []
    for net in nets:
        path = out / "suite" / f"bench_{net}.json"
        if not path.exists():
            rows.append({"net": net, "error": "no result"})
            continue
        run = json.loads(path.read_text())
        job = next((j for j in run["jobs"] if j.get("mode") == "throughput"), {})
        res = job.get("results") or {}
        if job.get("error") or "ddp" not in res:
            rows.append({"net": net, "error": (job.get("error") or "no DDP result")[-200:]})
            continue
        step = {k: v["step_s"] for k, v in res.items()}
        row: dict[str, Any] = {"net": net, "network": run["cluster"]["network"], "backend": job.get("backend"),
                               "ddp_ratio": _ratio(step["ddp"], step.get("compute"))}
        for v in ("ssgd", "topk", "dgc", "ddp_powersgd1"):
            row[v] = _ratio(step["ddp"], step.get(v))
            row[v + "_paired"] = paired_ratio(res, v)
        for v in ("topk", "dgc"):
            row[v + "_vs_psgd"] = _ratio(step.get("ddp_powersgd1"), step.get(v))
            row[v + "_of_compute"] = _ratio(step.get("compute"), step.get(v))
        row["compute_ms"] = step.get("compute", 0) * 1e3
        rows.append(row)
    return rows


def _met(ok: bool | None) -> str:
    return "–" if ok is None else ("met" if ok else "**not met**")


def target_rows(rows: list[dict[str, Any]], step: dict[str, Any] | None) -> list[str]:
    by = {r["net"]: r for r in rows if "error" not in r}
    out = []
    if step:
        t, d = step["ratio_vs_compute"].get("topk"), step["ratio_vs_compute"].get("dgc")
        out.append(f"| {TARGETS['step']} | Top-k {_x(t)}, DGC {_x(d)} | {_met(t <= 1.3 and d <= 1.3 if t and d else None)} |")
    if "1gbit" in by:
        r = by["1gbit"]
        best = max(("topk", "dgc"), key=lambda v: r[v] or 0)
        ok = (r[best] or 0) >= 3 and (r[best + "_vs_psgd"] or 0) >= 1.5
        out.append(f"| {TARGETS['1gbit']} | {'Top-k' if best == 'topk' else 'DGC'} {_x(r[best])} DDP, "
                   f"{_x(r[best + '_vs_psgd'])} PowerSGD r1 | {_met(ok)} |")
    if "10gbit" in by:
        r = by["10gbit"]
        low = min(r["topk"] or 0, r["dgc"] or 0)
        out.append(f"| {TARGETS['10gbit']} (Top-k, DGC) | Top-k {_x(r['topk'])}, DGC {_x(r['dgc'])} | {_met(low >= 0.9)} |")
    par = [r for r in by.values() if r["ssgd"] is not None]
    if par:
        lo = min(par, key=lambda r: r["ssgd"])
        out.append(f"| {TARGETS['parity']} | {_x(lo['ssgd'])} at the lowest ({LINKS.get(lo['net'], lo['net'])}) | "
                   f"{_met(all(r['ssgd'] >= 0.97 for r in par))} |")
    return out


def plot(rows: list[dict[str, Any]], step: dict[str, Any] | None, report_dir: Path) -> list[str]:
    """Two small PNGs next to the report: speed-up vs DDP per link, and the sparse step's cost."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = []
    good = [r for r in rows if "error" not in r]
    if good:
        series = [("ssgd", "our S-SGD", "#1f77b4"), ("topk", "Top-k 0.1 %", "#2ca02c"), ("dgc", "DGC 0.1 %", "#98df8a"),
                  ("ddp_powersgd1", "DDP + PowerSGD r1", "#888888")]
        fig, ax = plt.subplots(figsize=(6.4, 3.0))
        w = 0.8 / len(series)
        for i, (key, label, color) in enumerate(series):
            ax.bar([j + (i - 1.5) * w for j in range(len(good))], [r[key] or 0 for r in good], w, label=label, color=color)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set_xticks(range(len(good)), [LINKS.get(r["net"], r["net"]) for r in good], fontsize=8)
        ax.set_ylabel("throughput vs DDP (x)", fontsize=8)
        ax.set_yscale("log")
        top = max([r[k] or 1 for r in good for k, _, _ in series] + [1.0])
        low = min([r[k] for r in good for k, _, _ in series if r[k]] + [1.0])
        ticks = [t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64) if low / 2 < t <= top * 1.5]
        ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
        ax.set_ylim(ticks[0] * 0.9, top * 1.3)
        ax.minorticks_off()
        ax.set_title("Deep MLP, 2 ranks: speed-up against DDP in the same job", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        fig.savefig(report_dir / "report_speedup.png", dpi=80)
        plt.close(fig)
        names.append("report_speedup.png")
    if step:
        ratios = step["ratio_vs_compute"]
        keys = [k for k in STEP_VARIANTS if k in ratios]
        fig, ax = plt.subplots(figsize=(4.2, 2.2))
        ax.barh(keys, [ratios[k] for k in keys], color=["#999999", "#1f77b4", "#2ca02c", "#98df8a"][: len(keys)])
        ax.axvline(1.3, color="r", lw=1, ls="--", label="target 1.3x")
        ax.set_xlabel("step time / compute-only step", fontsize=8)
        ax.set_title("Loopback, 25x512 MLP, density 1 %", fontsize=9)
        ax.legend(fontsize=7)
        ax.tick_params(labelsize=7)
        fig.tight_layout()
        fig.savefig(report_dir / "report_sparse_step.png", dpi=80)
        plt.close(fig)
        names.append("report_sparse_step.png")
    return names


def _load_warning(meta: dict[str, Any]) -> list[str]:
    """A note when other work outnumbered the cores: the ranks were then descheduled at random, which
    costs a step that waits on its peer more than the compute-only step."""
    cores = os.cpu_count() or 1
    loads = [float(x) for k in ("load_start", "load_end") for x in str(meta.get(k, "")).split(",")[:1]
             if x.strip() not in ("", "?")]
    if not loads or max(loads) < cores:
        return []
    return [f"The 1-minute load average reached {max(loads):.1f} on {cores} cores during this run: other "
            "processes outnumbered the cores, so the ranks were descheduled at random, and a step that waits on "
            "its peer loses more than the compute-only step does. The verdicts below describe this run; "
            "`--wait-quiet` starts it when the machine is idle.", ""]


def render(a: argparse.Namespace, out: Path, meta: dict[str, Any], cmd: str) -> str:
    nets = [n.strip() for n in a.nets.split(",") if n.strip()]
    rows = suite_rows(out, nets)
    sp = out / "compress_step_bench.json"
    step = json.loads(sp.read_text()) if sp.exists() else None
    report_dir = Path(a.report).parent
    pngs = plot(rows, step, report_dir)
    m = machine_info()
    mpi = (m.get("mpi") or "?").split(",")[0].strip("\x00 ")
    said = meta.get("conditions", a.conditions)
    conditions = f"{said}; " if said else ""
    lines = [
        "# Benchmark report",
        "",
        f"Generated by `{cmd}` on {meta['started']}, in {meta.get('minutes', 0):.1f} minutes.",
        "",
        f"* **Machine:** {m.get('cpus')} cores, {_cpu_model()}; torch {m.get('torch')}, {mpi}, "
        f"Python {m.get('python')}, numpy {m.get('numpy')}.",
        f"* **Conditions:** {conditions}load average {meta['load_start']} at the start and {meta['load_end']} at "
        "the end. Absolute step times move with the load; every figure below is a ratio against a "
        "baseline that ran interleaved with it in the same job (docs/benchmarking.md#interleaving).",
        "* **Setup:** 2 ranks, one thread each; links emulated with network namespaces and `tc tbf` "
        "(docs/benchmarking.md#regime); how to run and read each benchmark: [README.md](README.md).",
        "",
        "## Targets",
        "",
        *_load_warning(meta),
        "| target | this run | |",
        "|---|---|---|",
        *target_rows(rows, step),
        "",
        "## Against DDP, every link",
        "",
        f"`python -m benchmarks.run --net {a.nets} --models deep_mlp --variants {','.join(SUITE_VARIANTS)} "
        f"--no-tta --blocks {a.blocks}`: the deep MLP (48 layers, 3.05M parameters, batch 32 per rank), "
        "sparse density 0.1 %. Throughput against `DDP(model)` in the same job (paired ratio in brackets: "
        "the median over blocks of the two in the same block).",
        "",
        "| link | DDP comm/compute | our S-SGD | Top-k | DGC | DDP + PowerSGD r1 | Top-k vs PowerSGD r1 | "
        "Top-k of compute-only |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = LINKS.get(r["net"], r["net"])
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error']} | | | | | | |")
            continue
        if r["network"] == "loopback" and r["net"] != "loopback":
            name += " (fell back to loopback)"
        lines.append(f"| {name} | {r['ddp_ratio']:.2f} | {_x(r['ssgd'], r['ssgd_paired'])} | "
                     f"{_x(r['topk'], r['topk_paired'])} | {_x(r['dgc'], r['dgc_paired'])} | "
                     f"{_x(r['ddp_powersgd1'], r['ddp_powersgd1_paired'])} | {_x(r['topk_vs_psgd'])} | "
                     f"{(r['topk_of_compute'] or 0) * 100:.0f} % |")
    if "report_speedup.png" in pngs:
        lines += ["", "![speed-up vs DDP](report_speedup.png)"]
    lines += trust_table.section()  # the trust table (benchmarks/trust_table.py), from its own runs
    lines += ["", "## A sparse step against the compute-only step", ""]
    if step:
        lines += [f"`python -m benchmarks.compress_step_bench --variants {','.join(STEP_VARIANTS)} --blocks "
                  f"{a.blocks + 2}`: the 25x512 MLP ({step['params'] / 1e6:.2f}M parameters, batch 32), loopback, "
                  f"density {step['density'] * 100:g} %, momentum SGD; median block, slowest rank.", "",
                  "| variant | step (ms) | vs compute-only |", "|---|---:|---:|"]
        for k in STEP_VARIANTS:
            if k in step["median_step_s"]:
                lines.append(f"| {k} | {step['median_step_s'][k] * 1e3:.1f} | {step['ratio_vs_compute'][k]:.3f}x |")
        if "report_sparse_step.png" in pngs:
            lines += ["", "![sparse step vs compute-only](report_sparse_step.png)"]
        lines += ["", "Where the time beyond the compute-only step goes: docs/benchmarking.md#sparse-step."]
    else:
        lines.append(f"The job failed (rc {meta.get('step_rc')}); its log is in `{out}/compress_step.log`.")
    lines += gpu_section(Path(a.gpu_results))
    lines += convergence_section(report_dir)
    lines += lowcomm_section()  # DiLoCo / SparseLoCo tables (benchmarks/lowcomm_report.py)
    lines += lowcomm_plot_section(report_dir)  # their time-to-loss curves as a plot (report_lowcomm.png)
    where = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
    lines += ["", f"Raw outputs of this run (JSON, per-job logs, timelines) were written to `{where}/` "
              "and are not kept in the repository.", ""]
    return "\n".join(lines)


README_BEGIN, README_END = "<!-- benchmarks.report: begin -->", "<!-- benchmarks.report: end -->"


def readme_block(a: argparse.Namespace, out: Path, meta: dict[str, Any]) -> str:
    """The README's performance table: the suite's rows of this run, with its date and load."""
    nets = [n.strip() for n in a.nets.split(",") if n.strip()]
    lines = [README_BEGIN,
             f"From [benchmarks/REPORT.md](benchmarks/REPORT.md), {meta['started']}; load average "
             f"{meta['load_start'].split(',')[0]} at the start, {meta['load_end'].split(',')[0]} at the end "
             f"({os.cpu_count()} cores). Paired ratios (the same ratio within each block) in brackets.", "",
             "| link | DDP comm/compute | our S-SGD | Top-k | DGC | DDP + PowerSGD r1 |", "|---|---:|---:|---:|---:|---:|"]
    for r in suite_rows(out, nets):
        if "error" not in r:
            lines.append(f"| {LINKS.get(r['net'], r['net'])} | {r['ddp_ratio']:.2f} | {_x(r['ssgd'], r['ssgd_paired'])} | "
                         f"{_x(r['topk'], r['topk_paired'])} | {_x(r['dgc'], r['dgc_paired'])} | "
                         f"{_x(r['ddp_powersgd1'], r['ddp_powersgd1_paired'])} |")
    return "\n".join(lines + ["", "![speed-up vs DDP](benchmarks/report_speedup.png)", README_END])


def update_readme(path: Path, block: str) -> bool:
    """Replace the marked block of ``path`` (README.md) with ``block``; False if it has no markers."""
    text = path.read_text() if path.exists() else ""
    if README_BEGIN not in text or README_END not in text:
        return False
    head, rest = text.split(README_BEGIN, 1)
    path.write_text(head + block + rest.split(README_END, 1)[1])
    return True


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    argv = sys.argv[1:] if argv is None else argv
    cmd = " ".join(["python -m benchmarks.report"] + [shlex.quote(x) for x in argv])
    if a.from_out:  # the report names the command that ran the benchmarks, not this rebuild
        meta = json.loads((out / "meta.json").read_text())
    else:
        meta = run_all(a, out, cmd)
    Path(a.report).write_text(render(a, out, meta, meta.get("cmd", cmd)))
    print(f"wrote {a.report}")
    if a.readme and update_readme(Path(a.readme), readme_block(a, out, meta)):
        print(f"updated the performance table of {a.readme}")
    if a.readme and trust_table.update_readme(Path(a.readme)):
        print(f"updated the trust table of {a.readme}")
    return 0 if meta.get("suite_rc") == 0 and meta.get("step_rc") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
