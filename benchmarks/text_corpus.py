"""A text corpus that needs no download: the Python standard library's own source, as bytes.

    tokens = load_text_corpus(context=128)                  # train split, torch.LongTensor, vocab 256
    val = load_text_corpus(context=128, split="val")
    for x, y in batches(tokens, batch=8, context=128, generator=torch.Generator().manual_seed(0)):
        ...                                                  # x, y: (8, 128), y is x shifted by one

Byte-level tokens (vocabulary 256, no tokenizer to train or ship) from the ``.py`` files under
``sysconfig.get_paths()["stdlib"]``; ``site-packages``/``dist-packages`` (whatever happens to be
installed), ``test`` packages and ``__pycache__`` are left out, so two machines with the same
Python version read the same text.

Choices:

* **Whole files per split.** Each file goes to ``val`` when a hash of its relative path and the
  seed falls in the lowest ``VAL_FRACTION`` of the range, else to ``train``: no file, hence no
  line, is in both splits (a split by position would cut files in half, and the near-duplicate
  boilerplate of neighbouring lines would leak).
* **Deterministic order and a size cap.** Files are taken in the order of a second hash of their
  path (a mix of the whole library rather than the alphabetically first packages), each split
  stops at its cap (``TRAIN_BYTES``, ``VAL_BYTES``), files are joined with one blank line. Listing
  the ~750 candidate files and reading ~3.3 MiB of them takes about 0.2 s; the result is cached per
  process.
* ``seed`` salts both hashes, so seeds give different (equally deterministic) splits; seed 0 is the
  one the benchmarks report.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["load_text_corpus", "batches", "eval_windows", "VOCAB", "TRAIN_BYTES", "VAL_BYTES", "VAL_FRACTION",
           "corpus_files"]

VOCAB = 256  # byte-level
TRAIN_BYTES = 3 * 2**20
VAL_BYTES = 256 * 2**10
VAL_FRACTION = 0.1
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _hash(text: str) -> float:
    """A stable number in [0, 1) (Python's ``hash`` of a str changes per process)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") / 2**64


def corpus_files(split: str, seed: int = 0) -> list[Path]:
    """The stdlib files of ``split`` in reading order (before the size cap)."""
    _check_split(split)
    root = _stdlib()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)  # pruned, not walked
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            rel = p.relative_to(root).as_posix()
            in_val = _hash(f"split:{seed}:{rel}") < VAL_FRACTION
            if in_val == (split == "val"):
                files.append((_hash(f"order:{seed}:{rel}"), rel, p))
    return [p for _, _, p in sorted(files)]


@functools.lru_cache(maxsize=8)
def _corpus_bytes(split: str, seed: int) -> bytes:
    cap = TRAIN_BYTES if split == "train" else VAL_BYTES
    parts: list[bytes] = []
    size = 0
    for p in corpus_files(split, seed):
        if size >= cap:
            break
        data = p.read_bytes()[: cap - size]
        parts.append(data)
        size += len(data) + 2
    return b"\n\n".join(parts)[:cap]


def _check_split(split: str) -> None:
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")


def load_text_corpus(context: int, split: str = "train", seed: int = 0) -> torch.LongTensor:
    """The ``split`` ("train" or "val") of the stdlib corpus as a 1-D LongTensor of byte values.

    ``context`` is the model's context length: the corpus must hold at least one (x, y) pair of
    that length, else this raises naming the sizes (a stdlib stripped of its sources, e.g. some
    embedded Pythons, ships only ``.pyc``).
    """
    _check_split(split)
    if context < 1:
        raise ValueError(f"context must be >= 1, not {context}")
    data = _corpus_bytes(split, seed)
    if len(data) < context + 1:
        raise RuntimeError(f"the {split} split of the stdlib corpus under {_stdlib()} holds {len(data)} bytes, "
                           f"fewer than context + 1 = {context + 1}: this Python ships no .py sources there; "
                           "use a full CPython install")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, batch: int, context: int,
            generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random (x, y) next-token pairs: ``batch`` windows of ``context`` tokens at offsets
    drawn from ``generator``, ``y`` the same windows one token on. Same generator state, same
    batches (each rank passes a generator seeded with its rank for data parallelism)."""
    n = tokens.numel() - context - 1
    if n < 0:
        raise ValueError(f"{tokens.numel()} tokens cannot make a window of context {context} plus one")
    ar = torch.arange(context)
    while True:
        starts = torch.randint(0, n + 1, (batch,), generator=generator)
        idx = starts[:, None] + ar[None, :]
        yield tokens[idx], tokens[idx + 1]


def eval_windows(tokens: torch.Tensor, context: int, max_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed evaluation set: up to ``max_windows`` non-overlapping windows spread evenly over
    ``tokens`` (x, y of shape (windows, context)); the same on every call, rank and variant."""
    avail = (tokens.numel() - 1) // context
    if avail < 1:
        raise ValueError(f"{tokens.numel()} tokens cannot make a window of context {context} plus one")
    count = min(max_windows, avail)
    starts = (torch.arange(count) * (avail // count)) * context
    idx = starts[:, None] + torch.arange(context)[None, :]
    return tokens[idx], tokens[idx + 1]
