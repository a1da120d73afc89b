"""DGC on the device route (docs/selection.md#device-route), proven on CPU as test_device_route.py
does: local gradient clipping with the norm kept a device tensor (docs/dgc.md#clip-on-device), and
the empty selection (docs/selection.md#empty-selection). Every aten op of the steps is recorded:
no forbidden op, one scalar read per step (the NaN/Inf verdict), and the reduced gradients,
weights and velocities equal the host route's bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hvd  # noqa: E402
from torch_plugin import ops as torch_ops  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from tests.torch.test_device_route_step import _check as check_step_reads  # noqa: E402
from tests.torch.test_device_route import (  # noqa: E402
    Direct, _route, _same, _train, host_then_device, record_host_copies, recorded_steps)


@pytest.fixture
def host_copies(monkeypatch):
    return record_host_copies(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()


def _check(recs, calls) -> None:
    check_step_reads(recs, calls, uploads=0)


def _no_resample(**kw):
    comp = Compression.dgc(0.01, dense_1d=False, **kw)
    comp.compressor.resample = False
    return comp


CLIPPED = {
    # clip_norm below the gradients' norms (clipped) and above some (the factor 1 on the device)
    "dgc_clip": (lambda: Compression.dgc(0.01, clip_norm=20.0, dense_1d=False), 0.9),
    "dgc_clip_nesterov": (lambda: Compression.dgc(0.01, clip_norm=5.0, nesterov=True, momentum=0.9,
                                                  dense_1d=False), 0.0),
    "dgc_clip_exact": (lambda: Compression.dgc(0.01, clip_norm=20.0, selection="exact", dense_1d=False), 0.9),
    "dgc_clip_no_resample": (lambda: _no_resample(clip_norm=20.0), 0.9),
    # the 1-D bucket... every bucket sent whole: clipping on the reduced average (finish_dense)
    "dgc_clip_dense": (lambda: Compression.dgc(1.0, clip_norm=20.0), 0.9),
}


@pytest.mark.parametrize("name", sorted(CLIPPED))
def test_dgc_clipping_on_the_device_equals_the_host_route(name, monkeypatch, host_copies):
    make, momentum = CLIPPED[name]
    (host, _), (dev, recs) = host_then_device(monkeypatch, host_copies, lambda: _train(make(), momentum, 7),
                                              warns=True)
    _check(recs, host_copies)
    assert all(rec.scalar_reads == 1 for rec in recs)
    _same(host, dev)


def test_clipping_clips_and_leaves_alone():
    """The device primitive clips a large gradient to the norm and leaves a small one's bits."""
    ops = torch_ops.TorchOps()
    big = torch.full((100,), 3.0)
    assert abs(float(torch.linalg.vector_norm(ops.clip_to_norm_(big, 1.0, 1e-6))) - 1.0) < 1e-5
    small = torch.tensor([1e-3, -0.0, 2e-3])
    assert torch.equal(ops.clip_to_norm_(small.clone(), 1.0, 1e-6).view(torch.int32), small.view(torch.int32))


# -- the empty selection ------------------------------------------------------------------------
SHAPES = [(256, 256), (48, 40)]


def _tied(step: int, rng, rank: int) -> list:
    """Every |x| equal in the first bucket on even steps (DGC's adaptation without resample
    oscillates around it and ends above every value: nothing is selected), normal data else."""
    xs = []
    for s in SHAPES:
        n = int(np.prod(s))
        if step % 2 == 0:
            x = np.where(rng.random(n) < 0.5, -0.5, 0.5).astype(np.float32)
            x[rng.integers(0, n, 3)] = -0.5
        else:
            x = rng.standard_normal(n).astype(np.float32)
        xs.append(torch.from_numpy(x.reshape(s)))
    return xs


def _train_tied(steps: int, comm=None):
    rng = np.random.default_rng(3 + (comm.rank if comm is not None else 0))
    model = Direct(SHAPES)
    comp = _no_resample(momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression=comp, fusion_threshold=64 << 20, communicator=comm)
    rank = comm.rank if comm is not None else 0
    return recorded_steps(model, opt, comp, [_tied(step, rng, rank) for step in range(steps)])


def test_the_data_makes_an_empty_selection():
    """The premise: on the tied data the host route's DGC (resample=False) selects nothing."""
    from hvd_commopt.compress.dgc import DGCSelector
    from hvd_commopt.select.sampled import sampled_select
    ops = torch_ops.TorchOps()
    x = _tied(0, np.random.default_rng(0), 0)[0].reshape(-1)
    for step in range(4):
        _, idx, _ = sampled_select(DGCSelector(0.01, resample=False), ops, x.clone(), None, step)
        assert idx.numel() == 0


def test_empty_selection_on_the_device_equals_the_host_route(monkeypatch, host_copies):
    (host, _), (dev, recs) = host_then_device(monkeypatch, host_copies, lambda: _train_tied(6))
    assert any(torch.equal(h[0][0], torch.zeros_like(h[0][0])) for h in host)  # nothing sent on some step
    _check(recs, host_copies)
    _same(host, dev)


def test_empty_selection_two_ranks(monkeypatch, host_copies):
    """Two in-process ranks, one of them empty on a bucket while the other sends: both equal the
    host route and agree."""
    host, dev = host_then_device(monkeypatch, host_copies, lambda: run_ranks(2, lambda comm: _train_tied(4, comm)))
    for r in range(2):
        _check(dev[r][1], host_copies)
        _same(host[r][0], dev[r][0])
    for (g0, w0, _), (g1, w1, _) in zip(dev[0][0], dev[1][0]):
        assert all(torch.equal(a, b) for a, b in zip(g0 + w0, g1 + w1))


def test_marker_and_zeroing(monkeypatch):
    """padded's empty marker: indices 1, 0, 0, ..., values -0.0; zero_sent zeroes nothing for it
    and +0.0 at a real selection's positions (index_fill's bits)."""
    from hvd_commopt.memory.sent import zero_sent
    from hvd_commopt.select import device
    ops = torch_ops.TorchOps()
    t = torch.tensor([-0.0, 3.0, -2.0, 5.0, 1.0])
    _route(monkeypatch, device=True)
    vals, idx = device.padded(ops, t, torch.tensor([4, 1, 2]), torch.tensor([False, False, False]))
    assert idx.tolist() == [1, 0, 0] and torch.equal(vals.view(torch.int32), torch.full((3,), -0.0).view(torch.int32))
    assert torch.equal(zero_sent(ops, t.clone(), idx).view(torch.int32), t.view(torch.int32))
    vals, idx = device.padded(ops, t, torch.tensor([3, 1, 2]), torch.tensor([True, True, False]))
    assert idx.tolist() == [1, 3, 1] and vals.tolist() == [3.0, 5.0, 0.0]
    assert zero_sent(ops, t.clone(), idx).tolist() == [0.0, 0.0, -2.0, 0.0, 1.0]
