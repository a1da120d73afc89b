"""Reduced gradients handed to ``p.grad`` as views of the engine's buffers (docs/wrapper.md#grad-views).

The oracle is the same run with the old hand-over (a copy into ``p.grad``): values must be equal
bit for bit, and the sharing of storage must be what the doc says.
"""
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Schedule, run_ranks  # noqa: E402

from .test_optimizer import data, make_model  # noqa: E402


def copying_set_grads(host):
    """The hand-over as it was before views: copy into ``p.grad``."""
    def set_grads(grads):
        with torch.no_grad():
            for n, g in grads.items():
                p = host.params[n]
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad.copy_(g)
    return set_grads


def storage(t):
    return t.untyped_storage().data_ptr()


def run(comm, *, copy, zero="none", passes=1, compression=None, clip=False, schedule=None, steps=4,
        keep=False):
    """Train ``steps`` steps; per step the parameters and gradients (cloned), and whether a kept
    reference to an earlier step's ``p.grad`` still held that step's values."""
    model = make_model(hidden=16)
    # a fresh compression object per run: a shared one may carry the other run's residuals
    kw = {} if compression is None else {"compression": compression()}
    if schedule is not None:
        kw["schedule"] = schedule
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), communicator=comm,
                                   backward_passes_per_step=passes, **kw)
    if copy:
        host = opt.comm_engine.host
        host.set_grads = copying_set_grads(host)
    out, kept = [], []
    for step in range(steps):
        if zero == "none":
            opt.zero_grad()
        elif zero == "zeros":
            opt.zero_grad(set_to_none=False)
        for k in range(passes):
            x, y = data(comm.rank, seed=10 * step + k)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        if keep and zero == "none":  # otherwise backward accumulates into p.grad, as it always did
            kept.append(([p.grad for p in model.parameters()], grads))
        out.append(([p.detach().clone() for p in model.parameters()], grads))
    intact = all(all(g is None or torch.equal(g, c) for g, c in zip(refs, clones)) for refs, clones in kept)
    return out, intact


CASES = {
    "set_to_none": {},
    "zero_grad_set_to_none_false": {"zero": "zeros"},
    "no_zero_grad_accumulates": {"zero": "never"},
    "two_passes_set_to_none_false": {"zero": "zeros", "passes": 2},
    "synchronize_clip_skip": {"zero": "zeros", "clip": True},
    "topk": {"compression": lambda: hco.Compression.topk(0.3)},
    "topk_set_to_none_false_two_passes": {"compression": lambda: hco.Compression.topk(0.3), "zero": "zeros",
                                          "passes": 2},
    "od": {"schedule": Schedule.od(warmup_steps=2, local_lr=None, local_momentum=0.0, local_scale=1.0),
           "zero": "zeros"},
    "ssd": {"schedule": Schedule.ssd(delay=2, warmup_steps=1, local_lr=None, local_scale=1.0, glu=0)},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_views_equal_the_copying_hand_over_bit_for_bit(case):
    kw = CASES[case]

    def body(comm):
        return run(comm, copy=True, **kw)[0], run(comm, copy=False, keep=True, **kw)

    for ref, (got, intact) in run_ranks(2, body):
        assert intact  # a kept p.grad is never overwritten by a later step
        for (pr, gr), (pg, gg) in zip(ref, got):
            assert all(torch.equal(a, b) for a, b in zip(pr, pg))
            assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(gr, gg))


def test_grads_are_views_of_one_reused_buffer():
    """One bucket: every p.grad is a view of it; set_to_none drops the views, so the next step
    packs into the same buffer; with set_to_none=False the next round takes a second buffer
    (never the one backward accumulated into) and the two alternate."""
    def body(comm):
        model = make_model(hidden=16)
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), communicator=comm)
        seen = []
        for step in range(6):
            opt.zero_grad(set_to_none=step < 3)
            x, y = data(comm.rank, seed=step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            local = {storage(p.grad) for p in model.parameters()}
            opt.step()
            ptrs = {storage(p.grad) for p in model.parameters()}
            assert len(ptrs) == 1 and all(p.grad._base is not None for p in model.parameters())
            seen.append((ptrs.pop(), local))
        return seen
    for seen in run_ranks(2, body):
        bufs = [b for b, _ in seen]
        assert bufs[0] == bufs[1] == bufs[2]            # set_to_none: reused
        assert bufs[3] != bufs[2]                       # step 2's views are still p.grad
        assert bufs[4] == bufs[2] and bufs[5] == bufs[3]  # kept views: two buffers alternate
        for s in (3, 4, 5):
            assert seen[s][1] == {bufs[s - 1]}          # backward accumulated into the views
            assert bufs[s] not in seen[s][1]            # ... and the round packed elsewhere


def test_sparse_result_views_are_handed_over():
    def body(comm):
        model = make_model(hidden=16)
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), communicator=comm,
                                       compression=hco.Compression.topk(0.3))
        x, y = data(comm.rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ptrs = {storage(p.grad) for p in model.parameters()}
        return len(ptrs), all(p.grad._base is not None for p in model.parameters())
    for n, views in run_ranks(2, body):
        # two buckets (the weights', selected, and the biases', sent whole: docs/topk.md#dense-1d),
        # every gradient a view of its bucket's result buffer
        assert n == 2 and views


def test_checkpoint_round_trip_with_views():
    """Save after 2 steps (grads are views), load into a fresh model and optimizer, continue:
    equal bit for bit to the uninterrupted run (Top-k: the residuals travel in the checkpoint)."""
    def make(comm):
        model = make_model(hidden=16)
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), communicator=comm,
                                       compression=hco.Compression.topk(0.3))
        return model, opt

    def steps(comm, model, opt, seeds):
        for s in seeds:
            opt.zero_grad(set_to_none=False)
            x, y = data(comm.rank, seed=s)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    def body(comm):
        model, opt = make(comm)
        steps(comm, model, opt, range(4))
        m1, o1 = make(comm)
        steps(comm, m1, o1, range(2))
        msd, osd = m1.state_dict(), o1.state_dict()
        m2, o2 = make(comm)
        m2.load_state_dict(msd)
        o2.load_state_dict(osd)
        steps(comm, m2, o2, range(2, 4))
        return all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters()))
    assert all(run_ranks(2, body))
