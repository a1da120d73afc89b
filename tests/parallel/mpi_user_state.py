"""Run on every rank under mpirun by test_user_state_mpi.py: what DDP and Horovod users rely on.

* GradScaler's plain idiom (docs/usage.md#amp): the weights equal a DDP-like reference computed
  here from every rank's batches, an Inf on rank 0 skips that step on every rank, and the uses
  that cannot work are refused at the first step with the fix;
* the optimizer state compared across ranks at the first step after a load (docs/cross-rank-check.md#state),
  the missing-compression-state warning and the memory-size check at load time;
* buffers broadcast as DDP does (docs/usage.md#buffers).
"""
import os
import re
import warnings

import pytest
import torch

import torch_plugin as hco
from hvd_commopt.errors import ConfigError, RankMismatchError

hco.init()
torch.set_num_threads(1)
R, P = hco.rank(), hco.size()
STEPS, BAD, SCALE = 5, 2, 2.0 ** 16


def make_model(bn=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16)] + ([torch.nn.BatchNorm1d(16)] if bn else []) + [torch.nn.Tanh(),
                                                                                        torch.nn.Linear(16, 4)]
    return torch.nn.Sequential(*layers)


def batches(rank, inf_at=None):
    g = torch.Generator().manual_seed(100 + rank)
    out = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]
    if inf_at is not None and rank == 0:
        out[inf_at][0][0, 0] = float("inf")
    return out


def loss_of(model, xy):
    return torch.nn.functional.cross_entropy(model(xy[0]), xy[1])


def wrap(net, **kw):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return hco.DistributedOptimizer(opt, named_parameters=net.named_parameters(), **kw)


def ddp_reference(skip):
    """What DDP + GradScaler gives: the mean of every rank's gradient, the skipped step left out."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    every = [batches(r) for r in range(P)]
    for s in range(STEPS):
        if s == skip:
            continue
        grads = []
        for r in range(P):
            model.zero_grad()
            loss_of(model, every[r][s]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / P
        opt.step()
    return [p.detach() for p in model.parameters()]


def plain_amp_run(compression=None, inf_at=None):
    model = make_model()
    opt = wrap(model, compression=compression)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    skipped = []
    for xy in batches(R, inf_at):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(loss_of(model, xy)).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    return [p.detach() for p in model.parameters()], skipped, scaler.get_scale()


# -- GradScaler ------------------------------------------------------------------------------------
def test_plain_gradscaler_idiom_equals_ddp_and_skips_an_overflow_on_every_rank():
    params, skipped, scale = plain_amp_run()
    for a, b in zip(params, ddp_reference(skip=None)):
        assert torch.equal(a, b), (R, (a - b).abs().max())  # was 65536x the update, then NaN
    assert skipped == [False] * STEPS
    params, skipped, scale = plain_amp_run(inf_at=BAD)
    assert skipped == [s == BAD for s in range(STEPS)], (R, skipped)  # on rank 1 too: its batch is finite
    assert scale == SCALE / 2
    for a, b in zip(params, ddp_reference(skip=BAD)):
        assert torch.equal(a, b), (R, (a - b).abs().max())


def test_plain_gradscaler_idiom_with_topk_skips_on_every_rank_and_ranks_agree():
    params, skipped, scale = plain_amp_run(hco.Compression.topk(0.3), inf_at=BAD)
    assert skipped == [s == BAD for s in range(STEPS)], (R, skipped)
    assert scale == SCALE / 2
    assert all(torch.isfinite(p).all() for p in params)
    every = hco.allgather_object([p.clone() for p in params])
    for a, b in zip(every[0], every[1]):
        assert torch.equal(a, b)


def test_unscale_before_the_reduction_is_refused_at_the_first_step():
    model = make_model()
    opt = wrap(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(loss_of(model, batches(R)[0])).backward()
    scaler.unscale_(opt)  # DDP's clipping idiom
    with pytest.raises(ConfigError, match=r"optimizer.synchronize\(\); scaler.unscale_\(optimizer\)"):
        scaler.step(opt)


def test_gradscaler_with_local_sgd_is_refused_at_the_first_step():
    model = make_model()
    opt = wrap(model, schedule=hco.Schedule.local_sgd(2))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(loss_of(model, batches(R)[0])).backward()
    with pytest.raises(ConfigError, match=r"bf16 autocast without a GradScaler"):
        scaler.step(opt)


# -- optimizer state after a load ------------------------------------------------------------------
def trained_checkpoint(compression=None):
    model = make_model()
    opt = wrap(model, compression=compression)
    for xy in batches(R)[:2]:
        opt.zero_grad()
        loss_of(model, xy).backward()
        opt.step()
    return model.state_dict(), opt.state_dict()  # every rank calls state_dict(): a collective


def resume(model_sd, opt_sd, compression=None, load=True):
    model = make_model()
    model.load_state_dict(model_sd)
    opt = wrap(model, compression=compression)
    if load:
        opt.load_state_dict(opt_sd)
    return model, opt


def one_step(model, opt):
    opt.zero_grad()
    loss_of(model, batches(R)[3]).backward()
    opt.step()


def test_per_rank_state_with_a_renamed_key_is_refused_at_the_first_step_naming_it():
    comp = hco.Compression.topk(0.3)
    model_sd, opt_sd = trained_checkpoint(comp)
    opt_sd = hco.broadcast_object(opt_sd if R == 0 else None)  # every rank loads rank 0's file
    if R == 1:  # one renamed key in rank 1's part: its memory of the bias bucket
        mem = opt_sd["hvd_commopt"]["ranks"][1]["reducer"]["memory"]
        store = next(iter(mem.values()))
        key = sorted(store)[-1]
        store[key + ".renamed"] = store.pop(key)
    model, opt = resume(model_sd, opt_sd, comp)
    with pytest.raises(RankMismatchError, match=r"the optimizer state at the first step differs across ranks: "
                                                r"'compression\.memory\..*' is .*broadcast_optimizer_state"):
        one_step(model, opt)


def test_checkpoint_loaded_on_rank_0_only_is_refused_at_the_first_step():
    model_sd, opt_sd = trained_checkpoint()
    model, opt = resume(model_sd, opt_sd, load=(R == 0))  # broadcast_optimizer_state forgotten
    with pytest.raises(RankMismatchError, match=r"'optimizer\.state\[0\.bias\]\.momentum_buffer' is "
                                                r"rank 0: float32\[16\] #[0-9a-f]+; rank 1: absent"):
        one_step(model, opt)


def test_horovod_idiom_load_on_rank_0_then_broadcast_passes_the_check():
    model_sd, opt_sd = trained_checkpoint(hco.Compression.topk(0.3))
    model, opt = resume(model_sd, opt_sd, hco.Compression.topk(0.3), load=(R == 0))
    hco.broadcast_optimizer_state(opt, root_rank=0)
    for _ in range(2):
        one_step(model, opt)
    every = hco.allgather_object([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(every[0], every[1]))


def test_checkpoint_without_compression_state_warns_once():
    model_sd, opt_sd = trained_checkpoint()  # an uncompressed run
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        resume(model_sd, opt_sd, hco.Compression.topk(0.3))
        del opt_sd["hvd_commopt"]
        resume(model_sd, opt_sd, hco.Compression.topk(0.3))
    msgs = [str(w.message) for w in rec if "lacks the compression state" in str(w.message)]
    assert len(msgs) == 2, [str(w.message) for w in rec]
    assert "holds no memory (saved by an uncompressed run" in msgs[0]
    assert "has no 'hvd_commopt' section" in msgs[1]


def test_memory_of_the_wrong_size_is_refused_at_load_time():
    comp = hco.Compression.topk(0.3)
    model_sd, opt_sd = trained_checkpoint(comp)
    store = next(iter(opt_sd["hvd_commopt"]["ranks"][R]["reducer"]["memory"].values()))
    key = sorted(store)[0]
    store[key] = store[key][:-1]
    with pytest.raises(ConfigError, match=rf"bucket '{re.escape(key)}' holds \d+ values, but this optimizer's bucket"):
        resume(model_sd, opt_sd, comp)


# -- buffers ---------------------------------------------------------------------------------------
def bn_run(**kw):
    model = make_model(bn=True)
    with torch.no_grad():  # running statistics that differ across ranks before training
        model[1].running_mean.fill_(float(R))
    hco.broadcast_parameters(dict(model.named_parameters()), root_rank=0)  # parameters only
    opt = wrap(model, model=model, **kw)
    for xy in batches(R):
        opt.zero_grad()
        loss_of(model, xy).backward()
        opt.step()
    model.eval()
    return model(torch.ones(2, 8)).detach(), model


def test_buffers_are_broadcast_by_default_as_ddp_does():
    out, model = bn_run()
    every = hco.allgather_object(out)
    assert torch.equal(every[0], every[1])  # was 0.1 apart after 20 steps
    # the eval forward above completed the last broadcast: rank 0's statistics, what DDP leaves
    stats = hco.allgather_object(model[1].running_var.clone())
    assert torch.equal(stats[0], stats[1])


def test_buffers_loaded_between_steps_keep_the_loaded_values():
    model = make_model(bn=True)
    opt = wrap(model, model=model)
    one_step(model, opt)  # a broadcast of rank 0's buffers is now in flight
    with torch.no_grad():
        model[1].running_mean.fill_(5.0 + R)  # e.g. model.load_state_dict(per-rank file)
    model(torch.ones(2, 8))  # completes the broadcast: running_mean was set since it started
    assert torch.all(model[1].running_mean != 0)
    assert float(model[1].running_var.sum()) == float(hco.broadcast_object(model[1].running_var.clone()).sum())


def test_buffers_left_per_rank_are_named_at_wrap_time():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        model = make_model(bn=True)
        with torch.no_grad():
            model[1].running_mean.fill_(float(R))
        wrap(model, model=model, broadcast_buffers=False)
    assert any("the model's buffers differ across ranks: ['1.running_mean']" in str(w.message) for w in rec)


def test_buffers_of_another_shape_are_refused_at_wrap_time():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16 + R))
    model[1] = torch.nn.BatchNorm1d(16 + R)
    with pytest.raises(RankMismatchError, match=r"the model's buffers differs across ranks: tensor #0 is "
                                                r"'1.running_mean' shape \(16,\) float32 on rank 0 but "
                                                r"'1.running_mean' shape \(17,\) float32 on rank 1"):
        hco.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1),
                                 named_parameters=model[0].named_parameters(), model=model)


def test_horovod_explicit_state_dict_broadcast_keeps_working():
    model = make_model(bn=True)
    with torch.no_grad():
        model[1].running_mean.fill_(float(R))
    opt = wrap(model)
    hco.broadcast_parameters(model.state_dict(), root_rank=0)
    every = hco.allgather_object(model[1].running_mean.clone())
    assert torch.equal(every[0], every[1])
    one_step(model, opt)


if __name__ == "__main__":
    os._exit(pytest.main([__file__, "-q", "-x"]))
