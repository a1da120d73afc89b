"""The convergence runs' tasks (:mod:`benchmarks.convergence` says what each is and why): the digits
CNN and MLP on scikit-learn's 8x8 digits, the generated rings images with a small residual network,
and the marker of the transformer task. Apart from the runner, so that each stays under 400 lines.
"""
from __future__ import annotations

import numpy as np
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "SmallResNet", "DigitsMLP", "digits", "digits_mlp", "rings", "transformer"]


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.sc = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        return F.relu(y + (x if self.sc is None else self.sc(x)))


class SmallResNet(nn.Module):
    """ResNet-style: stem, two residual stages (8 and 16 channels), global pooling."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.s1 = Block(8, 8, 1)
        self.s2 = Block(8, 16, 2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.s2(self.s1(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def digits(seed: int = 0):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    perm = np.random.RandomState(seed).permutation(len(x))
    te, tr = perm[:360], perm[360:]
    from .suite.tta import _digits_module  # examples/pytorch_digits.py's DigitsCNN
    return x[tr], y[tr].astype(np.int64), x[te], y[te].astype(np.int64), _digits_module().DigitsCNN


class DigitsMLP(nn.Module):
    """The digits MLP users try first: 64 pixels -> 128 -> 64 -> 10, ReLU."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


def digits_mlp(seed: int = 0):
    """The digits split of :func:`digits`, trained by :class:`DigitsMLP` instead of the CNN."""
    return digits(seed)[:4] + (DigitsMLP,)


def rings(seed: int = 0, n_train: int = 2400, n_test: int = 1000, size: int = 16, classes: int = 4):
    """Generated images: class c is a ring of radius 2 + 1.5c (pixels) at a random centre, with
    random thickness jitter, scaled to the same total brightness for every class, plus 3 random
    clutter blobs and Gaussian pixel noise. The class depends on a radius, not on where or how
    much pixels are bright, so a linear model on the pixels does poorly (scikit-learn's
    LogisticRegression: see docs/benchmarking.md#convergence). The data depend on ``seed``."""
    rng = np.random.RandomState(1000 + seed)
    n = n_train + n_test
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    y = rng.randint(0, classes, n)
    img = np.zeros((n, size, size), np.float32)
    for i in range(n):
        r = 2.0 + 1.5 * y[i] + rng.uniform(-0.4, 0.4)
        cy, cx = rng.uniform(r - 1, size - r, 2) if r < size / 2 else (size / 2, size / 2)
        d = np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2)
        ring = np.exp(-((d - r) ** 2) / (2 * rng.uniform(0.3, 0.6) ** 2))
        img[i] = ring * (25.0 / ring.sum())  # the same total brightness for every class
        for _ in range(3):
            by, bx = rng.uniform(0, size, 2)
            img[i] += 0.6 * np.exp(-((yy - by) ** 2 + (xx - bx) ** 2) / (2 * 0.8 ** 2))
    img += rng.normal(0, 0.25, img.shape).astype(np.float32)
    img = img[:, None]
    return img[:n_train], y[:n_train].astype(np.int64), img[n_train:], y[n_train:].astype(np.int64), SmallResNet


def transformer(seed: int = 0):
    """Marker: the transformer task trains by steps on text (:func:`train_lm`), not on arrays."""
    return None
