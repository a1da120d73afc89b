"""torch.amp.GradScaler with every compressor (docs/wrapper.md#nonfinite).

Two in-process ranks; rank 0's batch at step BAD holds an Inf, so its gradients overflow. Used the
Horovod way (synchronize, unscale_, step inside skip_synchronize), the scaler must skip that step on
every rank and halve its scale, every memory must stay finite, and the run must equal, bit for bit,
a run that never saw that batch (the scale set to the same value at the same point).
"""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.memory import ErrorFeedback  # noqa: E402
from hvd_commopt.compress.cast import FP16Compressor  # noqa: E402
from hvd_commopt.reduce import DenseAllreduce  # noqa: E402

STEPS, BAD, SCALE = 6, 2, 2.0 ** 10
KINDS = {
    "none": lambda: None,
    "fp16": lambda: hco.Compression.fp16,
    "fp16_ef": lambda: DenseAllreduce(FP16Compressor(), ErrorFeedback()),
    "topk": lambda: Compression.topk(0.2),
    "topk_dense": lambda: Compression.topk(1.0),
    "randomk": lambda: Compression.randomk(0.2, seed=1),
    "dgc": lambda: Compression.dgc(0.2, sample_ratio=1.0),
    "gtopk": lambda: Compression.gtopk(0.2),
}
_LOCK = threading.Lock()


def make_model():
    with _LOCK:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(rank):
    g = torch.Generator().manual_seed(rank)
    out = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]
    if rank == 0:
        out[BAD][0][0, 0] = float("inf")
    return out


def memory_tensors(opt):
    mem = opt.comm_engine.reducer.state_dict().get("memory", {})
    return {f"{k}/{n}": t.clone() for k, d in mem.items() for n, t in d.items()}


def train(comm, kind, skip_bad):
    torch.set_num_threads(1)
    model = make_model()
    momentum = 0.0 if kind == "dgc" else 0.9  # DGC applies momentum itself
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                   named_parameters=model.named_parameters(), compression=KINDS[kind](),
                                   communicator=comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    scales, skipped = [], []
    for s, (x, y) in enumerate(batches(comm.rank)):
        if skip_bad and s == BAD:
            scaler.update(new_scale=SCALE / 2)  # mirror the backoff the bad step causes
            continue
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
        for k, t in memory_tensors(opt).items():
            assert torch.isfinite(t).all(), (comm.rank, s, k)
    return [p.detach().clone() for p in model.parameters()], memory_tensors(opt), scales, skipped


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_gradscaler_skips_the_inf_step_and_nothing_else(kind):
    P = 2
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = run_ranks(P, lambda comm: train(comm, kind, False))
    b = run_ranks(P, lambda comm: train(comm, kind, True))
    if kind not in ("none", "fp16"):  # a memory: the overflowing rank says so
        assert any("rank 0: the gradient of bucket" in str(w.message) for w in rec)
    for r in range(P):
        params_a, mem_a, scales, skipped = a[r]
        params_b, mem_b, _, _ = b[r]
        assert skipped == [s == BAD for s in range(STEPS)], skipped  # that step only, on every rank
        assert scales[BAD] == SCALE / 2 and scales[-1] == SCALE / 2
        for pa, pb in zip(params_a, params_b):
            assert torch.equal(pa, pb), f"{kind} rank {r}"
        assert mem_a.keys() == mem_b.keys()
        for k in mem_a:
            assert torch.equal(mem_a[k], mem_b[k]), f"{kind} rank {r} {k}"
    for pa, pb in zip(a[0][0], a[1][0]):
        assert torch.equal(pa, pb)  # ranks agree
    assert np.isfinite([float(p.sum()) for p in a[0][0]]).all()


def train_plain(comm, kind, skip_bad):
    """DDP's idiom: scaler.scale(loss).backward(); scaler.step(opt); scaler.update() (docs/usage.md#amp)."""
    torch.set_num_threads(1)
    model = make_model()
    momentum = 0.0 if kind == "dgc" else 0.9
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                   named_parameters=model.named_parameters(), compression=KINDS[kind](),
                                   communicator=comm)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    scales, skipped = [], []
    for s, (x, y) in enumerate(batches(comm.rank)):
        if skip_bad and s == BAD:
            scaler.update(new_scale=SCALE / 2)
            continue
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    return [p.detach().clone() for p in model.parameters()], memory_tensors(opt), scales, skipped


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_plain_gradscaler_idiom_skips_the_inf_step_on_every_rank_and_nothing_else(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = run_ranks(2, lambda comm: train_plain(comm, kind, False))
        b = run_ranks(2, lambda comm: train_plain(comm, kind, True))
        h = run_ranks(2, lambda comm: train(comm, kind, False))  # Horovod's idiom on the same batches
    for r in range(2):
        params_a, mem_a, scales, skipped = a[r]
        assert skipped == [s == BAD for s in range(STEPS)], (kind, r, skipped)  # rank 1's batch is finite
        assert scales[BAD] == SCALE / 2 and scales[-1] == SCALE / 2
        for pa, pb, ph in zip(params_a, b[r][0], h[r][0]):
            assert torch.equal(pa, pb), f"{kind} rank {r}"
            assert torch.equal(pa, ph), f"{kind} rank {r}: the plain idiom differs from Horovod's"
        for k in mem_a:
            assert torch.isfinite(mem_a[k]).all() and torch.equal(mem_a[k], b[r][1][k]), (kind, r, k)
    for pa, pb in zip(a[0][0], a[1][0]):
        assert torch.equal(pa, pb)
