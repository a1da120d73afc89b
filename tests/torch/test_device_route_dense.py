"""A dense allreduce with a memory on the device route (docs/selection.md#device-route), proven on CPU.

CD-SGD's rounds are ``DenseAllreduce(TernaryCompressor, ErrorFeedback())`` (ternary signs with
error feedback) and, with ``flush_residual_on_correction``, ``DenseAllreduce(NoneCompressor(),
memory)`` (the bucket plus the residual, sent whole). Their NaN/Inf check of this rank's
contribution is a device flag on the device route: the steps of a CD-SGD training, the route
forced on CPU tensors as in test_device_route.py, make no forbidden op and at most one
``_local_scalar_dense`` per step (the engine's one read of every bucket's flags), and the reduced
gradients, weights and residuals equal the host route's bit for bit, with a NaN/Inf on one rank
only and on every rank, on one rank and on two in-process ranks that decide alike.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hvd  # noqa: E402
import torch_plugin.ops as torch_ops  # noqa: E402
from hvd_commopt import Schedule, run_ranks, runtime  # noqa: E402
from hvd_commopt.buckets import Bucket, TensorSpec  # noqa: E402
from hvd_commopt.compress.cast import NoneCompressor  # noqa: E402
from hvd_commopt.compress.ternary import TernaryCompressor  # noqa: E402
from hvd_commopt.memory.error_feedback import ErrorFeedback  # noqa: E402
from hvd_commopt.reduce.base import ReduceContext, RoundInfo  # noqa: E402
from hvd_commopt.reduce.dense import DenseAllreduce  # noqa: E402
from tests.torch.test_device_route import (  # noqa: E402
    Direct, Recorder, _bits, _route, host_then_device, record_host_copies, recorded_steps)

SHAPES = [(128, 128), (300,), (96, 96)]
FUSION = 24 << 10  # several buckets per step: the one read covers them all


@pytest.fixture
def host_copies(monkeypatch):
    return record_host_copies(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()


def _data(step: int, rng, rank: int, nan_steps: dict) -> list:
    xs = []
    for s in SHAPES:
        n = int(np.prod(s))
        x = (rng.standard_normal(n) * 0.7).astype(np.float32)
        x[rng.integers(0, n, max(1, n // 50))] = -0.0
        xs.append(x)
    for where, ranks in nan_steps.get(step, ()):
        if rank in ranks:
            x = xs[where]
            x[3], x[len(x) // 2], x[-2] = np.nan, np.inf, -np.inf
    return [torch.from_numpy(x.reshape(s)) for x, s in zip(xs, SHAPES)]


def _train(schedule, steps: int, nan_steps: dict, comm=None):
    """CD-SGD steps of the Direct model; per step the gradients, the local weights and the replica
    (the global weights), the ternary residuals (bit patterns), and the step's recorder."""
    rank = comm.rank if comm is not None else 0
    rng = np.random.default_rng(21 + rank)
    torch.manual_seed(0)
    model = Direct(SHAPES)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   fusion_threshold=FUSION, communicator=comm, schedule=schedule)
    scheduler = opt.comm_engine.scheduler
    assert len(opt.comm_engine.engine._buckets) >= 2  # one read per step covers several buckets
    data = [_data(step, rng, rank, nan_steps) for step in range(steps)]

    def replica() -> list:  # the global weights, where the schedule keeps them
        return [] if scheduler.replica is None else [_bits(w) for _, w in sorted(scheduler.replica.items())]
    return recorded_steps(model, opt, None, data, memory=scheduler.ternary.memory, extra=replica)


NEG_ZERO = -2 ** 31  # the bits of -0.0 as int32


def _same(host, dev) -> None:
    """Gradients, weights and residuals bit for bit; a residual the host route does not hold (none
    yet, or flushed) is all -0.0 on the device route where it holds one (the additive identity)."""
    for step, (h, d) in enumerate(zip(host, dev)):
        for a, b in zip(h[0] + h[1], d[0] + d[1]):
            assert torch.equal(a, b), ("gradient or weight", step)
        assert set(h[2]) <= set(d[2]), step
        for key in d[2]:
            if key in h[2]:
                assert torch.equal(h[2][key], d[2][key]), ("residual", step, key)
            else:
                assert bool((d[2][key] == NEG_ZERO).all()), ("residual", step, key)


def _check(recs, calls) -> None:
    for step, rec in enumerate(recs):
        assert not rec.bad, (step, rec.bad, rec.where)
        assert rec.scalar_reads <= 1, (step, rec.scalar_reads, rec.where)
    assert sum(rec.scalar_reads for rec in recs) >= len(recs) // 2  # the ternary rounds' verdicts are read
    assert calls == [], calls


# step -> [(tensor, ranks whose gradient of it holds NaN/Inf)]; warm-up 1, correction every 3
NAN_STEPS = {3: [(0, (0,))], 4: [(2, (0, 1))], 6: [(1, (1,))]}
SCHEDULES = {
    "cd": lambda: Schedule.cd(warmup_steps=1, correction_every=3, threshold=0.5, local_lr=0.1),
    "cd_flush": lambda: Schedule.cd(warmup_steps=1, correction_every=3, threshold=0.5, local_lr=0.1,
                                    flush_residual_on_correction=True),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_cd_steps_make_no_host_sync_and_equal_the_host_route(name, monkeypatch, host_copies):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        (host, _), (dev, recs) = host_then_device(
            monkeypatch, host_copies, lambda: _train(SCHEDULES[name](), 9, NAN_STEPS))
    _check(recs, host_copies)
    _same(host, dev)
    assert any(h[2] for h in host)  # residuals were kept


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_two_ranks_decide_alike(name, monkeypatch, host_copies):
    """NaN/Inf on one rank only (steps 3 and 6) and on both (step 4): both ranks equal the host
    route and hold the same global weights (the local ones differ by design)."""
    def body(comm):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return _train(SCHEDULES[name](), 9, NAN_STEPS, comm=comm)

    host, dev = host_then_device(monkeypatch, host_copies, lambda: run_ranks(2, body))
    for r in range(2):
        _check(dev[r][1], host_copies)
        _same(host[r][0], dev[r][0])
    n = len(SHAPES)
    for (_, w0, _), (_, w1, _) in zip(dev[0][0], dev[1][0]):
        assert all(torch.equal(a, b) for a, b in zip(w0[n:], w1[n:]))
    assert len(dev[0][0][-1][1]) == 2 * n  # the replica was compared


# -- the reducer alone --------------------------------------------------------------------------
def _rounds(reducer, data, monkeypatch, device: bool):
    """``reducer.reduce`` of each flat in ``data`` on one rank (its own settle read), recorded:
    per round the result's bits, the residual's bits and whether it was kept."""
    with monkeypatch.context() as m:
        if device:
            _route(m, True)
        ops = torch_ops.TorchOps()
        ctx = ReduceContext(runtime.communicator(), ops)
        bucket = Bucket.of(0, [TensorSpec("w", (data[0].numel(),), "float32")], name="b0")
        out = []
        for step, x in enumerate(data):
            rec = Recorder()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                with rec:
                    pending = reducer.start(bucket, RoundInfo(step), x.clone(), ctx)
                    res = reducer.finish(pending, ctx)
                    kept = reducer.settle(bucket, RoundInfo(step), res, ctx, pending)
            assert not rec.bad and rec.scalar_reads <= (1 if device else 99), (rec.bad, rec.where)
            r = reducer.memory.residual(ops, "b0", x)
            out.append((_bits(res) if res.is_floating_point() else res.clone(), None if r is None else _bits(r),
                        kept))
        return out


@pytest.mark.parametrize("make", [lambda: DenseAllreduce(TernaryCompressor(0.5, 1), ErrorFeedback()),
                                  lambda: DenseAllreduce(NoneCompressor(), ErrorFeedback())],
                         ids=["ternary", "flush"])
def test_reducer_alone_equals_the_host_route(make, monkeypatch):
    rng = np.random.default_rng(4)
    data = []
    for step in range(6):
        x = torch.from_numpy((rng.standard_normal(500) * 0.6).astype(np.float32))
        if step in (2, 4):
            x[[5, 77]] = torch.tensor([float("nan"), float("inf")])
        data.append(x)
    host = _rounds(make(), data, monkeypatch, device=False)
    dev = _rounds(make(), data, monkeypatch, device=True)
    for step, (h, d) in enumerate(zip(host, dev)):
        assert torch.equal(h[0], d[0]), step
        assert (h[1] is None) == (d[1] is None) and (h[1] is None or torch.equal(h[1], d[1])), step
        assert h[2] == d[2], step
