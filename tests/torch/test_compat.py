"""torch_plugin/_compat.py: each private torch API's route and its public fallback, the fallback
forced by monkeypatching the private handle to None (docs/versions.md#private-apis)."""
import copy
import importlib.util
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from torch_plugin import _compat, sparse_update  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402

_LOCK = threading.Lock()
_INIT: dict = {}


def make_model():
    with _LOCK:  # the same weights in every thread-rank
        if not _INIT:
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
            _INIT.update(copy.deepcopy(m.state_dict()))
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        m.load_state_dict(_INIT)
        return m


def train(P=2, steps=3, compression=None):
    def body(comm):
        m = make_model()
        opt = hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=m.named_parameters(), communicator=comm,
                                       **({} if compression is None else {"compression": compression()}))
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            opt.zero_grad()
            x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in m.parameters()]
    return run_ranks(P, body)


def assert_same(a, b):
    for ra, rb in zip(a, b):
        assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(ra, rb))


# -- torch._C._storage_Use_Count: may a buffer be reused? ---------------------------------------

def test_storage_exclusive_counts_the_views_on_a_storage():
    t = torch.zeros(8)
    assert _compat.storage_exclusive(t) and TorchOps().exclusive(t)
    view = t[2:]
    assert not _compat.storage_exclusive(t)
    del view
    assert _compat.storage_exclusive(t)


def test_without_the_use_count_no_buffer_is_reused_and_training_is_the_same(monkeypatch):
    ref = train()
    monkeypatch.setattr(_compat, "_STORAGE_USE_COUNT", None)
    assert not TorchOps().exclusive(torch.zeros(8))
    assert_same(train(), ref)


# -- Tensor._base: is a gradient a view of another tensor? ---------------------------------------

def cases():
    buf = torch.zeros(12)
    return {"a fresh tensor": (torch.ones(3), False), "a slice of a buffer": (buf[4:8], True),
            "a buffer's tail": (buf[8:], True), "a buffer's head": (buf[:4], True),
            "a reshaped buffer part": (buf[:6].view(2, 3), True)}


@pytest.mark.parametrize("case", list(cases()))
def test_is_view_private_route_and_fallback_agree(monkeypatch, case):
    t, view = cases()[case]
    assert _compat.is_view(t) == view
    monkeypatch.setattr(_compat, "_VIEW_BASE", None)
    assert _compat.is_view(t) == view


def test_without_tensor_base_training_is_the_same(monkeypatch):
    ref = train()
    monkeypatch.setattr(_compat, "_VIEW_BASE", None)
    assert_same(train(), ref)


# -- Optimizer step hooks: may the sparse update bypass optimizer.step? ---------------------------

def sparse_lr(comm, hook=False):
    m = make_model()
    opt = hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                   communicator=comm)
    if hook:
        opt.register_step_pre_hook(lambda *a: None)
    return sparse_update.SparseSGD(opt, {}).lr(None)


def test_step_hooks_private_route_and_fallback(monkeypatch):
    assert run_ranks(1, sparse_lr) == [0.1]
    assert run_ranks(1, lambda comm: sparse_lr(comm, hook=True)) == [None]
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    handle = register_optimizer_step_pre_hook(lambda *a: None)
    try:
        assert run_ranks(1, sparse_lr) == [None]
    finally:
        handle.remove()
    monkeypatch.setattr(_compat, "_STEP_HOOKS", None)
    # unknown: the wrapped step (which runs any hook) is taken, never the sparse one
    assert run_ranks(1, sparse_lr) == [None]


def test_without_the_hook_dicts_sparse_training_takes_the_dense_step_and_is_the_same(monkeypatch):
    topk = lambda: Compression.topk(0.2)  # noqa: E731
    monkeypatch.setenv("HVD_COMMOPT_SPARSE_UPDATE", "0")
    ref = train(compression=topk)
    monkeypatch.delenv("HVD_COMMOPT_SPARSE_UPDATE")
    monkeypatch.setattr(_compat, "_STEP_HOOKS", None)
    assert_same(train(compression=topk), ref)


# -- the LR scheduler's optimizer.step wrapper ----------------------------------------------------

def scheduled(comm):
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    theirs = opt.__dict__["step"]
    opt = hco.DistributedOptimizer(opt, named_parameters=m.named_parameters(), communicator=comm)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(comm.rank))
    m(x).sum().backward()
    opt.step()
    sched.step()
    assert opt.__dict__["step"] is not theirs  # re-pointed at ours
    return opt.comm_stats["bytes_sent"], opt.param_groups[0]["lr"]


def test_lr_scheduler_wrapper_is_repointed_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scheduler's step-order check still sees our step
        out = run_ranks(2, scheduled)
    assert all(sent > 0 and lr == 0.05 for sent, lr in out)


def test_without_the_lr_scheduler_marker_the_wrapper_is_found_by_functools_wraps(monkeypatch):
    monkeypatch.setattr(_compat, "_LR_SCHED_MARK", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the scheduler may warn about the step order: ours is taken
        out = run_ranks(2, scheduled)
    assert all(sent > 0 and lr == 0.05 for sent, lr in out)


# -- torch.nn.modules.batchnorm._BatchNorm ---------------------------------------------------------

def test_sync_batch_norm_on_the_public_base_gives_the_same_results(monkeypatch):
    monkeypatch.setattr(_compat, "_BATCH_NORM", None)
    base = _compat._batch_norm_base()
    assert base is torch.nn.BatchNorm1d
    monkeypatch.setattr(_compat, "BatchNormBase", base)
    # a second copy of the module, its class built on the public base
    spec = importlib.util.spec_from_file_location("torch_plugin._sync_batch_norm_public",
                                                  hco.sync_batch_norm.__file__)
    public = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(public)
    assert issubclass(public.SyncBatchNorm, torch.nn.BatchNorm1d)
    hco.init()
    x = torch.randn(5, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    a = hco.SyncBatchNorm(3)
    torch.manual_seed(0)
    b = public.SyncBatchNorm(3)
    b.load_state_dict(a.state_dict())
    for training in (True, False, True, False):
        a.train(training)
        b.train(training)
        assert torch.equal(a(x), b(x))
    assert torch.equal(a.running_var, b.running_var) and torch.equal(a.running_mean, b.running_mean)
