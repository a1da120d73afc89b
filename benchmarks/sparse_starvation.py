"""Per-tensor entries of the reduced sparse gradient per step: which layers a fused Top-k starves.

    mpirun -np 4 python -m benchmarks.sparse_starvation            # rings task, Top-k 0.01, 3 epochs
    mpirun -np 4 python -m benchmarks.sparse_starvation --dense-1d # the default: 1-D tensors sent whole

For every parameter, the mean number of non-zero entries of the reduced gradient per step and the
share of steps in which it received none (docs/benchmarking.md#convergence, 4 ranks). Without
``--dense-1d`` every tensor shares the bucket's one selection (``dense_1d=False``, what the
measurement in docs/topk.md#dense-1d was taken with).
"""
import sys

import numpy as np
import torch

import torch_plugin as hco
from hvd_commopt import Compression
from benchmarks import convergence as C
torch.set_num_threads(1)
hco.init()
P, R = hco.size(), hco.rank()
xtr, ytr, xte, yte, cls = C.rings()
mine = np.arange(len(xtr))[R::P]
X, Y = torch.from_numpy(xtr[mine]), torch.from_numpy(ytr[mine])
torch.manual_seed(0)
model = cls()
opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               named_parameters=model.named_parameters(), compression=Compression.topk(0.01, dense_1d="--dense-1d" in sys.argv))
names = [n for n, _ in model.named_parameters()]
cnt: dict = {n: [] for n in names}
steps = len(mine) // 16
for ep in range(3):
    perm = torch.randperm(len(X))
    for i in range(steps):
        b = perm[i*16:(i+1)*16]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X[b]), Y[b]).backward()
        opt.synchronize()
        for n, p in model.named_parameters():
            cnt[n].append(int((p.grad != 0).sum()))
        with opt.skip_synchronize():
            opt.step()
if R == 0:
    for n, p in model.named_parameters():
        c = np.array(cnt[n])
        print(f"{n:30s} numel {p.numel():5d}  entries/step {c.mean():6.2f}  steps with none {100*(c==0).mean():5.1f}%")
