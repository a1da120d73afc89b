"""The sparse SGD update after a sparse exchange (docs/wrapper.md#sparse-update): bit for bit the
wrapped optimizer's dense step, used only where that holds, in-process ranks."""
from __future__ import annotations

import copy
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hvd_commopt.select._hostkernels", reason="the native extension was not built (no C compiler)")

import torch_plugin as hco  # noqa: E402
from torch_plugin import sparse_update  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.select import _hostkernels as native  # noqa: E402

torch.manual_seed(0)
INIT = copy.deepcopy(torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(),
                                         torch.nn.Linear(40, 3)).state_dict())


class Counter:
    """Counts the native sparse updates (threads of in-process ranks share it)."""

    def __init__(self, monkeypatch):
        self.n = 0
        self._lock = threading.Lock()
        real = sparse_update.sparse_axpy

        def counting(*a, **k):
            with self._lock:
                self.n += 1
            return real(*a, **k)
        monkeypatch.setattr(sparse_update, "sparse_axpy", counting)


def train(P, compression, make_opt=None, steps=6, closure=False, hook=False):
    def body(comm):
        torch.set_num_threads(1)
        m = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3))
        m.load_state_dict(INIT)
        base = (make_opt or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)))(m.parameters())
        opt = hco.DistributedOptimizer(base, named_parameters=m.named_parameters(), compression=compression(),
                                       communicator=comm)
        if hook:
            opt.register_step_pre_hook(lambda *a: None)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)

            def loss_fn():
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
                return loss
            if closure:
                opt.step(loss_fn)
            else:
                loss_fn()
                opt.step()
        return {k: v.detach().clone() for k, v in m.state_dict().items()}
    return run_ranks(P, body)


def both(monkeypatch, P, compression, **kw):
    """(weights with the sparse update, weights with the dense step, sparse updates made)."""
    count = Counter(monkeypatch)
    on = train(P, compression, **kw)
    made = count.n
    monkeypatch.setattr(sparse_update, "ENABLED", False)
    off = train(P, compression, **kw)
    monkeypatch.setattr(sparse_update, "ENABLED", True)
    assert count.n == made, "the dense run made a sparse update"
    return on, off, made


def assert_bits(a, b):
    for ra, rb in zip(a, b):
        for k in ra:
            assert torch.equal(ra[k].view(torch.int32), rb[k].view(torch.int32)), k
    assert not torch.equal(a[0]["0.weight"], INIT["0.weight"])  # the weights did move


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("name,compression", [
    ("topk", lambda: Compression.topk(0.05)),                     # momentum correction: SGD without momentum
    ("topk_thr", lambda: Compression.topk(0.05, selection="threshold")),
    ("dgc", lambda: Compression.dgc(0.05)),
    ("gtopk", lambda: Compression.gtopk(0.05)),
    ("oktopk", lambda: Compression.oktopk(0.05)),
])
def test_sparse_update_is_the_dense_step_bit_for_bit(monkeypatch, P, name, compression):
    on, off, made = both(monkeypatch, P, compression)
    assert made > 0
    assert_bits(on, off)


def _sgd_subclass(ps):
    class MySGD(torch.optim.SGD):
        pass
    return MySGD(ps, lr=0.1)


@pytest.mark.parametrize("case,kw", [
    ("weight decay", {"make_opt": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3)}),
    ("momentum kept by the optimizer", {"make_opt": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}),
    ("maximize", {"make_opt": lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True)}),
    ("a subclass of SGD", {"make_opt": _sgd_subclass}),
    ("Adam", {"make_opt": lambda ps: torch.optim.Adam(ps, lr=0.01)}),
    ("a tensor learning rate", {"make_opt": lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1))}),
    ("a step closure", {"closure": True}),
    ("a step hook", {"hook": True}),
])
def test_anything_else_takes_the_wrapped_step(monkeypatch, case, kw):
    comp = (lambda: Compression.topk(0.05, momentum_correction=False)) if "momentum kept" in case \
        else (lambda: Compression.topk(0.05))
    on, off, made = both(monkeypatch, 2, comp, **kw)
    assert made == 0, case
    assert_bits(on, off)


def test_groups_with_different_learning_rates_take_the_wrapped_step(monkeypatch):
    def make(ps):
        ps = list(ps)
        return torch.optim.SGD([{"params": ps[:2], "lr": 0.1}, {"params": ps[2:], "lr": 0.05}], lr=0.1)
    on, off, made = both(monkeypatch, 2, lambda: Compression.topk(0.05), make_opt=make)
    assert made == 0
    assert_bits(on, off)


def test_a_parameter_the_optimizer_does_not_step_is_left_alone(monkeypatch):
    """The optimizer steps only its own parameters (here the first layer is left out of it): the
    sparse update moves the others, never the left-out layer."""
    on, off, made = both(monkeypatch, 2, lambda: Compression.topk(0.05),
                         make_opt=lambda ps: torch.optim.SGD(list(ps)[2:], lr=0.1))
    assert made > 0
    for ra, rb in zip(on, off):
        for k in ra:
            assert torch.equal(ra[k], rb[k]), k
        assert torch.equal(ra["0.weight"], INIT["0.weight"])


def test_dense_compression_takes_the_wrapped_step(monkeypatch):
    on, off, made = both(monkeypatch, 2, lambda: Compression.fp16,
                         make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert made == 0
    assert_bits(on, off)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_kernel_is_atens_add_with_alpha(dtype):
    """Members of awkward sizes, positions in any order, repeated ones: each position gets
    ATen's p.add_(g, alpha) value once."""
    gen = torch.Generator().manual_seed(5)
    sizes = (1, 7, 4096, 33, 1000)
    ps = [torch.randn(n, generator=gen, dtype=dtype) * 2 for n in sizes]
    starts = np.cumsum((0,) + sizes).astype(np.int64)
    n = int(starts[-1])
    g = torch.zeros(n, dtype=dtype)
    pos = torch.randperm(n, generator=gen)[:600]
    g[pos] = torch.randn(600, generator=gen, dtype=dtype)
    idx = torch.cat([pos, pos[:50], torch.tensor([0, n - 1])])  # repeats, and both ends
    want = [p.clone().add_(g[int(starts[i]):int(starts[i + 1])], alpha=-0.037) for i, p in enumerate(ps)]
    got = [p.clone() for p in ps]
    tmp = np.empty(idx.numel(), dtype=got[0].numpy().dtype)
    native.sparse_axpy(idx.numpy(), g[idx].numpy(), -0.037, starts, [p.numpy() for p in got], tmp)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    for w, h in zip(want, got):
        assert torch.equal(w.view(bits), h.view(bits))
    with pytest.raises(IndexError, match="outside the bucket"):
        native.sparse_axpy(np.array([n], np.int64), np.zeros(1, tmp.dtype), 1.0, starts, [p.numpy() for p in got], tmp)
    with pytest.raises(ValueError, match="one param buffer per member"):
        native.sparse_axpy(idx.numpy(), g[idx].numpy(), 1.0, starts, [p.numpy() for p in got[:-1]], tmp)


def test_native_kernels_off_take_the_wrapped_step_and_on_again_the_sparse_one(monkeypatch):
    """``host_native.USE_NATIVE = False`` (the benchmarks' NumPy A/Bs) turns the sparse update off
    for as long as it lasts, without ruling it out for later steps."""
    from hvd_commopt.select import host_native
    count = Counter(monkeypatch)
    prev, host_native.USE_NATIVE = host_native.USE_NATIVE, False
    try:
        off = train(2, lambda: Compression.topk(0.05))
    finally:
        host_native.USE_NATIVE = prev
    assert count.n == 0
    monkeypatch.setattr(sparse_update, "ENABLED", False)
    ref = train(2, lambda: Compression.topk(0.05))
    assert_bits(off, ref)
    monkeypatch.setattr(sparse_update, "ENABLED", True)
    host = sparse_update.SparseSGD(torch.optim.SGD([torch.zeros(2)], lr=0.1), {})
    host_native.USE_NATIVE = False
    try:
        assert not host._verified_for(torch.float32)
    finally:
        host_native.USE_NATIVE = prev
    assert host._verified_for(torch.float32)
