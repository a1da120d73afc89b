"""OMGS/MG-WFBP re-plans move residuals into the new buckets; a plan can be pinned to a file
(docs/lags-omgs.md#replan-residuals, docs/lags-omgs.md#pinned-plan). ``min_k=1``: the small test
layers are selected, not sent whole under the default floor (docs/topk.md#density-floor)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hvd_commopt import Compression, run_ranks
from hvd_commopt.errors import ConfigError
from tests.unit.test_tuner import FAST, SLOW, SPECS, Clock, grads_for, make_engine, run_step, run_until_planned


def per_tensor(eng, key="residuals"):
    """Each tensor's slice of the reducer's per-bucket state, by tensor name."""
    sd = eng.reducer.state_dict()["memory"][key]
    out = {}
    for b in eng.buckets:
        if b.name in sd:
            flat = np.asarray(sd[b.name])
            for n, off, shp in zip(b.names, b.offsets, b.shapes):
                out[n] = flat[off:off + int(np.prod(shp))].copy()
    return out


@pytest.mark.parametrize("factory, key", [
    (lambda: Compression.topk(0.05, momentum_correction=False, min_k=1), "residuals"),
    (lambda: Compression.topk(0.05, min_k=1), "velocities"),
    (lambda: Compression.gtopk(0.05, momentum_correction=False, min_k=1), "residuals")])
def test_set_plan_moves_every_tensors_residual_exactly(factory, key):
    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "threshold", clock, compression=factory())
        for s in range(3):
            run_step(eng, clock, SLOW, grads_for(comm.rank, s))
        before = per_tensor(eng, key)
        old_names = [b.name for b in eng.buckets]
        eng.set_plan([[0, 1, 2], [3, 4, 5]])
        assert [b.name for b in eng.buckets] != old_names
        after = per_tensor(eng, key)
        assert sorted(after) == sorted(before)
        for n in before:
            np.testing.assert_array_equal(after[n], before[n])
        run_step(eng, clock, SLOW, grads_for(comm.rank, 9))  # trains on with the moved state
        return True
    assert all(run_ranks(2, body))


def test_omgs_replan_moves_the_residuals_bit_for_bit():
    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "mgwfbp", clock, compression=Compression.topk(0.05, momentum_correction=False, min_k=1),
                          select_s=1e-9)
        seen = []
        set_plan = eng.set_plan

        def spy(plan):
            before = per_tensor(eng)
            set_plan(plan)
            seen.append((before, per_tensor(eng)))
        eng.set_plan = spy
        run_until_planned(eng, clock, FAST, comm.rank)
        return eng.tuner.plans_made, seen, [len(b.names) for b in eng.buckets]
    (made, seen, sizes), _ = run_ranks(2, body)
    assert made == 1 and max(sizes) > 1 and len(seen) == 1  # FAST gradients: OMGS merged buckets
    before, after = seen[0]
    assert before and sorted(after) == sorted(before)
    for n in before:
        np.testing.assert_array_equal(after[n], before[n])


def test_pinned_plan_is_written_then_reused_without_profiling(tmp_path):
    path = str(tmp_path / "plan.json")

    def first(comm):
        clock = Clock()
        eng = make_engine(comm, "mgwfbp", clock, compression=Compression.topk(0.05, min_k=1), select_s=1e-9,
                          plan_file=path)
        run_until_planned(eng, clock, FAST, comm.rank)
        return eng.plan
    plan, _ = run_ranks(2, first)
    saved = json.load(open(path))
    assert saved["plan"] == plan and saved["names"] == [s.name for s in reversed(SPECS)]

    def second(comm):
        clock = Clock()
        eng = make_engine(comm, "mgwfbp", clock, compression=Compression.topk(0.05, min_k=1), select_s=1e-9,
                          plan_file=path)
        assert eng.plan == plan and eng.tuner.phase == "static"  # pinned from the first step
        run_step(eng, clock, SLOW, grads_for(comm.rank, 0))
        return eng.plan, eng.tuner.plans_made
    for p, made in run_ranks(2, second):
        assert p == plan and made == 0


def test_pinned_plan_for_another_model_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"names": ["x"], "plan": [[0]]}))

    def body(comm):
        make_engine(comm, "mgwfbp", Clock(), plan_file=str(path))
    with pytest.raises(ConfigError, match="other tensors"):
        run_ranks(2, body)


# -- momentum correction with an adapter that cannot switch the optimizer's momentum off (Keras) --
def test_host_without_momentum_switch_falls_back_or_refuses_with_the_fix():
    from hvd_commopt import run_ranks as rr
    from tests.unit.schedule_helpers import NumpyHost, init_params, make_engine as make_sched_engine, one_step
    from hvd_commopt import Schedule

    def body(comm, factory):
        host = NumpyHost(init_params(), momentum=0.9)  # no hyper_without_momentum, like Keras' host
        eng = make_sched_engine(comm, Schedule.sync(), host, compression=factory())
        one_step(eng, host, comm.rank, 0)
        return eng.reducer.memory.momentum
    # the default (correction not asked for): error feedback, the optimizer keeps its momentum
    assert rr(1, body, lambda: Compression.topk(0.5, min_k=1)) == [0.0]
    for factory in (lambda: Compression.topk(0.5, momentum_correction=True, min_k=1), lambda: Compression.dgc(0.5)):
        with pytest.raises(ConfigError, match="momentum=0"):
            rr(1, body, factory)
    # without momentum on the optimizer there is nothing to switch off
    def body0(comm):
        host = NumpyHost(init_params(), momentum=0.0)
        eng = make_sched_engine(comm, Schedule.sync(), host, compression=Compression.dgc(0.5, momentum=0.9))
        one_step(eng, host, comm.rank, 0)
        return eng.reducer.memory.momentum
    assert rr(1, body0) == [0.9]
