"""The throughput job's models: what one rank builds, feeds and differentiates per step.

* ``deep_mlp``: many small layers (per-message latency dominates), batch 32 of 64 features.
* ``resnet18``: the ResNet-18-shaped CNN, batch 8 of 3x32x32.
* ``transformer``: the GPT-style decoder of benchmarks/gpt_model.py on byte-level text from the
  Python standard library (benchmarks/text_corpus.py), next-token loss. Its shape (``shape``):
  ``cpu`` (GPT_CPU, 6.4M parameters, batch 8 x 128 tokens) on CPU ranks, ``gpt2_small``
  (124M, batch 8 x 1024) on a GPU, ``tiny`` for ``--quick``; ``auto`` picks ``gpt2_small`` on
  CUDA, else ``cpu`` (``tiny`` when quick).

Every model's loss is the cross-entropy over the last dimension (:func:`~benchmarks.gpt_model.lm_loss`:
a (batch, classes) output with (batch,) labels is the ordinary classification loss).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Workload", "workload", "MODELS", "TRANSFORMER_SHAPES", "transformer_shape", "rank_device"]

MODELS = ("resnet18", "deep_mlp", "transformer")
TRANSFORMER_SHAPES = ("auto", "cpu", "gpt2_small", "tiny")


@dataclass
class Workload:
    """``build()`` the model (on ``device``), ``batch()`` one rank's fixed (x, y), ``loss(out, y)``."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    batch_per_rank: int
    device: torch.device
    tokens_per_sample: int = 1  # the transformer: context tokens per sample

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from benchmarks.gpt_model import lm_loss
        return lm_loss(out, y)


def rank_device(device: str, rank: int) -> torch.device:
    """``cpu``, or ``cuda``: this rank's GPU (rank modulo the GPUs on the host; one per rank)."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise SystemExit(f"unknown device {device!r}: use cpu or cuda")
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device here; use --device cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def transformer_shape(shape: str, device: torch.device, quick: bool):
    """The GPTShape for ``shape`` (see the module docstring)."""
    from benchmarks import gpt_model as G
    if shape == "auto":
        shape = "gpt2_small" if device.type == "cuda" else ("tiny" if quick else "cpu")
    shapes = {"cpu": G.GPT_CPU, "gpt2_small": G.GPT2_SMALL,
              "tiny": G.GPTShape(layers=2, heads=2, width=64, context=32, vocab=256)}
    if shape not in shapes:
        raise SystemExit(f"unknown transformer shape {shape!r}: use one of {', '.join(TRANSFORMER_SHAPES)}")
    return shapes[shape]


def workload(name: str, quick: bool, device: torch.device, shape: str = "auto", seed: int = 0) -> Workload:
    """The throughput job's model ``name`` (one of :data:`MODELS`)."""
    from benchmarks.models import deep_mlp, resnet18
    g = torch.Generator().manual_seed(seed)
    if name == "resnet18":
        return Workload(name, lambda: resnet18(width=16 if quick else 64).to(device),
                        lambda: (torch.randn(8, 3, 32, 32, generator=g).to(device),
                                 torch.randint(0, 10, (8,), generator=g).to(device)), 8, device)
    if name == "deep_mlp":
        return Workload(name, lambda: deep_mlp(depth=12 if quick else 48).to(device),
                        lambda: (torch.randn(32, 64, generator=g).to(device),
                                 torch.randint(0, 10, (32,), generator=g).to(device)), 32, device)
    if name == "transformer":
        from benchmarks.gpt_model import GPT
        from benchmarks.text_corpus import batches, load_text_corpus
        s = transformer_shape(shape, device, quick)
        batch = 8

        def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
            x, y = next(batches(load_text_corpus(s.context), batch, s.context, g))
            return x.to(device), y.to(device)
        return Workload(name, lambda: GPT(s).to(device), make_batch, batch, device, tokens_per_sample=s.context)
    raise SystemExit(f"unknown model {name!r}: use one of {', '.join(MODELS)}")
