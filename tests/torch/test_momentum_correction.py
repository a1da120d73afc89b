"""Momentum correction (docs/topk.md#momentum-correction) and DGC's momentum taken from the wrapped
optimizer (docs/dgc.md#optimizer-momentum): invariants with real torch optimizers, in-process ranks."""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, ConfigError, run_ranks  # noqa: E402
from hvd_commopt.memory.momentum import MomentumCorrection  # noqa: E402

torch.manual_seed(0)
INIT = copy.deepcopy(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).state_dict())


def train(P, compression=None, steps=6, momentum=0.9, nesterov=False, wd=0.0, **kw):
    """Weights of every rank after ``steps`` steps (each rank its own data)."""
    def body(comm):
        torch.set_num_threads(1)
        m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        m.load_state_dict(INIT)
        opt = hco.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd),
            named_parameters=m.named_parameters(), compression=compression() if compression else None,
            communicator=comm, **kw)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in m.state_dict().items()}, opt
    return run_ranks(P, body)


def assert_same(a, b):
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("factory", [lambda: Compression.topk(1.0), lambda: Compression.gtopk(1.0),
                                     lambda: Compression.randomk(1.0), lambda: Compression.dgc(1.0)])
@pytest.mark.parametrize("nesterov", [False, True])
def test_density_one_with_correction_is_momentum_ssgd_bit_for_bit(factory, nesterov):
    """Density 1: allreduce(average), then u = mu*u + g on the average, applied by the optimizer
    without momentum: torch.optim.SGD's momentum arithmetic, so S-SGD with momentum exactly.
    Nesterov: DGC's form u = mu*(u+g), u+g is torch's g + mu*buf with u = mu*buf, the same
    maths in another order, so equal up to rounding."""
    ref = train(2, None, nesterov=nesterov)
    got = train(2, factory, nesterov=nesterov)
    for (a, _), (b, opt) in zip(ref, got):
        if nesterov:
            for k in a:
                np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-5, atol=1e-6)
        else:
            assert_same(a, b)
    # the optimizer ran without momentum (no double momentum): no momentum buffers, and its own
    # hyper-parameters are back to the user's after every step
    assert all("momentum_buffer" not in s for s in opt.state.values())
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["nesterov"] is nesterov


def test_density_one_layerwise_lags_is_momentum_ssgd_bit_for_bit():
    ref = train(3, None)
    got = train(3, lambda: Compression.topk(1.0), fusion_threshold=0)
    for (a, _), (b, _) in zip(ref, got):
        assert_same(a, b)


def test_sparse_correction_keeps_the_partition_and_binds_the_optimizers_momentum():
    (w, opt), _ = train(2, lambda: Compression.topk(0.2), steps=4)
    mem = opt.comm_engine.reducer.memory
    assert isinstance(mem, MomentumCorrection) and mem.momentum == 0.9
    assert opt.comm_engine.reducer.config()["memory"]["momentum"] == "optimizer"


def test_correction_off_is_plain_error_feedback():
    (w, opt), _ = train(2, lambda: Compression.topk(0.2, momentum_correction=False), steps=3)
    assert opt.comm_engine.reducer.memory.config()["name"] == "error_feedback"
    assert any("momentum_buffer" in s for s in opt.state.values())


def test_dgc_with_explicit_momentum_refuses_an_optimizer_with_momentum():
    with pytest.raises(ConfigError, match="momentum twice"):
        train(1, lambda: Compression.dgc(0.1, momentum=0.5), steps=1)
    # an explicit momentum with an optimizer without momentum is the classic DGC set-up
    train(1, lambda: Compression.dgc(0.1, momentum=0.5), steps=1, momentum=0.0)


def test_dgc_without_an_optimizer_needs_its_momentum():
    from hvd_commopt import NumpyOps, build_engine
    from hvd_commopt.buckets import TensorSpec

    def body(comm):
        eng = build_engine(comm, NumpyOps(), compression=Compression.dgc(0.5))
        eng.register([TensorSpec("w", (4,), "float32")])
        return eng.reduce_step({"w": np.ones(4, np.float32)})
    with pytest.raises(ConfigError, match="pass the momentum explicitly"):
        run_ranks(1, body)


def test_min_k_floor_per_layer():
    from hvd_commopt.compress.topk import TopKSelector
    c = TopKSelector(0.01, min_k=16)
    assert c.k_for(144) == 16 and c.k_for(10_000) == 100 and c.k_for(8) == 8
    with pytest.raises(ConfigError, match="min_k"):
        TopKSelector(0.01, min_k=0)


def test_randomk_warns_where_it_was_measured_not_to_train():
    with pytest.warns(RuntimeWarning, match="stale"):
        train(1, lambda: Compression.randomk(0.01), steps=1)
    with pytest.warns(RuntimeWarning, match="diverges"):
        train(1, lambda: Compression.randomk(0.5, momentum_correction=False), steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(1, lambda: Compression.randomk(0.5), steps=1)
    with pytest.raises(ConfigError, match="error_feedback=False"):
        Compression.randomk(0.1, unbiased=True)


def test_a_non_sgd_optimizer_with_momentum_keeps_it():
    """RMSprop's momentum is not SGD's: the default falls back to error feedback, DGC refuses."""
    def body(comm, factory):
        m = torch.nn.Linear(4, 2)
        opt = hco.DistributedOptimizer(torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=m.named_parameters(), compression=factory(),
                                       communicator=comm)
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        return opt.comm_engine.reducer.memory.momentum, opt.param_groups[0]["momentum"]
    assert run_ranks(1, body, lambda: Compression.topk(0.5)) == [(0.0, 0.9)]
    with pytest.raises(ConfigError, match="momentum=0"):
        run_ranks(1, body, lambda: Compression.dgc(0.5))
