"""What ``broadcast_buffers=True`` costs per step (docs/usage.md#buffers), under a real mpirun.

Run: ``mpirun -np 2 python -m benchmarks.buffers_bench`` (add ``--allow-run-as-root
--oversubscribe`` as needed). A small CNN with BatchNorm after every convolution is trained with
``named_buffers`` and ``broadcast_buffers`` True and False, interleaved, in the same job; rank 0
prints the median step time of each and their ratio, and the per-step broadcast's own median time.
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
                                   named_buffers=m.named_buffers(), broadcast_buffers=broadcast)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    times, bcast = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        opt._hco_buffers.broadcast()  # the per-step message alone, timed apart
        bcast.append(time.perf_counter() - t1)
    return times[3:], bcast[3:]


def main() -> None:
    hco.init()
    torch.set_num_threads(1)
    res: dict[str, list[float]] = {"on": [], "off": [], "broadcast": []}
    for _ in range(3):  # interleaved: the machine's load drifts
        for flag in (True, False):
            times, bcast = run(flag, 30)
            res["on" if flag else "off"] += times
            res["broadcast"] += bcast
    if hco.rank() == 0:
        on, off, b = (statistics.median(res[k]) for k in ("on", "off", "broadcast"))
        nbytes = sum(t.numel() * t.element_size() for _, t in model().named_buffers())
        out = {"ranks": hco.size(), "buffer_bytes": nbytes, "step_on_s": on, "step_off_s": off,
               "ratio_on_over_off": on / off, "broadcast_s": b, "broadcast_share_of_step": b / on}
        print(json.dumps(out, indent=1))
        Path("benchmarks/results").mkdir(parents=True, exist_ok=True)
        Path("benchmarks/results/buffers_bench.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
