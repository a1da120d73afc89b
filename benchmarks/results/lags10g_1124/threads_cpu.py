"""LAGS one bucket per layer on deep_mlp: median step and each thread's CPU per step (threads_cpu.txt).

    S=benchmarks/results/lags10g_1124/threads_cpu.py
    python -m benchmarks.netemu --ranks 2 --rate 10gbit -- .venv/bin/python $S
    python -m benchmarks.netemu --ranks 2 --rate 10gbit -- env HVD_COMMOPT_BACKEND=mpi .venv/bin/python $S

CPU per thread from /proc/self/task/<tid>/stat (utime + stime) over 150 steps after 15 untimed.
"""
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

import torch_plugin as hco  # noqa: E402
from benchmarks.common import train_step  # noqa: E402
from benchmarks.models import deep_mlp  # noqa: E402
from hvd_commopt import runtime  # noqa: E402

torch.set_num_threads(1)
hco.init()
torch.manual_seed(0)
base = deep_mlp()
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
opt = hco.DistributedOptimizer(torch.optim.SGD(base.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=base.named_parameters(),
                               compression=hco.Compression.topk(0.01), fusion_threshold=0)
step = train_step(base, opt, x, y)
for _ in range(15):
    step()
comm = runtime.communicator()
names = {threading.main_thread().native_id: "main"}
for t in threading.enumerate():
    names.setdefault(t.native_id, t.name)


def cpu() -> dict[int, tuple[str, float]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            st = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue
        out[int(tid)] = (name, (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK"))
    return out


N = 150
comm.barrier()
c0, ts = cpu(), []
for _ in range(N):
    t = time.perf_counter()
    step()
    ts.append(time.perf_counter() - t)
rows = []
for tid, (name, v) in cpu().items():
    d = v - c0.get(tid, (name, 0.0))[1]
    if d > 0.005:
        rows.append(f"{names.get(tid, name)}:{d / N * 1e3:.2f}")
print(f"rank {hco.rank()} median step {statistics.median(ts) * 1e3:.2f} ms; cpu ms/step " + " ".join(sorted(rows)),
      flush=True)
