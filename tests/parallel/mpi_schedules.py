"""Rank-side checks of the schedules; run by test_parallel_schedules.py under
``mpirun -np P python -m pytest``. Every rank asserts; skipped at size 1."""
import copy
import dataclasses
import io

import numpy as np
import pytest
import torch

import torch_plugin as hco
from hvd_commopt import NumpyOps, Schedule
from hvd_commopt.compress import TernaryCompressor
from hvd_commopt.memory import ErrorFeedback
from hvd_commopt.reduce import DenseAllreduce
from hvd_commopt.reduce.base import ReduceContext
from tests.reducers import start
from tests.parallel.ranks import require_mpirun

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
require_mpirun("tests/parallel/test_parallel_schedules.py")
POW2 = P & (P - 1) == 0


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def same_on_all_ranks(tensors):
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).reshape(1, -1)
    everyone = hco.allgather(flat)
    return all(torch.equal(everyone[0], everyone[r]) for r in range(P))


def train(schedule, steps, make_opt, rank_data=True, finalize=True, each_step=None, model=None, start=0,
          opt=None, **kw):
    model = model or make_model()
    opt = opt or hco.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                          schedule=schedule, **kw)
    for t in range(start, start + steps):
        x, y = batch(R if rank_data else 0, t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if each_step:
            each_step(t, model, opt)
    if finalize:
        opt.finalize()
    return model, opt


SGD = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4)  # noqa: E731
PLAIN = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731


@pytest.mark.parametrize("make_opt", [SGD, ADAM], ids=["sgd", "adam"])
def test_T_OD_3_delay_disabled_equals_ssgd_bit_for_bit(make_opt):
    ref, _ = train(None, 8, make_opt, finalize=False)
    got, _ = train(Schedule.ssd(delay=0, warmup_steps=2, glu=0), 8, make_opt)
    assert same(params(ref), params(got))


@pytest.mark.parametrize("schedule", [
    Schedule.od(warmup_steps=2, local_lr=None, local_momentum=0.0, local_scale=1.0),
    Schedule.ssd(delay=3, warmup_steps=2, local_lr=None, local_scale=1.0, glu=0),
    Schedule.cocod(3, warmup_steps=1),
    Schedule.local_sgd(2),
], ids=["od", "ssd", "cocod", "local_sgd"])
def test_identical_data_reproduces_single_worker_sgd(schedule):
    """T-OD-2 / T-CoCoD-1: every rank gets the same batch."""
    mk = PLAIN if schedule.kind in ("od", "ssd") else SGD
    ref = make_model()
    ropt = mk(ref.parameters())
    for t in range(9):
        x, y = batch(0, t)
        ropt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ropt.step()
    got, _ = train(schedule, 9, mk, rank_data=False)
    assert same_on_all_ranks(params(got))
    if P == 2:  # (g + g) / 2 == g and x/2 + x/2 == x exactly
        assert same(params(got), params(ref))
    else:       # "up to allreduce rounding" (docs/od-sgd.md#t-od-2, docs/cocod-sgd.md#t-cocod-1)
        for a, b in zip(params(got), params(ref)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", [
    Schedule.od(warmup_steps=2), Schedule.ssd(delay=3, warmup_steps=2),
    Schedule.cd(warmup_steps=2, correction_every=3, batch_size=8),
    Schedule.ssd(delay=2, warmup_steps=1, glu=0, local_optimizer="dcasgd"),
], ids=["od", "ssd", "cd", "ssd_dcasgd"])
def test_T_OD_4_replica_bit_identical_across_ranks_after_every_step(schedule):
    def check(t, model, opt):
        d = opt.comm_engine.scheduler.replica_digest()
        assert len(set(opt.comm_engine.comm.allgather_object(d, name="test.digest"))) == 1, t
    schedule = dataclasses.replace(schedule, check_replica_every=1)  # the built-in check too
    model, _ = train(schedule, 10, SGD, each_step=check)
    assert same_on_all_ranks(params(model))  # after finalize: the replica


def test_T_SSD_1_ssd_k1_equals_od():
    common = dict(warmup_steps=2, local_lr=0.05, local_momentum=0.1)
    a, _ = train(Schedule.od(**common), 8, SGD, finalize=False)
    b, _ = train(Schedule.ssd(delay=1, glu=0, **common), 8, SGD, finalize=False)
    assert same(params(a), params(b))


def test_T_CD_1_correction_every_step_equals_od():
    common = dict(warmup_steps=2, local_lr=0.05, local_momentum=0.1)
    a, _ = train(Schedule.od(**common), 8, SGD)
    b, _ = train(Schedule.cd(correction_every=1, **common), 8, SGD)
    assert same(params(a), params(b))


def test_T_SSD_2_replica_independent_of_k_for_a_fixed_gradient_sequence():
    """Gradients that do not depend on the weights (loss linear in them): w_g is the same for every
    k and equals the synchronous result, bit-for-bit (the same collectives: docs/wrapper.md#bit-exactness-scope)."""
    def run(schedule):
        torch.manual_seed(3)
        w = torch.nn.Parameter(torch.randn(50))
        opt = hco.DistributedOptimizer(SGD([w]), named_parameters=[("w", w)], schedule=schedule)
        for t in range(12):
            c = torch.randn(50, generator=torch.Generator().manual_seed(7 * t + R))
            opt.zero_grad()
            (w * c).sum().backward()
            opt.step()
        if schedule is not None:
            opt.finalize()
        return w.detach().clone()
    ref = run(None)
    for k in (1, 3, 5):
        assert torch.equal(run(Schedule.ssd(delay=k, warmup_steps=2, glu=0.5)), ref), k


def test_T_CD_4_int8_allreduce_equals_fp32_dequantize_then_sum():
    comm = hco.runtime.communicator()
    # host arrays on MPI; torch tensors on the default backend (Gloo's native int8 sum)
    ops = NumpyOps() if comm.buffer_kind == "numpy" else hco.TorchOps()
    red = DenseAllreduce(TernaryCompressor(0.5, P), ErrorFeedback())
    ctx = ReduceContext(comm, ops, 1.0, 1.0 / P)
    g = np.random.RandomState(R).randn(1001).astype(np.float32)
    pend = start(red, "bucket0:t", g.copy() if comm.buffer_kind == "numpy" else torch.from_numpy(g.copy()),
                 ctx, step=3, tag="r3")
    assert str(pend.state.payload.dtype).endswith("int8")
    out = np.asarray(ops.to_numpy(red.finish(pend, ctx)))
    signs = comm.allgather_object((np.sign(g) * (np.abs(g) >= 0.5)).astype(np.float32), name="test.signs")
    ref = np.zeros(1001, np.float32)
    for s in signs:
        ref += s * np.float32(0.5)
    ref *= np.float32(1.0 / P)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("schedule", [
    Schedule.od(warmup_steps=2), Schedule.ssd(delay=3, warmup_steps=1),
    Schedule.cd(warmup_steps=2, correction_every=3, batch_size=8),
    Schedule.cocod(3), Schedule.local_sgd(2)], ids=["od", "ssd", "cd", "cocod", "local_sgd"])
def test_resume_after_n_steps_equals_not_stopping(schedule):
    N, M = 5, 6
    a, _ = train(schedule, N + M, SGD, finalize=False)
    model, opt = train(schedule, N, SGD, finalize=False)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    b, _ = train(schedule, M, SGD, finalize=False, model=model, opt=opt, start=N)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    model2 = make_model(seed=9)
    opt2 = hco.DistributedOptimizer(SGD(model2.parameters()), named_parameters=model2.named_parameters(),
                                    schedule=schedule)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(copy.deepcopy(ck["opt"]))
    c, _ = train(schedule, M, SGD, finalize=False, model=model2, opt=opt2, start=N)
    assert same(params(a), params(b)) and same(params(a), params(c))
