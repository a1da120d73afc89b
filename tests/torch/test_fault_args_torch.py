"""PyTorch adapter: bad arguments give one clear error naming the fix; one compression object
shared by two optimizers keeps one state per optimizer; a second optimizer over the same
parameters is refused (docs/cross-rank-check.md#arguments, docs/cross-rank-check.md#shared-compression,
docs/cross-rank-check.md#second-optimizer)."""
import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import run_ranks, runtime  # noqa: E402
from hvd_commopt.errors import ConfigError  # noqa: E402
from tests.bad_args import BAD_WRAPPER_ARGS  # noqa: E402

from .test_optimizer import data, make_model  # noqa: E402

_LAUNCH_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "HOROVOD_RANK",
                "HOROVOD_SIZE", "RANK", "WORLD_SIZE", "HVD_COMMOPT_BACKEND")


@pytest.fixture
def size_one(monkeypatch):
    for v in _LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)
    runtime.shutdown()
    hco.init()
    yield
    runtime.shutdown()


@pytest.mark.parametrize("kwargs, match", BAD_WRAPPER_ARGS)
def test_bad_wrapper_arguments_name_the_argument_and_the_fix(size_one, kwargs, match):
    model = make_model()
    with pytest.raises(ConfigError, match=match):
        hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), **kwargs)
    # nothing was attached: the same parameters can be wrapped with good arguments
    hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())


def test_root_rank_outside_the_job_is_refused_at_size_one(size_one):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fix = r"root_rank=3 is out of range: the job has 1 rank\(s\), numbered 0 to 0; pass root_rank= one of them"
    with pytest.raises(ConfigError, match=fix):
        hco.broadcast_parameters(model.state_dict(), root_rank=3)
    with pytest.raises(ConfigError, match=fix):
        hco.broadcast_optimizer_state(opt, root_rank=3)
    with pytest.raises(ConfigError, match=fix):
        hco.broadcast_object({"epoch": 1}, root_rank=3)
    with pytest.raises(ConfigError, match=fix):
        hco.broadcast(torch.ones(2), root_rank=3)
    hco.broadcast_parameters(model.state_dict(), root_rank=0)  # the valid root still works


def test_average_and_op_together_are_refused_as_horovod_does(size_one):
    with pytest.raises(ConfigError, match="not both"):
        hco.allreduce(torch.ones(2), average=True, op=hco.Sum)
    with pytest.raises(ConfigError, match="not both"):
        hco.grouped_allreduce([torch.ones(2)], average=False, op=hco.Average)
    assert torch.equal(hco.allreduce(torch.ones(2), average=False), torch.ones(2))  # one of them: fine


def test_second_optimizer_over_the_same_parameters_is_refused_until_the_first_is_dropped(size_one):
    model = make_model()
    first = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    with pytest.raises(ConfigError, match=r"parameter 'weight' is already handled by another "
                                          r"DistributedOptimizer .*Give each DistributedOptimizer its own "
                                          r"parameters"):
        hco.DistributedOptimizer(torch.optim.Adam(model[0].parameters(), lr=0.1),
                                 named_parameters=model[0].named_parameters())
    engine = weakref.ref(first.comm_engine)
    del first
    gc.collect()
    assert engine() is None  # nothing else kept the dropped optimizer (or its engine) alive
    second = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
    x, y = data(0)
    second.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    second.step()
    assert second.comm_engine.step == 1


def _train_gan(comm, shared: bool, steps: int = 4):
    """Two models of the same architecture (so the same bucket names), two optimizers, Top-k
    with error feedback; returns both models' final weights."""
    g, d = make_model(seed=1), make_model(seed=2)
    comp = hco.Compression.topk(0.2)
    comp_g, comp_d = (comp, comp) if shared else (comp, hco.Compression.topk(0.2))
    opt_g = hco.DistributedOptimizer(torch.optim.SGD(g.parameters(), lr=0.1), named_parameters=g.named_parameters(),
                                     compression=comp_g, communicator=comm)
    opt_d = hco.DistributedOptimizer(torch.optim.SGD(d.parameters(), lr=0.1), named_parameters=d.named_parameters(),
                                     compression=comp_d, communicator=comm)
    assert opt_g.comm_engine.reducer is comp  # the first engine uses the object itself
    assert opt_d.comm_engine.reducer is not opt_g.comm_engine.reducer
    assert opt_d.comm_engine.reducer.config() == comp.config()
    for step in range(steps):
        x, y = data(comm.rank, seed=step)
        for model, opt in ((d, opt_d), (g, opt_g)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    res_g = opt_g.comm_engine.reducer.memory.residuals()
    res_d = opt_d.comm_engine.reducer.memory.residuals()
    assert set(res_g) == set(res_d) and res_g  # same bucket names, separate residuals
    assert all(res_g[k] is not res_d[k] for k in res_g)
    assert "hvd_commopt" in opt_d.state_dict()
    return [p.detach().clone() for p in list(g.parameters()) + list(d.parameters())]


def test_one_topk_object_for_two_optimizers_keeps_one_residual_per_optimizer():
    shared = run_ranks(2, _train_gan, True)
    separate = run_ranks(2, _train_gan, False)
    for a, b in zip(shared, separate):  # bit-exact: sharing the object changes nothing
        for x, y in zip(a, b):
            assert torch.equal(x, y)
