"""Sparse compression under the delayed schedules (OD/SSD-SGD with Top-k, gTop-k, DGC, Ok-Topk;
docs/ssd-sgd.md#sparse-delayed), on in-process ranks with NumPy tensors. ``min_k=1``: the small
test tensors are selected, not sent whole under the default floor (docs/topk.md#density-floor)."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import Compression, Schedule, run_ranks
from tests.unit.schedule_helpers import NumpyHost, SwitchableMomentumHost, init_params, make_engine, one_step

SPARSE = {
    "topk": lambda: Compression.topk(0.2, min_k=1),
    "topk_thr": lambda: Compression.topk(0.4, selection="threshold", tau=3, min_k=1),  # k >= 1 for the 3-element bias
    "gtopk": lambda: Compression.gtopk(0.2, min_k=1),
    "dgc": lambda: Compression.dgc(0.2),
    "oktopk": lambda: Compression.oktopk(0.2, min_k=1),
}


def train(P, schedule, factory, steps, momentum=0.9, record=None, host_cls=NumpyHost):
    def body(comm):
        host = host_cls(init_params(), lr=0.1, momentum=momentum)
        red = factory()
        eng = make_engine(comm, schedule, host, fusion_threshold=0, compression=red)
        for t in range(steps):
            one_step(eng, host, comm.rank, t)
            if record is not None:
                record(comm, eng, red, t)
        rep = eng.scheduler.global_weights()
        res = {n: np.array(r, copy=True) for n, r in getattr(red.memory, "residuals", lambda: {})().items()}
        return ({k: v.copy() for k, v in host.w.items()},
                None if rep is None else {k: v.copy() for k, v in rep.items()}, res, eng)
    return run_ranks(P, body)


def _momentum(name):
    return 0.0 if name == "dgc" else 0.9  # DGC applies the momentum itself


@pytest.mark.parametrize("name", sorted(SPARSE))
@pytest.mark.parametrize("P", [2, 3])
def test_delay_zero_equals_the_synchronous_sparse_path_bit_for_bit(name, P):
    ref = train(P, Schedule.sync(), SPARSE[name], 7, momentum=_momentum(name))
    got = train(P, Schedule.ssd(delay=0, warmup_steps=2, glu=0), SPARSE[name], 7, momentum=_momentum(name))
    for (a, _, ra, _), (b, rep, rb, _) in zip(ref, got):
        for k in a:
            assert np.array_equal(a[k], b[k]), k
            assert np.array_equal(a[k], rep[k]), k
        assert ra.keys() == rb.keys()
        for k in ra:
            assert np.array_equal(ra[k], rb[k]), k


@pytest.mark.parametrize("name", ["topk", "gtopk", "dgc", "oktopk"])
def test_delay_zero_equals_the_synchronous_path_with_momentum_correction(name):
    """The optimizer's momentum 0.9 is applied by the memory before selection (momentum
    correction) and switched off in the optimizer: the delayed rounds must run the replica's
    update without it too, as the synchronous step does; with it twice, OD/SSD diverged."""
    ref = train(2, Schedule.sync(), SPARSE[name], 7, host_cls=SwitchableMomentumHost)
    got = train(2, Schedule.ssd(delay=0, warmup_steps=2, glu=0), SPARSE[name], 7, host_cls=SwitchableMomentumHost)
    for (a, _, ra, eng), (b, rep, rb, _) in zip(ref, got):
        assert eng.reducer.memory.momentum == 0.9  # correction is on, with the optimizer's momentum
        for k in a:
            assert np.array_equal(a[k], b[k]), k
            assert np.array_equal(a[k], rep[k]), k
        for k in ra:
            assert np.array_equal(ra[k], rb[k]), k


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_od_and_ssd_run_sparse_with_identical_replicas(name):
    for sched in (Schedule.od(warmup_steps=1, check_replica_every=1), Schedule.ssd(delay=2, warmup_steps=1)):
        digests = {}

        def record(comm, eng, red, t):
            digests.setdefault(t, {})[comm.rank] = eng.scheduler.replica_digest()
        out = train(3, sched, SPARSE[name], 6, momentum=_momentum(name), record=record)
        for t, d in digests.items():
            assert len(set(d.values())) == 1, (name, t)
        for model, rep, _, _ in out:
            assert all(np.isfinite(v).all() for v in model.values())


def test_error_feedback_is_exact_with_rounds_in_flight():
    """With delay 2 up to three rounds are in flight; the residual is per bucket, so at every
    selection sent + new residual == flat + old residual, bit for bit (the memory's invariant)."""
    checks = []

    def factory():
        red = Compression.topk(0.2, momentum_correction=False, min_k=1)
        mem = red.memory
        inner = mem.compensate_select

        def spy(ops, name, flat, select):
            old = mem.residual(ops, name, flat)
            acc = flat + (0 if old is None else old)  # before the in-place sum
            vals, idx = inner(ops, name, flat, select)
            rebuilt = mem.residual(ops, name, flat).copy()
            rebuilt[idx] += vals
            checks.append(np.array_equal(rebuilt.view(np.int32), acc.view(np.int32)))
            return vals, idx
        mem.compensate_select = spy
        return red
    train(2, Schedule.ssd(delay=2, warmup_steps=1), factory, 6)
    assert len(checks) == 2 * 6 * 2 and all(checks)  # ranks x steps x selected buckets (the 1-D one goes whole)


@pytest.mark.parametrize("name", ["topk", "topk_thr", "oktopk", "dgc"])
def test_state_dict_resumes_a_sparse_delayed_run_bit_for_bit(name):
    """Checkpoint after 4 steps of SSD (delay 2) with a sparse exchange, resume in a new engine:
    the next steps equal the uninterrupted run (residuals, thresholds, region cuts, replica)."""
    import copy

    def body(comm):
        sched = Schedule.ssd(delay=2, warmup_steps=1)
        host = NumpyHost(init_params(), lr=0.1, momentum=_momentum(name))
        eng = make_engine(comm, sched, host, fusion_threshold=0, compression=SPARSE[name]())
        for t in range(4):
            one_step(eng, host, comm.rank, t)
        sd = copy.deepcopy(eng.state_dict())
        snap = host.snapshot()
        for t in range(4, 7):
            one_step(eng, host, comm.rank, t)
        a = {k: v.copy() for k, v in host.w.items()}
        host2 = NumpyHost(init_params(), lr=0.1, momentum=_momentum(name))
        host2.restore(snap)
        eng2 = make_engine(comm, sched, host2, fusion_threshold=0, compression=SPARSE[name]())
        eng2.load_state_dict(sd)
        for t in range(4, 7):
            one_step(eng2, host2, comm.rank, t)
        return a, {k: v.copy() for k, v in host2.w.items()}
    for a, b in run_ranks(2, body):
        for k in a:
            assert np.array_equal(a[k], b[k]), k
