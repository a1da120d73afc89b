"""Models shared by the benchmarks.

* ``resnet18()``: the ResNet-18-shaped CNN of examples/pytorch_synthetic_benchmark.py (one
  definition, imported from there), 11.2M parameters on 32x32 inputs.
* ``deep_mlp()``: many small layers, the case where per-message latency dominates and merging
  matters most (MG-WFBP's motivating regime).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch.nn as nn

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pytorch_synthetic_benchmark.py"
_spec = importlib.util.spec_from_file_location("hvd_commopt_example_resnet", _EXAMPLE)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
ResNet = _mod.ResNet

__all__ = ["ResNet", "resnet18", "deep_mlp"]


def resnet18(width: int = 64, num_classes: int = 10) -> nn.Module:
    return ResNet((2, 2, 2, 2), width=width, num_classes=num_classes)


def deep_mlp(depth: int = 48, width: int = 256, inputs: int = 64, num_classes: int = 10) -> nn.Module:
    layers = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
