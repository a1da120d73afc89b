"""Synthetic throughput benchmark (images/sec), like Horovod's pytorch_synthetic_benchmark.py.

    python examples/pytorch_synthetic_benchmark.py                     # one process
    torchrun --nproc-per-node 4 examples/pytorch_synthetic_benchmark.py   # one GPU per rank
    python -m hvd_commopt.run -np 2 python examples/pytorch_synthetic_benchmark.py --num-iters 5

As Horovod's: on the GPU when CUDA is there (each rank on ``cuda:<local rank>``; ``--no-cuda``
to stay on the CPU), torchvision's ResNet-50 on 224x224 images when torchvision is installed
(``--model resnet50``, the default then), else a ResNet-18-shaped CNN for 32x32 inputs (11.2M
parameters) defined here (``--model resnet18``). Synthetic data: nothing is downloaded.
Integration points are marked ``# hvd_commopt:``.
"""
from __future__ import annotations

import argparse
import importlib.util
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_plugin as hco


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    """ResNet for 32x32 images; ``blocks=(2, 2, 2, 2)`` is ResNet-18's shape."""

    def __init__(self, blocks=(2, 2, 2, 2), width: int = 64, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-cuda", action="store_true", help="stay on the CPU even when CUDA is there")
    p.add_argument("--model", choices=["resnet50", "resnet18"], default=None,
                   help="torchvision's ResNet-50 (default when torchvision is installed) or the built-in "
                        "ResNet-18-shaped CNN for 32x32 inputs")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default 32 on a GPU, as Horovod's; 8 on CPU)")
    p.add_argument("--image-size", type=int, default=None, help="default 224 for ResNet-50, 32 for the built-in CNN")
    p.add_argument("--num-warmup-batches", type=int, default=2)
    p.add_argument("--num-batches-per-iter", type=int, default=2)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--width", type=int, default=64, help="64 = ResNet-18 (11.2M params)")
    p.add_argument("--fp16-allreduce", action="store_true", help="Compression.fp16 (Horovod's flag)")
    p.add_argument("--fusion-threshold-mb", type=float, default=None)
    args = p.parse_args(argv)

    hco.init()  # hvd_commopt
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hco.local_rank())  # hvd_commopt: one GPU per rank, as Horovod's examples
    else:
        torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.model is None:
        args.model = "resnet50" if importlib.util.find_spec("torchvision") is not None else "resnet18"
    args.batch_size = args.batch_size or (32 if cuda else 8)
    args.image_size = args.image_size or (224 if args.model == "resnet50" else 32)
    torch.manual_seed(0)
    if args.model == "resnet50":
        import torchvision
        model, classes, what = torchvision.models.resnet50(), 1000, "torchvision ResNet-50"
    else:
        model, classes, what = ResNet(width=args.width), 10, "ResNet-18-shaped"
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hco.size(), momentum=0.9)
    threshold = None if args.fusion_threshold_mb is None else int(args.fusion_threshold_mb * 1024 * 1024)
    opt = hco.DistributedOptimizer(opt, named_parameters=model.named_parameters(),  # hvd_commopt
                                   compression=hco.Compression.fp16 if args.fp16_allreduce else hco.Compression.none,
                                   fusion_threshold=threshold)
    hco.broadcast_parameters(model.state_dict(), root_rank=0)  # hvd_commopt
    hco.broadcast_optimizer_state(opt, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, classes, (args.batch_size,), device=device)

    def benchmark_step():
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()  # the step's time, not its launch's

    def log(s):
        if hco.rank() == 0:
            print(s, flush=True)

    nparams = sum(p.numel() for p in model.parameters())
    log(f"Model: {what} ({nparams / 1e6:.1f}M parameters), batch size {args.batch_size} of "
        f"{args.image_size}x{args.image_size}, ranks {hco.size()}, device {device.type}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)
    mean, conf = np.mean(rates), 1.96 * np.std(rates)
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hco.size()} rank(s): {hco.size() * mean:.1f} +-{hco.size() * conf:.1f}")
    log(f"Bytes sent per step per rank: {opt.comm_stats['bytes_sent']}; waiting {opt.comm_stats['wait_seconds'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
