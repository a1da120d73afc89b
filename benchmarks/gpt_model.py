"""A GPT-2-small-shaped decoder for the GPU benchmark, defined here so nothing is downloaded.

GPT-2 small: 12 layers, 12 heads, width 768, context 1024, vocabulary 50257, learned positions,
pre-LayerNorm blocks, GELU MLP of 4x width, the output projection tied to the token embedding:
124.4M parameters. Attention is ``F.scaled_dot_product_attention(is_causal=True)`` (flash
attention on a GPU). Random weights; only the shape and the step's cost matter here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTShape", "GPT", "lm_loss", "GPT2_SMALL", "GPT_TINY"]


@dataclass(frozen=True)
class GPTShape:
    layers: int
    heads: int
    width: int
    context: int
    vocab: int


GPT2_SMALL = GPTShape(layers=12, heads=12, width=768, context=1024, vocab=50257)
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

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(pos))
        return self.head(self.ln(x))



def lm_loss(logits, target):
    """Next-token cross-entropy in float32 (the logits may be bf16 under autocast)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
