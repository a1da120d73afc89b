"""Schedules through torch_plugin.DistributedOptimizer, on in-process ranks (threads) and at size 1."""
import copy
import io
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Schedule, run_ranks  # noqa: E402
from hvd_commopt.errors import ConfigError, HvdCommoptError  # noqa: E402
from hvd_commopt import NumpyOps  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402

_LOCK = threading.Lock()
_INIT: dict = {}


def make_model(seed=0):
    with _LOCK:
        if seed not in _INIT:
            torch.manual_seed(seed)
            m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
            _INIT[seed] = copy.deepcopy(m.state_dict())
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        m.load_state_dict(_INIT[seed])
        return m


def data(rank, step, n=4):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def backward(model, rank, step):
    x, y = data(rank, step)
    torch.nn.functional.cross_entropy(model(x), y).backward()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def run(P, schedule, steps, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1), identical=False, finalize=True,
        **kw):
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                       communicator=comm, schedule=schedule, **kw)
        for t in range(steps):
            opt.zero_grad()
            backward(model, 0 if identical else comm.rank, t)
            opt.step()
        local = params(model)
        if finalize:
            opt.finalize()
        return local, params(model)
    return run_ranks(P, body)


def reference(steps, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1), P=1):
    """Single process on the concatenated batch of P ranks (P = 1: the plain optimizer)."""
    model = make_model()
    opt = make_opt(model.parameters())
    for t in range(steps):
        opt.zero_grad()
        xs, ys = zip(*[data(r, t) for r in range(P)])
        torch.nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return params(model)


SGD_WD = lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=1e-3)  # noqa: E731


@pytest.mark.parametrize("schedule", [
    Schedule.od(warmup_steps=3, local_lr=None, local_momentum=0.0, local_scale=1.0),
    Schedule.ssd(delay=3, warmup_steps=2, local_lr=None, local_scale=1.0, glu=0),
    Schedule.cd(warmup_steps=2, correction_every=1, local_lr=None, local_momentum=0.0, local_scale=1.0),
])
def test_T_OD_1_single_rank_equals_torch_sgd_bit_for_bit(schedule):
    ref = reference(10, SGD_WD)
    (local, final), = run(1, schedule, 10, SGD_WD)
    assert same(local, ref) and same(final, ref)


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
                                      lambda ps: torch.optim.Adam(ps, lr=0.01)], ids=["sgd", "adam"])
def test_T_OD_3_delay_disabled_equals_sync_bit_for_bit(make_opt):
    sync = run(2, None, 7, make_opt, finalize=False)
    dz = run(2, Schedule.ssd(delay=0, warmup_steps=2, glu=0), 7, make_opt)
    for (a, _), (b, c) in zip(sync, dz):
        assert same(a, b) and same(a, c)


def test_T_OD_2_identical_data_two_ranks_is_single_worker_sgd():
    ref = reference(9, SGD_WD)
    for local, final in run(2, Schedule.od(warmup_steps=2, local_lr=None, local_momentum=0.0, local_scale=1.0),
                            9, SGD_WD, identical=True):
        assert same(local, ref) and same(final, ref)


@pytest.mark.parametrize("schedule", [Schedule.cocod(3), Schedule.local_sgd(2)])
def test_T_CoCoD_1_identical_data_is_single_worker_sgd(schedule):
    mk = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    ref = reference(10, mk)
    for local, final in run(2, schedule, 10, mk, identical=True):
        assert same(local, ref) and same(final, ref)


def test_global_update_is_the_wrapped_adam_replayed_on_the_averaged_gradients():
    """T-OD-5 with Adam: the replica is exactly the user's optimizer on gbar(t), t = 0..T-1,
    and the warm-up's Adam state (step count, moments) carries over the switch."""
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), communicator=comm,
                                       schedule=Schedule.ssd(delay=2, warmup_steps=2))
        grads = []
        for t in range(7):
            opt.zero_grad()
            backward(model, comm.rank, t)
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            if t >= 2:  # after warm-up, p.grad keeps the local gradient (warm-up: the average, as sync)
                assert same([p.grad for p in model.parameters()], grads[-1])
        opt.finalize()
        first = next(iter(opt.state.values()))
        return grads, params(model), int(first["step"])
    out = run_ranks(2, body)
    ref = make_model()
    ropt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for t in range(7):
        for i, p in enumerate(ref.parameters()):
            p.grad = (out[0][0][t][i] + out[1][0][t][i]) * 0.5
        ropt.step()
    for _, final, steps in out:
        assert steps == 7
        assert same(final, params(ref))


def test_lr_scheduler_drives_the_global_update_round_by_round():
    def body(comm):
        model = make_model()
        base = torch.optim.SGD(model.parameters(), lr=0.2)
        sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
        opt = hco.DistributedOptimizer(base, named_parameters=model.named_parameters(), communicator=comm,
                                       schedule=Schedule.ssd(delay=3, warmup_steps=0, glu=0))
        grads = []
        for t in range(6):
            opt.zero_grad()
            backward(model, comm.rank, t)
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            sched.step()
        opt.finalize()
        return grads, params(model)
    out = run_ranks(2, body)
    ref = make_model()
    for t in range(6):
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p.add_((out[0][0][t][i] + out[1][0][t][i]) * 0.5, alpha=-0.2 * 0.5 ** t)
    for _, final in out:
        assert same(final, params(ref))


def test_use_global_weights_swaps_in_the_replica_and_back():
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                       communicator=comm, schedule=Schedule.od(warmup_steps=1))
        for t in range(4):
            opt.zero_grad()
            backward(model, comm.rank, t)
            opt.step()
        local = params(model)
        with opt.use_global_weights():
            glob = params(model)
            assert not same(glob, local)
        assert same(params(model), local)
        opt.finalize()
        assert same(params(model), glob)
        return glob
    a, b = run_ranks(2, body)
    assert same(a, b)


def test_contract_errors_under_delayed_schedules():
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                       communicator=comm, schedule=Schedule.od(warmup_steps=0))
        backward(model, comm.rank, 0)
        with pytest.raises(HvdCommoptError, match="before optimizer.step"):
            opt.zero_grad()  # the guard still protects the round being filled
        with pytest.raises(HvdCommoptError, match="synchronous schedule"):
            opt.synchronize()
        with pytest.raises(HvdCommoptError, match="after optimizer.step"):
            opt.state_dict()
        with pytest.raises(ConfigError, match="closure"):
            opt.step(lambda: 0.0)
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        with pytest.raises(ConfigError, match="sparse|quantizes"):
            hco.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), communicator=comm,
                                     schedule=Schedule.cd(), compression=hco.Compression.fp16)
    run_ranks(1, body)


def test_unused_parameter_and_accumulation_under_od():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.main = torch.nn.Linear(4, 2)
            self.extra = torch.nn.Linear(4, 2)
            with torch.no_grad():
                for i, p in enumerate(self.parameters()):
                    p.copy_(torch.linspace(-1, 1, p.numel()).view_as(p) * (i + 1))

        def forward(self, x, use_extra):
            return self.main(x) + (self.extra(x) if use_extra else 0)

    def body(comm):
        m = Branchy()
        opt = hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                       communicator=comm, backward_passes_per_step=2,
                                       schedule=Schedule.od(warmup_steps=1, check_replica_every=1))
        for t in range(4):
            opt.zero_grad()
            for n in range(2):
                m(torch.ones(2, 4) * (n + 1), use_extra=(comm.rank == 0)).sum().backward()
            opt.step()
        opt.finalize()
        return params(m)
    a, b = run_ranks(2, body)
    assert same(a, b)


@pytest.mark.parametrize("kind", ["od", "ssd", "cd", "cocod", "local_sgd"])
def test_resume_through_torch_state_dicts_is_bit_exact(kind):
    schedule = {"od": Schedule.od(warmup_steps=2), "ssd": Schedule.ssd(delay=3, warmup_steps=1),
                "cd": Schedule.cd(warmup_steps=2, correction_every=3, threshold=0.5, batch_size=4),
                "cocod": Schedule.cocod(3), "local_sgd": Schedule.local_sgd(2)}[kind]
    mk = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4)  # noqa: E731
    N, M = 6, 5

    def train(model, opt, steps, rank):
        for t in steps:
            opt.zero_grad()
            backward(model, rank, t)
            opt.step()

    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(mk(model.parameters()), named_parameters=model.named_parameters(),
                                       communicator=comm, schedule=schedule)
        train(model, opt, range(N), comm.rank)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        train(model, opt, range(N, N + M), comm.rank)
        a = params(model)
        # a fresh model and optimizer resume from the checkpoint
        model2 = make_model(seed=1)
        opt2 = hco.DistributedOptimizer(mk(model2.parameters()), named_parameters=model2.named_parameters(),
                                        communicator=comm, schedule=schedule)
        buf.seek(0)
        ck = torch.load(buf, weights_only=False)
        model2.load_state_dict(ck["model"])
        opt2.load_state_dict(ck["opt"])
        assert opt2.comm_engine.step == N
        train(model2, opt2, range(N, N + M), comm.rank)
        return a, params(model2)
    for a, b in run_ranks(2, body):
        assert same(a, b)


@pytest.mark.parametrize("factory", [lambda: hco.Compression.topk(0.3), lambda: hco.Compression.dgc(0.3)],
                         ids=["topk", "dgc"])
def test_sparse_delay_zero_with_torch_momentum_equals_sync_bit_for_bit(factory):
    """torch.optim.SGD(momentum=0.9) + momentum correction: the replica's deferred update runs
    without the optimizer's momentum exactly as the synchronous step (applied twice, OD diverged)."""
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    sync = run(2, None, 7, sgd, finalize=False, compression=factory())
    dz = run(2, Schedule.ssd(delay=0, warmup_steps=2, glu=0), 7, sgd, compression=factory())
    for (a, _), (b, c) in zip(sync, dz):
        assert same(a, b) and same(a, c)


def test_fp16_compression_with_od():
    out = run(2, Schedule.od(warmup_steps=1), 5, compression=hco.Compression.fp16)
    assert same(out[0][1], out[1][1])


def test_torch_ops_update_primitives_match_numpy():
    t, n = TorchOps(), NumpyOps()
    r = np.array([0.6, -0.5, 0.49, -0.51, 0.0, 1.2], np.float32)
    ts = t.ternary(torch.from_numpy(r.copy()), 0.5, "int8")
    ns = n.ternary(r.copy(), 0.5, "int8")
    assert ts.dtype == torch.int8 and ts.tolist() == ns.tolist()
    a = torch.tensor([1.0, 2.0])
    assert t.axpy_(a, 0.5, torch.tensor([2.0, 2.0])) is a and a.tolist() == [2.0, 3.0]
