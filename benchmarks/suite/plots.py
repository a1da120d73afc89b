"""PNG plots of a run (matplotlib, Agg): throughput, bytes per step, accuracy vs time, one step's timeline.

Why these four: throughput bars with the compute-only bound show how much of the network cost
each algorithm removes; bytes per step (our accounting next to the link counter) shows the
reduction is real and crossed the emulated link; accuracy against wall time shows it is not
bought with accuracy; the timeline of one step shows *why* (what overlaps what).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..common import ROOT  # noqa: E402

from .report import BASELINES, best_ours, tta_missed  # noqa: E402

__all__ = ["plot_run", "plot_timeline_compare", "plot_summary"]

FAMILY = {"compute": "#999999", "ddp": "#444444", "ddp_nofirst": "#555555", "ddp_powersgd1": "#777777", "ddp_powersgd4": "#777777",
          "ddp_bf16": "#666666", "ddp_fp16": "#666666"}
SPARSE = {"topk", "gtopk", "lags", "lags_fused", "omgs", "dgc", "randomk", "dgc_exact", "topk_thr", "oktopk", "ssd_topk", "od_topk",
          "od_dgc"}
SCHEDULE = {"od", "ssd", "cd", "cocod", "local_sgd"}


def _color(name: str) -> str:
    if name in FAMILY:
        return FAMILY[name]
    if name in SPARSE:
        return "#2ca02c"
    if name in SCHEDULE:
        return "#ff7f0e"
    return "#1f77b4"


def _throughput(ax: Any, job: dict, title: str) -> None:
    res = job["results"]
    names = sorted(res, key=lambda k: res[k]["samples_per_s"])
    vals = [res[k]["samples_per_s"] for k in names]
    ax.barh(names, vals, color=[_color(n) for n in names])
    if "compute" in res:
        ax.axvline(res["compute"]["samples_per_s"], ls="--", color="k", lw=1, label="compute-only bound")
    if "ddp" in res:
        ax.axvline(res["ddp"]["samples_per_s"], ls=":", color="r", lw=1.2, label="DDP")
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
    ax.set_xlabel("samples/s (both ranks)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.tick_params(axis="y", labelsize=8)


def _bytes(ax: Any, job: dict, title: str) -> None:
    res = job["results"]
    names = [k for k in sorted(res) if k != "compute"]
    import numpy as np
    y = np.arange(len(names))

    def mean(v: Any) -> float:
        v = [x for x in (v or []) if x is not None]
        return sum(v) / len(v) if v else 0.0
    acct = [mean(res[k].get("bytes_sent_per_step_accounted")) or (res[k].get("bytes_per_step_analytic") or 0)
            for k in names]
    link = [mean(res[k].get("link_tx_bytes_per_step")) for k in names]
    ax.barh(y - 0.2, [max(a, 1) for a in acct], 0.4, label="accounted (ours) / analytic (DDP)", color="#1f77b4")
    ax.barh(y + 0.2, [max(v, 1) for v in link], 0.4, label="link tx counter", color="#d62728")
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per step per rank")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)


def _tta(ax: Any, job: dict, title: str) -> None:
    cmap = plt.get_cmap("tab20")
    metric = "val_loss" if job.get("task") == "lm" else "test_acc"
    for i, (name, r) in enumerate(sorted(job["results"].items())):
        c = r["curve"]
        ddp = name.startswith("ddp")
        ax.plot([p["wall_s"] for p in c], [p[metric] for p in c], "--" if ddp else "-",
                marker="os^vD<>"[i % 7], ms=3, label=name, color="k" if name == "ddp" else cmap(i % 20),
                lw=2.0 if ddp or name == "ssgd" else 1.1)
    ax.axhline(job["target"], color="k", lw=0.8, ls=":")
    values = [p[metric] for r in job["results"].values() for p in r["curve"]]
    if metric == "test_acc":
        ax.set_ylim(max(0.0, min(values + [0.8]) - 0.05), 1.0)
    else:  # the first points (~ln 256) would flatten the rest
        ax.set_ylim(min(values + [job["target"]]) - 0.1, max(values[len(values) // 4:] + [job["target"]]) + 0.3)
    ax.set_xlim(left=0)
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("validation loss" if metric == "val_loss" else "test accuracy")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)


def _load_events(path: str) -> list[dict]:
    """A trace's events; ``path`` relative to the repository (as reports store it) or absolute."""
    try:
        return [e for e in json.loads((ROOT / path).read_text()) if e.get("ph") in ("X", "i")]
    except (OSError, ValueError):
        return []


def _timeline(ax: Any, events: list[dict], title: str) -> None:
    lanes = ["step", "forward", "backward", "compress", "comm", "wait", "update"]
    colors = {"step": "#cccccc", "forward": "#9467bd", "backward": "#1f77b4", "compress": "#2ca02c",
              "comm": "#d62728", "wait": "#ff7f0e", "update": "#8c564b"}
    if not events:
        ax.set_title(title + " (no timeline)", fontsize=10)
        return
    t0 = min(e["ts"] for e in events)
    for e in events:
        lane = e.get("cat", "step")
        y = lanes.index(lane) if lane in lanes else len(lanes)
        if e["ph"] == "X":
            ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, color=colors.get(lane, "k"), alpha=0.8,
                    edgecolor="k", lw=0.3)
        else:
            ax.plot([(e["ts"] - t0) / 1e3], [y], "|", color="k", ms=8)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the traced step started (rank 0)")
    ax.set_title(title, fontsize=10)


def plot_timeline_compare(job: dict, out: Path, net: str, missed: tuple[str, ...] = ()) -> Path | None:
    """SSGD and our best variant (that reached the accuracy target, when a TTA job says which
    did not: ``missed``), one traced step each, lanes one under the other."""
    res = job["results"]
    best = best_ours(res, exclude=("ssgd",) + tuple(missed))
    picks = [k for k in ("ssgd", best) if k and k in res and res[k].get("timeline")]
    picks = list(dict.fromkeys(picks))
    if not picks:
        return None
    fig, axes = plt.subplots(len(picks), 1, figsize=(10, 2.6 * len(picks)), squeeze=False)
    for ax, k in zip(axes[:, 0], picks):
        ev = _load_events(res[k]["timeline"])
        _timeline(ax, ev, f"{job['model']} @ {net}: {k} ({res[k]['step_s'] * 1e3:.0f} ms/step timed)")
    xmax = max(ax.get_xlim()[1] for ax in axes[:, 0])
    for ax in axes[:, 0]:
        ax.set_xlim(0, xmax)
    fig.tight_layout()
    path = out / f"timeline_{job['model']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_run(run: dict, out: Path) -> list[Path]:
    """Every plot of one network setting into ``out``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    net = run["cluster"]["network"]
    tp = [j for j in run["jobs"] if j.get("mode") == "throughput" and not j.get("error") and j.get("results")]
    if tp:
        for kind, fn in (("throughput", _throughput), ("bytes", _bytes)):
            fig, axes = plt.subplots(1, len(tp), figsize=(6.5 * len(tp), 0.32 * max(len(j["results"]) for j in tp) + 1.8),
                                     squeeze=False)
            for ax, job in zip(axes[0], tp):
                fn(ax, job, f"{job['model']} @ {net}: {kind}")
            fig.tight_layout()
            paths.append(out / f"{kind}.png")
            fig.savefig(paths[-1], dpi=110)
            plt.close(fig)
        for job in tp:
            p = plot_timeline_compare(job, out, net, tuple(tta_missed(run, job["model"])))
            if p:
                paths.append(p)
    for job in run["jobs"]:
        if job.get("mode") == "tta" and job.get("results"):
            fig, ax = plt.subplots(figsize=(8, 5))
            lm = job.get("task") == "lm"
            _tta(ax, job, f"transformer @ {net}: validation loss vs training wall time" if lm else
                 f"digits CNN @ {net}: test accuracy vs training wall time")
            fig.tight_layout()
            paths.append(out / ("val_loss_vs_time.png" if lm else "accuracy_vs_time.png"))
            fig.savefig(paths[-1], dpi=110)
            plt.close(fig)
    return paths


def plot_summary(runs: list[dict], out: Path) -> Path | None:
    """Speed-up over DDP of the baselines and our variants, per network setting and model."""
    rows = [(r["cluster"]["network"], j) for r in runs for j in r["jobs"]
            if j.get("mode") == "throughput" and not j.get("error") and "ddp" in j.get("results", {})]
    if not rows:
        return None
    ncols = min(3, len(rows))
    nrows = -(-len(rows) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 4.8 * nrows), squeeze=False)
    for ax in axes.flat[len(rows):]:
        ax.set_visible(False)
    for ax, (net, job) in zip(axes.flat, rows):
        res = job["results"]
        ddp = res["ddp"]["step_s"]
        names = sorted(res, key=lambda k: ddp / res[k]["step_s"])
        ax.barh(names, [ddp / res[k]["step_s"] for k in names], color=[_color(n) for n in names])
        ax.axvline(1.0, color="r", ls=":", lw=1)
        ratio = ddp / res["compute"]["step_s"] if "compute" in res else float("nan")
        ax.set_title(f"{job['model']} @ {net}\nDDP comm/compute {ratio:.2f}", fontsize=9)
        ax.set_xlabel("speed-up vs DDP")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary_speedup.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ += ["BASELINES"]
