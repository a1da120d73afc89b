"""Helpers shared by the benchmark scripts: self-launch under mpirun, timing blocks, reports."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

__all__ = ["ROOT", "RESULTS", "relaunch_under_mpirun", "time_steps", "train_step", "time_blocks", "write_json",
           "machine_info", "table"]


def under_launcher() -> bool:
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK"))


def relaunch_under_mpirun(np: int, argv: list[str]) -> None:
    """If not started by a launcher, re-run this script on ``np`` local ranks and exit with its code."""
    if under_launcher():
        return
    sys.path.insert(0, str(ROOT))
    from hvd_commopt import run
    args = run._parser().parse_args(["-np", str(np), sys.executable] + argv)
    cmd, env = run.build_command(args)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if "PYTHONPATH" not in cmd:
        cmd[1:1] = ["-x", "PYTHONPATH"]
    sys.exit(subprocess.call(cmd, env=env, cwd=ROOT))


def time_steps(step: Callable[[], None], n: int, barrier: Callable[[], None] | None = None) -> float:
    """Median seconds per call of ``step`` over ``n`` calls (after a barrier, so ranks start together)."""
    if barrier:
        barrier()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def train_step(model, opt, x, y) -> Callable[[], None]:
    """One SGD step of a torch ``model`` on ``(x, y)`` (cross-entropy), as a closure to time."""
    import torch.nn.functional as F

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def time_blocks(steps: dict[str, Callable[[], None]], blocks: int, n: int,
                barrier: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Per variant, the median seconds per step of each of ``blocks`` blocks of ``n`` steps,
    after one untimed call of each (allocations, first-touch). The variants take turns block by
    block, so a disturbance on the shared machine falls on all of them alike, in
    :func:`block_order`."""
    for s in steps.values():
        s()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for b in range(blocks):
        for k in block_order(list(steps), b):
            samples[k].append(time_steps(steps[k], n, barrier=barrier))
    return samples


def block_order(names: list[str], block: int) -> list[str]:
    """The order of the variants in block ``block``: as given in even blocks, reversed in odd
    ones. In a fixed order a variant inherits the state its predecessor leaves (caches, the
    allocator, the peers' threads): on loopback the first sparse variant after ``compute`` ran
    about 0.9 ms slower per step than the same code later in the block
    (docs/benchmarking.md#block-order). Reversing every other block gives each variant each
    neighbour on both sides."""
    return names if block % 2 == 0 else names[::-1]


def machine_info() -> dict:
    import numpy
    info = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "numpy": numpy.__version__, "platform": platform.platform()}
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        from mpi4py import MPI
        info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    except ImportError:
        pass
    return info


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True))
    return path


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
