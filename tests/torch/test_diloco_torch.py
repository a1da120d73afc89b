"""DiLoCo and the quantiser through torch_plugin.DistributedOptimizer (docs/diloco.md#outer), on
in-process ranks: AdamW inside, built-in or torch.optim outer, resume bit-exact."""
import io

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Schedule, run_ranks  # noqa: E402
from hvd_commopt.errors import ConfigError  # noqa: E402
from tests.torch.test_schedules_torch import backward, make_model, params, same  # noqa: E402

ADAMW = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01)  # noqa: E731


def train(model, opt, steps, rank):
    for t in steps:
        opt.zero_grad()
        backward(model, rank, t)
        opt.step()


def checkpoint(model, opt) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def restore(model, opt, blob: bytes) -> None:
    ck = torch.load(io.BytesIO(blob), weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])


def run(P, schedule, steps, make_opt=ADAMW, **kw):
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                       communicator=comm, schedule=schedule, **kw)
        train(model, opt, range(steps), comm.rank)
        opt.finalize()
        return params(model)
    return run_ranks(P, body)


def test_torch_sgd_outer_equals_the_builtin_nesterov_bit_for_bit():
    builtin = run(2, Schedule.diloco(3), 7)
    torch_sgd = run(2, Schedule.diloco(3, outer=torch.optim.SGD,
                                       outer_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True)), 7)
    for a, b in zip(builtin, torch_sgd):
        assert same(a, b)
    assert same(builtin[0], builtin[1])


def test_streaming_with_a_cut_tensor_torch_outer_equals_the_builtin_bit_for_bit():
    """Fragments balanced by elements cut a tensor; a torch outer optimizer steps its pieces (views
    of the global tensor) as the built-in one does, and keeps its state across syncs."""
    sched = dict(fragments=2, overlap=1)
    builtin = run(2, Schedule.diloco(4, **sched), 9)
    torch_sgd = run(2, Schedule.diloco(4, outer=torch.optim.SGD, outer_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True),
                                       **sched), 9)
    for a, b in zip(builtin, torch_sgd):
        assert same(a, b)
    assert same(builtin[0], builtin[1])

    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(ADAMW(model.parameters()), named_parameters=model.named_parameters(),
                                       communicator=comm, schedule=Schedule.diloco(4, **sched))
        sc = opt.comm_engine.scheduler
        return [sum(b.numel for b in sc.fragments[f]) for f in range(2)], len(sc._pieces)
    (loads, cut), _ = run_ranks(2, body)
    assert max(loads) - min(loads) <= 1 and cut == 2  # one tensor in two pieces


def test_a_torch_adam_outer_trains_and_ranks_agree():
    a, b = run(2, Schedule.diloco(2, outer=torch.optim.Adam, outer_kwargs=dict(lr=0.01)), 6)
    assert same(a, b) and all(torch.isfinite(p).all() for p in a)


def test_outer_must_be_an_optimizer_class():
    with pytest.raises(ConfigError, match="optimizer class"):
        Schedule.diloco(4, outer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0))
    with pytest.raises(ConfigError, match="not an optimizer class this adapter can build"):
        run(1, Schedule.diloco(2, outer=torch.nn.Linear), 2)
    with pytest.raises(ConfigError, match="could not be built"):
        run(1, Schedule.diloco(2, outer=torch.optim.SGD, outer_kwargs=dict(learning_rate=1.0)), 2)


@pytest.mark.parametrize("kind", ["diloco", "diloco_torch_outer", "streaming_int4", "streaming_torch_outer",
                                  "local_sgd_quantized"])
def test_resume_through_torch_state_dicts_is_bit_exact(kind):
    schedule, comp = {
        "diloco": (Schedule.diloco(3), None),
        "diloco_torch_outer": (Schedule.diloco(3, outer=torch.optim.Adam, outer_kwargs=dict(lr=0.05)), None),
        "streaming_int4": (Schedule.diloco(4, fragments=2, overlap=1), lambda: hco.Compression.quantize(4, density=0.5)),
        "streaming_torch_outer": (Schedule.diloco(4, fragments=2, overlap=1, outer=torch.optim.Adam,
                                                  outer_kwargs=dict(lr=0.05)), None),
        "local_sgd_quantized": (Schedule.local_sgd(2), lambda: hco.Compression.quantize(2)),
    }[kind]
    N, M = 7, 6

    def make(comm, seed):
        model = make_model(seed)
        opt = hco.DistributedOptimizer(ADAMW(model.parameters()), named_parameters=model.named_parameters(),
                                       communicator=comm, schedule=schedule, compression=comp() if comp else None)
        return model, opt

    def body(comm):
        model, opt = make(comm, 0)
        train(model, opt, range(N), comm.rank)
        blob = checkpoint(model, opt)
        train(model, opt, range(N, N + M), comm.rank)
        model2, opt2 = make(comm, 1)  # a fresh model and optimizer resume from the checkpoint
        restore(model2, opt2, blob)
        assert opt2.comm_engine.step == N
        train(model2, opt2, range(N, N + M), comm.rank)
        return params(model), params(model2)
    for a, b in run_ranks(2, body):
        assert same(a, b)


def test_quantized_gradients_under_sync_track_the_dense_run():
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    ref = run(2, None, 6, sgd)
    got = run(2, None, 6, sgd, compression=hco.Compression.quantize(8))
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            assert torch.allclose(x, y, atol=2e-3)


def test_use_global_weights_shows_the_global_model_between_syncs():
    def body(comm):
        model = make_model()
        opt = hco.DistributedOptimizer(ADAMW(model.parameters()), named_parameters=model.named_parameters(),
                                       communicator=comm, schedule=Schedule.diloco(4))
        train(model, opt, range(6), comm.rank)  # synced after step 4, two local steps since
        local = params(model)
        glob = [g.clone() for g in opt.comm_engine.scheduler.global_weights().values()]
        with opt.use_global_weights():
            inside = params(model)
        assert same(params(model), local)
        return inside, glob
    for inside, glob in run_ranks(2, body):
        assert sorted(tuple(t.shape) for t in inside) == sorted(tuple(t.shape) for t in glob)
        assert all(any(torch.equal(a, b) for b in glob) for a in inside)
