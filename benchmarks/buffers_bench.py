"""What ``broadcast_buffers=True`` costs per step (docs/usage.md#buffers), under a real mpirun.

Run: ``mpirun -np 2 python -m benchmarks.buffers_bench`` (add ``--allow-run-as-root
--oversubscribe`` as needed). A small CNN with BatchNorm after every convolution is trained with
``model=`` and ``broadcast_buffers`` True and False, interleaved, in the same job; rank 0
prints the median time of ``step()`` alone and of the whole iteration (zero_grad, forward,
backward, step) with each setting, and their ratios. The broadcast starts at the end of ``step()``
and completes in the next forward's pre-hook.
Results also go to benchmarks/results/buffers_bench.json.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

import torch_plugin as hco


def model(width: int = 32, depth: int = 6) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, width, 3, padding=1)]
    for _ in range(depth):
        layers += [torch.nn.BatchNorm2d(width), torch.nn.ReLU(), torch.nn.Conv2d(width, width, 3, padding=1)]
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, 10)]
    return torch.nn.Sequential(*layers)


def run(broadcast: bool, steps: int) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    m = model()
    opt = hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
                                   model=m, broadcast_buffers=broadcast)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    times, step_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        times.append(t2 - t0)
        step_times.append(t2 - t1)
    return times[3:], step_times[3:]


def main() -> None:
    hco.init()
    torch.set_num_threads(1)
    res: dict[str, list[float]] = {"iter_on": [], "iter_off": [], "step_on": [], "step_off": []}
    for _ in range(3):  # interleaved: the machine's load drifts
        for flag in (True, False):
            times, step_times = run(flag, 30)
            res["iter_on" if flag else "iter_off"] += times
            res["step_on" if flag else "step_off"] += step_times
    if hco.rank() == 0:
        med = {k: statistics.median(v) for k, v in res.items()}
        nbytes = sum(t.numel() * t.element_size() for _, t in model().named_buffers())
        out = {"ranks": hco.size(), "buffer_bytes": nbytes, **{f"{k}_s": v for k, v in med.items()},
               "step_ratio_on_over_off": med["step_on"] / med["step_off"],
               "iteration_ratio_on_over_off": med["iter_on"] / med["iter_off"]}
        print(json.dumps(out, indent=1))
        Path("benchmarks/results").mkdir(parents=True, exist_ok=True)
        Path("benchmarks/results/buffers_bench.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
