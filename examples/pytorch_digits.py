"""Train a small CNN on scikit-learn's digits with hvd_commopt, one shard per rank.

    python -m hvd_commopt.run -np 2 python examples/pytorch_digits.py      # 2 local ranks
    python examples/pytorch_digits.py                                       # 1 process, no MPI

The dataset ships inside scikit-learn (1,797 8x8 images), so nothing is downloaded.
Integration points are marked ``# hvd_commopt:``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import torch_plugin as hco  # hvd_commopt: the one import a Horovod user changes


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load(seed: int):
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    return train_test_split(x, d.target.astype(np.int64), test_size=0.25, random_state=seed, stratify=d.target)


def compression_from_args(args):
    return {"none": hco.Compression.none, "fp16": hco.Compression.fp16, "bf16": hco.Compression.bf16}[args.compression]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the number of ranks")
    p.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    p.add_argument("--fusion-threshold-mb", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    hco.init()  # hvd_commopt: rank/size from mpirun (or size 1 without a launcher)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    x_tr, x_te, y_tr, y_te = load(args.seed)
    # hvd_commopt: every rank trains on its own shard of the data
    x_tr, y_tr = torch.from_numpy(x_tr[hco.rank()::hco.size()]), torch.from_numpy(y_tr[hco.rank()::hco.size()])

    model = DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hco.size(), momentum=0.9)  # hvd_commopt: scale lr by size
    threshold = None if args.fusion_threshold_mb is None else int(args.fusion_threshold_mb * 1024 * 1024)
    opt = hco.DistributedOptimizer(opt, named_parameters=model.named_parameters(),  # hvd_commopt: the one line
                                   compression=compression_from_args(args), fusion_threshold=threshold)
    hco.broadcast_parameters(model.state_dict(), root_rank=0)  # hvd_commopt: same start everywhere
    hco.broadcast_optimizer_state(opt, root_rank=0)

    g = torch.Generator().manual_seed(args.seed + hco.rank())
    steps = len(x_tr) // args.batch_size  # the same on every rank (shards differ by at most one sample)
    steps = int(hco.allreduce(torch.tensor(float(steps)), op=hco.Sum).item() // hco.size())
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x_tr), generator=g)
        model.train()
        total = 0.0
        for i in range(steps):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        model.eval()
        with torch.no_grad():
            acc = (model(torch.from_numpy(x_te)).argmax(1).numpy() == y_te).mean()
        # hvd_commopt: average the metric over ranks (identical here: the weights are identical)
        loss_avg = hco.allreduce(torch.tensor(total / steps)).item()
        if hco.rank() == 0:
            print(f"epoch {epoch + 1:2d}  loss {loss_avg:.4f}  test accuracy {acc:.4f}", flush=True)
    if hco.rank() == 0:
        stats = opt.comm_stats
        print(f"ranks {hco.size()}  time {time.perf_counter() - t0:.1f}s  final test accuracy {acc:.4f}  "
              f"bytes sent per step {stats['bytes_sent']}  buckets {len(stats['per_bucket'])}", flush=True)
    return float(acc)


if __name__ == "__main__":
    main()
