"""GPT-style decoders for the benchmarks, defined here so nothing is downloaded.

GPT-2 small: 12 layers, 12 heads, width 768, context 1024, vocabulary 50257, learned positions,
pre-LayerNorm blocks, GELU MLP of 4x width, the output projection tied to the token embedding:
124.4M parameters; GPT-2's initialisation (N(0, 0.02), residual projections scaled by
1/sqrt(2 x layers)). Attention is ``F.scaled_dot_product_attention(is_causal=True)`` (flash
attention on a GPU). The GPU benchmark runs it with random weights (only the shape and the step's cost matter there).

``GPT_CPU`` is the same architecture sized for 2 CPU ranks, trained on byte-level text
(benchmarks/text_corpus.py, vocabulary 256): 8 layers, 8 heads, width 256, context 128, 6.4M
parameters (6.3M in the blocks, where a 5-10M model's step costs ~0.5-1 s on one core at 8 x 128
tokens). ``GPT_TINY`` is for unit tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTShape", "GPT", "lm_loss", "GPT2_SMALL", "GPT_CPU", "GPT_TINY"]


@dataclass(frozen=True)
class GPTShape:
    layers: int
    heads: int
    width: int
    context: int
    vocab: int


GPT2_SMALL = GPTShape(layers=12, heads=12, width=768, context=1024, vocab=50257)
GPT_CPU = GPTShape(layers=8, heads=8, width=256, context=128, vocab=256)  # byte-level text, 2 CPU ranks
GPT_TINY = GPTShape(layers=2, heads=2, width=32, context=16, vocab=64)  # CPU tests


class Block(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.heads = s.heads
        self.ln1, self.ln2 = nn.LayerNorm(s.width), nn.LayerNorm(s.width)
        self.qkv = nn.Linear(s.width, 3 * s.width)
        self.proj = nn.Linear(s.width, s.width)
        self.fc, self.out = nn.Linear(s.width, 4 * s.width), nn.Linear(4 * s.width, s.width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, s: GPTShape = GPT2_SMALL):
        super().__init__()
        self.shape = s
        self.tok, self.pos = nn.Embedding(s.vocab, s.width), nn.Embedding(s.context, s.width)
        self.blocks = nn.Sequential(*[Block(s) for _ in range(s.layers)])
        self.ln = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2's
        self.apply(self._init_weights)
        for b in self.blocks:  # GPT-2's scaled init of the residual projections
            for lin in (b.proj, b.out):
                nn.init.normal_(lin.weight, std=0.02 / (2 * s.layers) ** 0.5)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights and embeddings, zero biases. torch's defaults
        (N(0, 1) embeddings, tied to the output) start a byte-level model at loss ~128, not ln 256."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(pos))
        return self.head(self.ln(x))


def lm_loss(logits, target):
    """Next-token cross-entropy in float32 (the logits may be bf16 under autocast)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
