"""Sparse compression under torch.optim.Adam/AdamW (docs/adaptive-optimizers.md), in-process ranks:
the dense warm-up is dense S-SGD's Adam bit for bit, the density applies after it, the host reports
the optimizer family through the typed seam, and DGC's momentum is handled (no warning at
momentum=None, one warning naming the fix for a momentum of its own)."""
from __future__ import annotations

import copy
import functools
import warnings

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.compress.warmup import DensityWarmup  # noqa: E402
from hvd_commopt.host import ADAPTIVE  # noqa: E402
from hvd_commopt.reduce.adaptive import ADAPTIVE_WARMUP_STEPS  # noqa: E402
from torch_plugin.host import TorchScheduleHost  # noqa: E402

torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
INIT = copy.deepcopy(MODEL.state_dict())


def train(P, compression=None, steps=4, opt_cls=torch.optim.AdamW, warmup=None):
    """Every rank's weights after ``steps`` steps (each rank its own data) and its last step's bytes."""
    def body(comm):
        torch.set_num_threads(1)
        m = copy.deepcopy(MODEL)
        m.load_state_dict(INIT)
        comp = compression() if compression else None
        if warmup is not None:
            comp.compressor.warmup = warmup
        opt = hco.DistributedOptimizer(opt_cls(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
                                       compression=comp, communicator=comm)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in m.state_dict().items()}, opt.comm_stats["bytes_sent"]
    return run_ranks(P, body)


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("factory", [lambda: Compression.topk(0.01), lambda: Compression.gtopk(0.01),
                                     lambda: Compression.oktopk(0.01), lambda: Compression.randomk(0.01),
                                     lambda: Compression.dgc(0.01)])
def test_warmup_under_adam_is_dense_ssgd_bit_for_bit(factory, opt_cls):
    """The default warm-up sends every bucket whole: the sparse reducers' dense path, so the first
    steps are S-SGD with the same Adam, exactly."""
    assert ADAPTIVE_WARMUP_STEPS > 4
    ref = train(2, None, opt_cls=opt_cls)
    got = train(2, factory, opt_cls=opt_cls)
    for (a, _), (b, _) in zip(ref, got):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_after_the_warmup_the_density_applies():
    ref = train(2, None)
    short = train(2, lambda: Compression.topk(0.01), warmup=DensityWarmup(2))
    for (a, dense_bytes), (b, sparse_bytes) in zip(ref, short):
        assert any(not torch.equal(a[k], b[k]) for k in a)  # steps 2 and 3 were sparse
        assert sparse_bytes < dense_bytes / 2


@pytest.mark.parametrize("factory", [lambda: Compression.topk(0.01, warmup_steps=4),
                                     lambda: Compression.gtopk(0.01, warmup_steps=4),
                                     lambda: Compression.dgc(0.01, warmup_steps=4)])
def test_warmup_steps_under_sgd_momentum_is_dense_ssgd_bit_for_bit(factory):
    """``warmup_steps=`` under SGD with momentum (momentum correction on): the warm-up steps are
    momentum S-SGD exactly (docs/adaptive-optimizers.md#warmup-steps); the density applies after."""
    sgd = functools.partial(torch.optim.SGD, momentum=0.9)
    ref = train(2, None, opt_cls=sgd)
    got = train(2, factory, opt_cls=sgd)
    for (a, dense_bytes), (b, bytes_) in zip(ref, got):
        for k in a:
            assert torch.equal(a[k], b[k]), k
        assert bytes_ == dense_bytes
    ref, got = train(2, None, steps=6, opt_cls=sgd), train(2, factory, steps=6, opt_cls=sgd)
    for (a, dense_bytes), (b, bytes_) in zip(ref, got):
        assert any(not torch.equal(a[k], b[k]) for k in a) and bytes_ < dense_bytes / 2


def test_host_reports_the_family():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad):
        assert TorchScheduleHost(cls(p), [("w", p[0])]).optimizer_family() == ADAPTIVE
    assert TorchScheduleHost(torch.optim.SGD(p, lr=0.1), [("w", p[0])]).optimizer_family() == "sgd"


def _wrap_warnings(compression):
    def body(comm):
        m = copy.deepcopy(MODEL)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            hco.DistributedOptimizer(torch.optim.Adam(m.parameters()), named_parameters=m.named_parameters(),
                                     compression=compression, communicator=comm)
        return [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    return run_ranks(1, body)[0]  # one rank: warnings.catch_warnings is process-wide


def test_dgc_under_adam_warns_only_for_its_own_momentum():
    assert _wrap_warnings(Compression.dgc(0.01)) == []
    assert _wrap_warnings(Compression.topk(0.01, momentum_correction=True)) == []
    msgs = _wrap_warnings(Compression.dgc(0.01, momentum=0.9))
    assert len(msgs) == 1 and "two momenta in series" in msgs[0] and "momentum=None" in msgs[0]
