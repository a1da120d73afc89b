"""DistributedOptimizer's contract, on in-process ranks (threads) and at size 1."""
import copy
import threading
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import NumpyOps, run_ranks  # noqa: E402
from hvd_commopt.errors import ConfigError, HvdCommoptError, RankMismatchError  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402


_INIT_LOCK = threading.Lock()
_INIT: dict = {}


def make_model(seed=0, hidden=8):
    """Same initial weights in every thread-rank (torch's global RNG is shared by the threads)."""
    with _INIT_LOCK:
        if (seed, hidden) not in _INIT:
            torch.manual_seed(seed)
            m = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))
            _INIT[(seed, hidden)] = copy.deepcopy(m.state_dict())
        m = torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))
        m.load_state_dict(_INIT[(seed, hidden)])
        return m


def data(rank, n=4, seed=100):
    g = torch.Generator().manual_seed(seed + rank)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_size_one_equals_plain_optimizer_bit_for_bit():
    def body(comm):
        ref, model = make_model(), make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
                                       named_parameters=model.named_parameters(), communicator=comm)
        batches = [data(0, seed=s) for s in range(5)]
        train(ref, ref_opt, batches)
        train(model, opt, batches)
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    run_ranks(1, body)


@pytest.mark.parametrize("threshold", [0, None])
def test_two_ranks_equal_single_process_on_concatenated_batch(threshold):
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2),
                                       named_parameters=model.named_parameters(), communicator=comm,
                                       fusion_threshold=threshold)
        for step in range(4):
            opt.zero_grad()
            x, y = data(comm.rank, seed=10 * step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    out = run_ranks(2, body)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for step in range(4):
        xs, ys = zip(*[data(r, seed=10 * step) for r in range(2)])
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    for a, b, r in zip(out[0], out[1], ref.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r.detach(), rtol=1e-5, atol=1e-6)


def test_zero_grad_while_in_flight_is_refused():
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), communicator=comm)
        x, y = data(0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(HvdCommoptError, match="before optimizer.step"):
            opt.zero_grad()
        opt.step()
        opt.zero_grad()
    run_ranks(1, body)


def test_synchronize_then_clip_then_skip_synchronize():
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(), communicator=comm)
        x, y = data(comm.rank)
        before = [p.detach().clone() for p in model.parameters()]
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        grads = [p.grad.clone() for p in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        assert norm <= 0.01 + 1e-6
        for b, p, g in zip(before, model.parameters(), grads):
            assert torch.equal(p.detach(), b - g)
        # step() after synchronize() without skip_synchronize warns (Horovod's behaviour)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.step()
        assert any("skip_synchronize" in str(m.message) for m in w)
        return [p.detach().clone() for p in model.parameters()]
    a, b = run_ranks(2, body)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_unused_parameter_on_one_rank_gets_the_average():
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
        opt = hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.5),
                                       named_parameters=m.named_parameters(), communicator=comm)
        x = torch.ones(2, 4)
        m(x, use_extra=(comm.rank == 0)).sum().backward()
        opt.step()
        return m.extra.weight.grad.clone(), [p.detach().clone() for p in m.parameters()]
    (g0, p0), (g1, p1) = run_ranks(2, body)
    assert torch.equal(g0, g1)
    torch.testing.assert_close(g0, torch.full((2, 4), 1.0))  # rank 0's grad 2.0, rank 1's none -> 1.0
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)


def test_backward_passes_per_step_closed_form():
    def body(comm):
        w = torch.nn.Parameter(torch.zeros(3))
        opt = hco.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                       backward_passes_per_step=2, communicator=comm)
        for step in range(2):
            opt.zero_grad()
            for n in range(2):
                c = torch.tensor([1.0, 2.0, 3.0]) * (comm.rank + 1) * (n + 1) * (step + 1)
                (w * c).sum().backward()
            opt.step()
        return w.detach().clone()
    out = run_ranks(2, body)
    # w = -sum_step (1/P) sum_r sum_n c[r,n,step] = -(1/2)*(1+2)*(1+2)*(1+2)*[1,2,3]
    expect = -torch.tensor([1.0, 2.0, 3.0]) * 3 * 3 * 3 / 2
    assert torch.equal(out[0], expect) and torch.equal(out[1], expect)


def test_lr_scheduler_created_before_wrapping_still_reduces():
    def body(comm):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        opt = hco.DistributedOptimizer(opt, named_parameters=model.named_parameters(), communicator=comm)
        x, y = data(comm.rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        assert opt.comm_stats["bytes_sent"] > 0
        assert opt.param_groups[0]["lr"] == 0.05
        return [p.detach().clone() for p in model.parameters()]
    a, b = run_ranks(2, body)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_state_dict_round_trip_and_load_resets():
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), communicator=comm)
        train(model, opt, [data(comm.rank, seed=s) for s in range(2)])
        sd = copy.deepcopy(opt.state_dict())
        assert sd["hvd_commopt"]["step"] == 2
        x, y = data(comm.rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.load_state_dict(sd)  # mid-step: pending gradients are dropped, like Horovod
        opt.zero_grad()
        assert opt.comm_engine.step == 2
    run_ranks(2, body)


def test_model_that_differs_across_ranks_fails_at_wrap_time():
    def body(comm):
        model = make_model(hidden=8 if comm.rank == 0 else 9)
        with pytest.raises(RankMismatchError, match="'0.weight' shape \\(8, 6\\) float32 on rank 0 but '0.weight' shape \\(9, 6\\)"):
            hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), communicator=comm)
    run_ranks(2, body)


def test_bad_arguments_name_the_fix():
    def body(comm):
        model = make_model()
        with pytest.raises(ConfigError, match="missing from named_parameters"):
            hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=list(model.named_parameters())[:1], communicator=comm)
        with pytest.raises(ConfigError, match="unique"):
            p = next(model.parameters())
            hco.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("a", p), ("a", p)], communicator=comm)
        with pytest.raises(ConfigError, match="torch.optim.Optimizer"):
            hco.DistributedOptimizer(model, communicator=comm)
        with pytest.raises(ConfigError, match="backward_passes_per_step"):
            hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0, communicator=comm)
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=comm)
        with pytest.raises(ConfigError, match="wrap it once"):
            hco.DistributedOptimizer(opt, communicator=comm)
    run_ranks(1, body)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_half_precision_compression_keeps_grad_dtype(compression):
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                       compression=getattr(hco.Compression, compression), communicator=comm)
        x, y = data(comm.rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        return [p.grad.clone() for p in model.parameters()]
    a, b = run_ranks(2, body)
    for x, y in zip(a, b):
        assert x.dtype == torch.float32 and torch.equal(x, y)


def test_torch_ops_match_numpy_ops_including_ties():
    t, n = TorchOps(), NumpyOps()
    x = np.array([3.0, -5.0, 5.0, 1.0, -3.0, 5.0, 0.0, 3.0], dtype=np.float32)
    for k in range(1, 9):
        tv, ti = t.topk_abs(torch.from_numpy(x.copy()), k)
        nv, ni = n.topk_abs(x.copy(), k)
        assert ti.tolist() == ni.tolist(), k
        assert tv.tolist() == nv.tolist()
    bf = t.cast(torch.tensor([1.0, 3.14159, -2.5e-3]), "bfloat16")
    assert t.to_numpy(bf).tolist() == n.cast(np.array([1.0, 3.14159, -2.5e-3], np.float32), "bfloat16").tolist()
    back = t.from_numpy(t.to_numpy(bf), like=bf)
    assert back.dtype == torch.bfloat16 and torch.equal(back, bf)
