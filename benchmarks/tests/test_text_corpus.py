"""The transformer workload's pieces: the stdlib byte corpus (splits, determinism, batches) and the
CPU-sized GPT shape."""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from benchmarks import text_corpus as tc  # noqa: E402
from benchmarks.gpt_model import GPT, GPT_CPU, GPT_TINY, lm_loss  # noqa: E402


def test_splits_hold_whole_disjoint_files() -> None:
    train, val = set(tc.corpus_files("train")), set(tc.corpus_files("val"))
    assert train and val and not train & val
    assert not any({"site-packages", "dist-packages", "test"} & set(p.parts) for p in train | val)
    # roughly VAL_FRACTION of the files are held out
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15


def test_corpus_is_deterministic_bytes_and_capped() -> None:
    a = tc.load_text_corpus(128)
    tc._corpus_bytes.cache_clear()
    b = tc.load_text_corpus(128)
    assert a.dtype == torch.long and a.dim() == 1 and torch.equal(a, b)
    assert int(a.min()) >= 0 and int(a.max()) < tc.VOCAB
    assert a.numel() == tc.TRAIN_BYTES
    v = tc.load_text_corpus(128, split="val")
    assert 0 < v.numel() <= tc.VAL_BYTES
    # no val window appears in train: a 64-byte window of val's middle is not a substring of train
    tr, mid = bytes(a.to(torch.uint8).tolist()), v.numel() // 2
    assert bytes(v[mid:mid + 64].to(torch.uint8).tolist()) not in tr
    other = tc.load_text_corpus(128, seed=1)
    assert not torch.equal(other[:4096], a[:4096])  # the seed salts the split and the order


def test_corpus_loads_quickly() -> None:
    tc._corpus_bytes.cache_clear()
    t0 = time.perf_counter()
    tc.load_text_corpus(128)
    tc.load_text_corpus(128, split="val")
    assert time.perf_counter() - t0 < 5.0  # < 2 s unloaded; slack for a shared CI machine


def test_bad_split_and_context_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="'train' or 'val'"):
        tc.load_text_corpus(128, split="test")
    with pytest.raises(ValueError, match="context"):
        tc.load_text_corpus(0)


def test_batches_are_next_token_pairs_and_reproducible() -> None:
    tokens = torch.arange(1000)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    it1, it2 = tc.batches(tokens, 4, 16, g1), tc.batches(tokens, 4, 16, g2)
    for _ in range(3):
        (x, y), (x2, y2) = next(it1), next(it2)
        assert x.shape == y.shape == (4, 16)
        assert torch.equal(y, x + 1)  # arange: the next token is the value plus one
        assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = next(tc.batches(tokens, 4, 16, torch.Generator().manual_seed(4)))
    assert not torch.equal(x3, next(tc.batches(tokens, 4, 16, torch.Generator().manual_seed(3)))[0])


def test_eval_windows_fixed_and_non_overlapping() -> None:
    tokens = torch.arange(1000)
    x, y = tc.eval_windows(tokens, 16, 10)
    assert x.shape == (10, 16) and torch.equal(y, x + 1)
    starts = x[:, 0].tolist()
    assert all(b - a >= 16 for a, b in zip(starts, starts[1:]))
    x2, _ = tc.eval_windows(tokens, 16, 10)
    assert torch.equal(x, x2)
    assert tc.eval_windows(tokens, 16, 10_000)[0].shape[0] == 999 // 16


def test_gpt_cpu_shape_and_parameter_count() -> None:
    assert GPT_CPU.vocab == tc.VOCAB and GPT_CPU.context == 128
    n = sum(p.numel() for p in GPT(GPT_CPU).parameters())
    assert 5_000_000 <= n <= 10_000_000, n
    # exact: per block 12 w^2 + 13 w (qkv, proj, fc, out, two LayerNorms), tied embedding, positions, final LN
    w, layers = GPT_CPU.width, GPT_CPU.layers
    assert n == layers * (12 * w * w + 13 * w) + GPT_CPU.vocab * w + GPT_CPU.context * w + 2 * w


def test_gpt_trains_on_the_corpus() -> None:
    torch.manual_seed(0)
    s = GPT_TINY.__class__(layers=2, heads=2, width=32, context=16, vocab=tc.VOCAB)
    model = GPT(s)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    it = tc.batches(tc.load_text_corpus(s.context), 16, s.context, torch.Generator().manual_seed(0))
    losses = []
    for _ in range(40):
        x, y = next(it)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # ~ln 256 = 5.55 at random init
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
