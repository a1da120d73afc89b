"""One host read per STEP on the device route (docs/selection.md#one-read-per-step), proven on CPU.

A step of four buckets (three matrices each in a sparse bucket, the two 1-D tensors in a
``dense_1d`` bucket sent whole) with the device route forced on CPU tensors (as in test_device_route.py): every aten op of
backward and ``step()`` is recorded, none of the forbidden ops may appear, and at most ONE
``_local_scalar_dense`` per step: the engine reads every bucket's NaN/Inf flags together, the one
decision ``torch.amp.GradScaler`` also makes. The reduced gradients, weights and residuals equal
the host route's bit for bit, on data with ties, -0.0, NaN and Inf (the NaN step is skipped on
every bucket and every rank alike).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hvd  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from tests.torch.test_device_route import (  # noqa: E402
    Direct, _same, host_then_device, record_host_copies, recorded_steps)

# three sparse buckets and one dense_1d bucket (the two 1-D tensors, sent whole)
SHAPES = [(256, 256), (48, 40), (300,), (64, 64), (7,)]
FUSION = 24 << 10


def _data(step: int, rng, last: int, rank: int = 0) -> list:
    xs = []
    for s in SHAPES:
        n = int(np.prod(s))
        if step % 2 == 0:
            x = rng.standard_normal(n).astype(np.float32)
        else:  # few distinct magnitudes: ties at the k-th value
            x = rng.integers(-4, 5, n).astype(np.float32) * 0.25
        x[rng.integers(0, n, max(1, n // 50))] = -0.0
        xs.append(x)
    if step == last - 2 and rank == 0:  # NaN in a 1-D (dense) bucket only, on one rank
        xs[2][5] = np.nan
    if step == last:  # NaN and Inf in one sparse bucket: the whole step is skipped
        x = xs[3]
        x[7], x[len(x) // 2], x[len(x) - 3] = np.nan, np.inf, -np.inf
    return [torch.from_numpy(x.reshape(s)) for x, s in zip(xs, SHAPES)]


def _train(comp, momentum: float, steps: int, comm=None):
    rng = np.random.default_rng(11 + (comm.rank if comm is not None else 0))
    torch.manual_seed(0)
    model = Direct(SHAPES)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                   model.named_parameters(), compression=comp, fusion_threshold=FUSION,
                                   communicator=comm)
    rank = comm.rank if comm is not None else 0
    return recorded_steps(model, opt, comp, [_data(step, rng, steps - 1, rank) for step in range(steps)])


COMPRESSIONS = {
    "topk": (lambda: Compression.topk(0.01), 0.0),
    "topk_momentum_correction": (lambda: Compression.topk(0.01, momentum_correction=True), 0.9),
    "topk_threshold_reuse": (lambda: Compression.topk(0.01, selection="threshold", tau=3), 0.0),
    "dgc_sampled": (lambda: Compression.dgc(0.01), 0.9),
    "randomk": (lambda: Compression.randomk(0.3), 0.0),
}


@pytest.fixture
def host_copies(monkeypatch):
    return record_host_copies(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()


def _check(recs, calls, uploads: int) -> None:
    for step, rec in enumerate(recs):
        assert not rec.bad, (step, rec.bad, rec.where)
        assert rec.scalar_reads <= 1, (step, rec.scalar_reads, rec.where)
    assert [c for c in calls if c != "from_numpy"] == [], calls
    assert calls.count("from_numpy") <= uploads * len(recs), calls


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_a_step_of_several_buckets_reads_the_host_once(name, monkeypatch, host_copies):
    make, momentum = COMPRESSIONS[name]
    (host, _), (dev, recs) = host_then_device(monkeypatch, host_copies, lambda: _train(make(), momentum, 7),
                                              warns=True)
    # random-k draws its indices on the host: one upload per sparse bucket and step
    _check(recs, host_copies, uploads=3 if name == "randomk" else 0)
    assert all(rec.scalar_reads == 1 for rec in recs)  # the one read is made (the verdict is read)
    _same(host, dev)


def test_two_ranks_decide_the_skip_alike(monkeypatch, host_copies):
    """Two in-process ranks, NaN on one rank only: both skip the same steps (the result's flag is
    the same on every rank) and equal the host route."""
    make, momentum = COMPRESSIONS["topk"]

    def body(comm):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return _train(make(), momentum, 5, comm=comm)

    host, dev = host_then_device(monkeypatch, host_copies, lambda: run_ranks(2, body))
    for r in range(2):
        _check(dev[r][1], host_copies, 0)
        _same(host[r][0], dev[r][0])
    for (g0, w0, _), (g1, w1, _) in zip(dev[0][0], dev[1][0]):
        assert all(torch.equal(a, b) for a, b in zip(g0 + w0, g1 + w1))
