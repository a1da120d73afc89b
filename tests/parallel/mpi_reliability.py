"""Rank-side checks of NaN/Inf handling and checkpoints; run by test_reliability.py under mpirun.

docs/wrapper.md#nonfinite, docs/wrapper.md#checkpoints. Every rank runs these tests; a failure on
any rank fails the job. Skipped at size 1.
"""
import pytest
import torch

import torch_plugin as hco
from hvd_commopt import Compression
from tests.parallel.ranks import require_mpirun

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
require_mpirun("tests/parallel/test_reliability.py")


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def gathered(tensors):
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).reshape(1, -1)
    return hco.allgather(flat)


# -- NaN/Inf: DGC with a GradScaler -------------------------------------------------------------
STEPS, BAD, SCALE = 6, 2, 2.0 ** 10


def dgc_run(skip_bad):
    model = make_model()
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=Compression.dgc(0.2, sample_ratio=1.0))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    sent, skipped = [], []
    for s in range(STEPS):
        if skip_bad and s == BAD:
            scaler.update(new_scale=SCALE / 2)
            continue
        x, y = batch(R, s)
        if s == BAD and R == 0:
            x[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        sent.append(opt.comm_stats["bytes_sent"])
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    mem = opt.comm_engine.reducer.memory
    state = {k: torch.cat([t.reshape(-1) for t in d.values()]) for k, d in mem.state_dict().items()}
    return [p.detach().clone() for p in model.parameters()], state, sent, skipped, scaler.get_scale()


def test_dgc_nan_on_one_rank_costs_one_step_and_never_enters_the_memory():
    with pytest.warns(RuntimeWarning, match="rank 0: the gradient of bucket") if R == 0 else _no_check():
        params_a, mem_a, sent_a, skipped, scale = dgc_run(False)
    params_b, mem_b, _, _, _ = dgc_run(True)
    assert skipped == [s == BAD for s in range(STEPS)]
    assert scale == SCALE / 2
    assert all(torch.isfinite(t).all() for t in mem_a.values())
    assert all(b > 0 for b in sent_a[BAD + 1:]), sent_a  # the rank keeps sending after the NaN step
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
    for k in mem_a:
        assert torch.equal(mem_a[k], mem_b[k]), k
    everyone = gathered(params_a)
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(P))


class _no_check:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- checkpoints: the Horovod idiom ----------------------------------------------------------
N_SAVE, M_MORE = 5, 5
CONFIGS = {
    "topk": dict(compression=lambda: Compression.topk(0.1), schedule=lambda: None),
    "od": dict(compression=lambda: None,
               schedule=lambda: hco.Schedule.od(warmup_steps=2, local_lr=0.05, local_momentum=0.5)),
    "local_sgd": dict(compression=lambda: None, schedule=lambda: hco.Schedule.local_sgd(period=3)),
    "cocod": dict(compression=lambda: None, schedule=lambda: hco.Schedule.cocod(period=2)),
    "cd": dict(compression=lambda: None,
               schedule=lambda: hco.Schedule.cd(warmup_steps=2, correction_every=3, local_lr=0.05)),
}


def build(kind, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = CONFIGS[kind]
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=cfg["compression"](),
                                   schedule=cfg["schedule"]())
    return model, opt


def steps(model, opt, first, count):
    for s in range(first, first + count):
        x, y = batch(R, s)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def save_on_rank0(model, opt):
    """Every rank calls state_dict (a collective); rank 0 writes the bytes (a shared file system)."""
    import io
    sd = {"model": model.state_dict(), "opt": opt.state_dict()}
    data = None
    if R == 0:
        buf = io.BytesIO()
        torch.save(sd, buf)
        data = buf.getvalue()
    return data


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("idiom", ["every_rank_loads", "broadcast"])
def test_horovod_idiom_resumes_bit_exactly(kind, idiom):
    import io
    ref_model, ref_opt = build(kind)
    steps(ref_model, ref_opt, 0, N_SAVE + M_MORE)

    model, opt = build(kind)
    steps(model, opt, 0, N_SAVE)
    data = save_on_rank0(model, opt)
    data = hco.broadcast_object(data, 0) if idiom == "every_rank_loads" else data
    del model, opt

    model2, opt2 = build(kind, seed=R + 1)  # fresh, and different on every rank
    if idiom == "every_rank_loads":
        ck = torch.load(io.BytesIO(data), weights_only=True)
        assert ck["opt"]["hvd_commopt"]["world_size"] == P and sorted(ck["opt"]["hvd_commopt"]["ranks"]) == list(range(P))
        model2.load_state_dict(ck["model"])
        opt2.load_state_dict(ck["opt"])
    else:  # rank 0 loads, then Horovod's broadcasts
        if R == 0:
            ck = torch.load(io.BytesIO(data), weights_only=True)
            model2.load_state_dict(ck["model"])
            opt2.load_state_dict(ck["opt"])
        hco.broadcast_parameters(model2.state_dict(), root_rank=0)
        hco.broadcast_optimizer_state(opt2, root_rank=0)
    steps(model2, opt2, N_SAVE, M_MORE)
    for a, b in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(a, b), (kind, idiom, R)
    ref_mem = ref_opt.comm_engine.reducer.state_dict()
    mem = opt2.comm_engine.reducer.state_dict()
    for k, d in ref_mem.get("memory", {}).get("residuals", {}).items():
        assert torch.equal(d, mem["memory"]["residuals"][k])
    for o in (ref_opt, opt2):
        o.finalize()
    for a, b in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


# -- a checkpoint of P ranks loaded by another number of ranks ---------------------------------
def test_save_for_resize():
    import os
    model, opt = build("topk")
    steps(model, opt, 0, N_SAVE)
    sd = {"model": model.state_dict(), "opt": opt.state_dict()}
    if R == 0:
        torch.save(sd, os.environ["HCO_TEST_CKPT"])


def test_load_resized():
    import os
    import warnings
    model, opt = build("topk")
    ck = torch.load(os.environ["HCO_TEST_CKPT"], weights_only=True)
    saved = ck["opt"]["hvd_commopt"]["world_size"]
    assert saved != P
    model.load_state_dict(ck["model"])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.load_state_dict(ck["opt"])
    msg = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert any(f"rank {R}: this checkpoint was saved by {saved} ranks and is loaded by {P}" in m for m in msg), msg
    assert opt.comm_engine.step == N_SAVE  # shared state kept
    assert opt.comm_engine.reducer.memory.residuals() == {}  # per-rank state reset
    steps(model, opt, N_SAVE, 3)
    everyone = gathered(list(model.parameters()))
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(P))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    print(f"rank {R}: resized load ok")


def raise_on_nan():
    """Script mode: nonfinite="raise" and a NaN on rank 0 at step 1; the job must end."""
    model = make_model()
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=Compression.topk(0.2, nonfinite="raise"))
    for s in range(4):
        x, y = batch(R, s)
        if s == 1 and R == 0:
            x[0, 0] = float("nan")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    print(f"rank {R}: finished, which it must not")


if __name__ == "__main__":
    import sys
    {"raise_on_nan": raise_on_nan}[sys.argv[1]]()
