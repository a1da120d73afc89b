"""Convergence check on sklearn's digits, run under ``mpirun -np 2`` by test_parallel_schedules.py.

Each rank trains on its half of the training set; every schedule runs the same number of epochs
from the same initial model and data order as synchronous SGD, and its test accuracy (of the
global model: after ``finalize()``) is printed by rank 0 as ``DIGITS {json}``.

What users run: SGD with momentum 0.9 at lr 0.1, the library's defaults. Warm-ups are shortened
from the references' 200/500/1000 iterations (a whole run here is ~360 steps); CD-SGD's threshold
is the reference's 0.5 on batch sums (``batch_size`` given). The local optimizer of OD/SSD/CD is
the default one (mirroring the wrapped optimizer, docs/od-sgd.md#local-defaults). A first untimed
run absorbs one-time start-up costs. ``argv[1:]``, if given, picks the schedules to run.
"""
import json
import sys
import time

import numpy as np
import torch
from sklearn.datasets import load_digits

import torch_plugin as hco
from hvd_commopt import Schedule

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
EPOCHS, B, LR = 8, 16, 0.1  # 8 epochs x 45 steps per rank

X, Y = load_digits(return_X_y=True)
X = (X / 16.0).astype(np.float32)
perm = np.random.RandomState(0).permutation(len(X))
test_idx, train_idx = perm[:360], perm[360:]
Xte, Yte = torch.from_numpy(X[test_idx]), torch.from_numpy(Y[test_idx])
mine = train_idx[R::P]
Xtr, Ytr = torch.from_numpy(X[mine]), torch.from_numpy(Y[mine])
steps_per_epoch = len(mine) // B

SCHEDULES = {
    "ssgd": Schedule.sync(),
    "od": Schedule.od(warmup_steps=50),
    "ssd": Schedule.ssd(warmup_steps=50),
    "cd": Schedule.cd(warmup_steps=50, batch_size=B),
    # the reference local optimizers, for comparison (not asserted)
    "od_reference": Schedule.od(warmup_steps=50, local="reference"),
    "ssd_reference": Schedule.ssd(warmup_steps=50, local="reference"),
    "cd_reference": Schedule.cd(warmup_steps=50, batch_size=B, local="reference"),
    "cocod": Schedule.cocod(4),
    "local_sgd": Schedule.local_sgd(4),
}


def run(schedule):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                   named_parameters=model.named_parameters(), schedule=schedule)
    g = torch.Generator().manual_seed(1 + R)
    for _ in range(EPOCHS):
        order = torch.randperm(len(Xtr), generator=g)
        for i in range(steps_per_epoch):
            idx = order[i * B:(i + 1) * B]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(Xtr[idx]), Ytr[idx]).backward()
            opt.step()
    opt.finalize()
    with torch.no_grad():
        return 100.0 * (model(Xte).argmax(1) == Yte).float().mean().item()


run(Schedule.sync())  # one-time costs (first collectives) out of the timings
acc, times = {}, {}
pick = sys.argv[1:] or [n for n in SCHEDULES if not n.endswith("_reference")]
for name in ["ssgd"] + [n for n in pick if n != "ssgd"]:
    sched = SCHEDULES[name]
    t0 = time.perf_counter()
    acc[name] = run(sched)
    times[name] = time.perf_counter() - t0
if R == 0:
    print("DIGITS " + json.dumps(acc))
    print("seconds " + json.dumps({k: round(v, 2) for k, v in times.items()}))
