"""The accuracy side of the trust table (benchmarks/trust_table.py): the convergence runs against S-SGD.

Which fixed variant counts as a "best fixed variant that reaches the accuracy target" for a model
is read from ``benchmarks.convergence``'s CONV lines (``conv_*.txt`` under the trust results): it
counts only where every row of it that ran on the model's task, at every rank count, is within
the target, 0.5 points of S-SGD's accuracy or 1 % of its validation loss (the deep MLP: the digits
MLP; ResNet-18: rings, the convolutional task, as ``auto``'s kinds rule reads ResNet-18; the
transformer: the GPT under AdamW, the optimizer the suite times it with); a variant with no row
there does not count (docs/auto-compression.md#best-fixed). ``auto`` is held to the same rows
(every task, 2 and 4 ranks), so its best fixed rival is too. The same lines give ``auto``'s own
accuracy rows (:func:`conv_table`).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["CONV_OF", "TASK_OF", "fixed_verdicts", "fixed_table", "conv_table"]

MODELS = {"deep_mlp": "deep MLP", "resnet18": "ResNet-18", "transformer": "transformer"}
FIXED = {"topk_01pct": "Top-k 0.1 %", "dgc_01pct": "DGC 0.1 %", "topk_1pct": "Top-k 1 %", "dgc_1pct": "DGC 1 %",
         "topk_10pct": "Top-k 10 %", "quant8": "int8 + EF", "quant4": "int4 + EF"}
#: Each fixed variant's rows in the convergence runs: ``benchmarks.convergence``'s variant and its
#: ``--density`` (None: any; the quantisers have none).
CONV_OF: dict[str, tuple[str, float | None]] = {
    "topk_01pct": ("topk", 0.001), "dgc_01pct": ("dgc", 0.001), "topk_1pct": ("topk", 0.01),
    "dgc_1pct": ("dgc", 0.01), "topk_10pct": ("topk", 0.1), "quant8": ("quant8", None), "quant4": ("quant4", None)}
#: The convergence task and optimizer whose rows stand for each model of the suite: the suite times
#: the deep MLP and ResNet-18 with SGD and the transformer with AdamW, on synthetic batches. ResNet-18
#: is convolutional (99.9 % of its elements in conv kernels), so its task is rings (96 %), not the
#: digits CNN (12 %: docs/auto-compression.md#kinds).
TASK_OF = {"deep_mlp": ("digits_mlp", "sgd"), "resnet18": ("rings", "sgd"), "transformer": ("transformer", "adamw")}


def _conv_groups(results: Path) -> dict[tuple, dict[str, dict[int, float]]]:
    """Every CONV line of ``conv_*.txt`` under ``results``, by (task, optimizer, ranks, length), then
    by variant (``topk@0.1`` for a sparse variant at its ``--density``; the quantisers, S-SGD and
    ``auto`` by name), then by seed: the final accuracy (percent) or validation loss."""
    groups: dict[tuple, dict[str, dict[int, float]]] = {}
    for p in sorted(results.glob("conv_*.txt")):
        for line in p.read_text().splitlines():
            if not line.startswith("CONV "):
                continue
            r = json.loads(line[5:])
            length = f"{r['steps']} steps" if "steps" in r else f"{r.get('epochs', '?')} epochs"
            if r.get("shape"):  # the transformer's: GPT_CPU ("cpu") or the tiny one
                length += f", GPT {r['shape']}"
            task = r.get("task") or p.stem[len("conv_"):]  # lines without it: the file's name
            key = (task, r.get("optimizer", "sgd"), r.get("ranks", 2), length)
            val = r.get("val_loss", r.get("acc"))
            if val is None:
                continue
            v = r["variant"]
            names = [v] + ([f"{v}@{float(r['density']):g}"] if r.get("density") is not None else [])
            for n in names:
                groups.setdefault(key, {}).setdefault(n, {})[r["seed"]] = float(val)
    return groups


def fixed_verdicts(results: Path) -> dict[str, dict[str, tuple[bool | None, str]]]:
    """Per fixed variant and model: whether the convergence runs show it within the target on the
    model's task (:data:`TASK_OF`) in every row of it, at every rank count (None: no row), and the gaps."""
    groups = _conv_groups(results)
    out: dict[str, dict[str, tuple[bool | None, str]]] = {}
    for v, (cv, dens) in CONV_OF.items():
        name = cv if dens is None else f"{cv}@{dens:g}"
        for model, (task, opt) in TASK_OF.items():
            rows = []
            for key in sorted(groups):
                if key[:2] != (task, opt) or name not in groups[key] or "ssgd" not in groups[key]:
                    continue
                _, gap, ok = _against(groups[key][name], groups[key]["ssgd"], task == "transformer")
                if ok is not None:
                    rows.append((ok, f"{gap} [{key[3]}" + (f", {key[2]} ranks]" if key[2] != 2 else "]")))
            verdict = None if not rows else all(ok for ok, _ in rows)
            out.setdefault(v, {})[model] = (verdict, "; ".join(t for _, t in rows) or "no convergence row")
    return out


def _against(vals: dict[int, float], ssgd: dict[int, float], lm: bool) -> tuple[str, str, bool | None]:
    """The mean of ``vals`` over seeds, its gap to S-SGD's mean over the same seeds (% of the loss, or
    points of accuracy; the per-seed range beside it) and whether it meets the target (within 1 % of
    the loss, 0.5 points of accuracy)."""
    seeds = [k for k in vals if k in ssgd]
    if not seeds:
        return "not run", "", None
    m, s = statistics.mean(vals[k] for k in seeds), statistics.mean(ssgd[k] for k in seeds)
    per = sorted((vals[k] / ssgd[k] - 1) * 100 if lm else vals[k] - ssgd[k] for k in seeds)
    unit = " %" if lm else " pt"
    gap = (m / s - 1) * 100 if lm else m - s
    spread = f" ({per[0]:+.2f} to {per[-1]:+.2f})" if len(per) > 1 else ""
    return (f"{m:.3f}" if lm else f"{m:.2f} %"), f"{gap:+.2f}{unit}{spread}", (gap <= 1.0 if lm else gap >= -0.5)


def conv_table(results: Path) -> list[str]:
    """``auto``'s final accuracy against S-SGD: every ``conv_*.txt`` under ``results`` (CONV lines of
    ``benchmarks.convergence``), one row per task, optimizer, ranks and length, with ``auto`` and
    ``auto_100mbit`` (``auto`` priced on a 100 Mbit/s link's model, where it goes sparse), the
    gap of the means over the seeds both ran, what ``auto_100mbit`` chose, and met / MISSED against
    the target: within 0.5 points of S-SGD's accuracy, 1 % of its validation loss."""
    groups = {k: g for k, g in _conv_groups(results).items() if "auto" in g or "auto_100mbit" in g}
    chose: dict[tuple, set[str]] = {}
    for p in sorted(results.glob("conv_*.txt")):
        for line in p.read_text().splitlines():
            if line.startswith("CONV ") and '"auto_100mbit"' in line:
                r = json.loads(line[5:])
                length = (f"{r['steps']} steps" if "steps" in r else f"{r.get('epochs', '?')} epochs") + \
                    (f", GPT {r['shape']}" if r.get("shape") else "")
                key = (r.get("task") or p.stem[len("conv_"):], r.get("optimizer", "sgd"), r.get("ranks", 2), length)
                chose.setdefault(key, set()).update(r.get("chosen") or ())
    lines = ["| task | optimizer | ranks, length | seeds | S-SGD | auto | gap | target | auto on a 100 Mbit/s model | "
             "gap | target | it chose (any seed) |", "|---|---|---|---:|---:|---:|---:|---|---:|---:|---|---|"]
    order = ("digits", "digits_mlp", "rings", "transformer")
    def rank(k: tuple) -> tuple:  # the tasks in order, then optimizer, ranks and length (a number)
        n = k[3].split()[0]
        return (order.index(k[0]) if k[0] in order else len(order), k[0], k[1], k[2], int(n) if n.isdigit() else 0)

    for key in sorted(groups, key=rank):
        task, optimizer, ranks, length = key
        by, lm = groups[key], task == "transformer"
        ssgd = by.get("ssgd", {})
        a, ag, aok = _against(by.get("auto", {}), ssgd, lm)
        b, bg, bok = _against(by.get("auto_100mbit", {}), ssgd, lm)
        mark = {True: "met", False: "**MISSED**", None: ""}
        sv = "not run" if not ssgd else (f"{statistics.mean(ssgd.values()):.3f}" if lm
                                         else f"{statistics.mean(ssgd.values()):.2f} %")
        lines.append(f"| {task} | {optimizer} | {ranks}, {length} | {len(ssgd)} | {sv} | {a} | {ag} | {mark[aok]} | "
                     f"{b} | {bg} | {mark[bok]} | {', '.join(sorted(chose.get(key, ()))) or '-'} |")
    if len(lines) == 2:
        lines.append("| not run | | | | | | | | | | | |")
    return lines


def fixed_table(acc: dict[str, dict[str, Any]]) -> list[str]:
    """Which fixed variant counts as reaching the accuracy target for each model (the convergence
    rule, module docstring): its gap to S-SGD on the model's task, per row of the runs."""
    heads = {m: f"{MODELS[m]} ({t}, {o})" for m, (t, o) in TASK_OF.items()}
    lines = ["| fixed variant | " + " | ".join(heads.values()) + " |", "|---|" + "---|" * len(heads)]
    conv = acc.get("_conv", {})
    for v in FIXED:
        cols = []
        for m in TASK_OF:
            ok, text = conv.get(v, {}).get(m, (None, "no convergence row"))
            cols.append({True: "counts", False: "**does not count**", None: "not counted"}[ok] + f": {text}")
        lines.append(f"| {FIXED[v]} | " + " | ".join(cols) + " |")
    return lines
