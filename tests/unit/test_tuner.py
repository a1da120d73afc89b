"""fusion="mgwfbp"/"optimal"/"auto": profile -> calibrate -> plan on rank 0 -> broadcast.

In-process ranks (run_ranks) with NumpyOps; a fake clock per rank wherever timing matters, so
the profiles (and what each rank would plan from its own) are chosen by the test.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, Schedule, build_engine, run_ranks
from hvd_commopt.engine import TensorSpec
from hvd_commopt.engine.profiler import StepProfiler
from hvd_commopt.engine.tuner import FusionOptions, FusionTuner, format_report
from hvd_commopt.errors import ConfigError
from hvd_commopt.fusion import AlphaBeta, CostModel, plan_mgwfbp, plan_bucket_cap, plan_optimal, plan_threshold, simulate

NUMEL = [300, 20, 1000, 10, 500, 40]            # registration (forward) order
SPECS = [TensorSpec(f"l{i}.w", (n, 1), "float32") for i, n in enumerate(NUMEL)]  # 2-D: sparse reducers select them
BWD_SIZES = [4 * n for n in reversed(NUMEL)]     # backward order, bytes
COST = CostModel(AlphaBeta(1e-3, 1e-9), AlphaBeta(1e-3, 2e-9), AlphaBeta(5e-4, 1e-9), ranks=2)
SLOW = [0.01] * len(SPECS)                       # 10 ms between gradients: nothing to merge
FAST = [1e-5] * len(SPECS)                       # 10 us between gradients: merge everything
FWD = 0.004


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def grads_for(rank: int, step: int, specs=SPECS) -> dict:
    rng = np.random.default_rng(1000 * rank + step)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in specs}


def make_engine(comm, fusion, clock=None, specs=SPECS, threshold=0, compression=None, **options):
    opts = dict(warmup_steps=1, profile_steps=3, measure_steps=2, cost_model=COST)
    opts.update(options)
    eng = build_engine(comm, NumpyOps(), fusion=fusion, fusion_threshold=threshold, compression=compression,
                     fusion_options=opts)
    if clock is not None:
        eng.tuner.clock = clock
    eng.register(specs)
    return eng


def run_step(eng, clock, tb, grads, fwd=FWD):
    """One step on the fake clock: forward, then gradients in backward order tb apart."""
    clock.t += fwd
    for name, dt in zip(eng.backward_names, tb):
        clock.t += dt
        eng.grad_ready(name, grads[name])
    return eng.reduce_step()


def run_until_planned(eng, clock, tb, rank, extra=0):
    n = eng.tuner.options.warmup_steps + eng.tuner.options.profile_steps + extra
    for s in range(n):
        run_step(eng, clock, tb, grads_for(rank, s, [eng.engine._specs[nm] for nm in eng.names]))


# -- profiler -----------------------------------------------------------------------------------
def test_profiler_derives_backward_times_in_backward_order():
    clock = Clock()
    prof = StepProfiler(["c", "b", "a"], [4, 8, 12], clock)
    prof.boundary()  # end of the step before: t0
    for arrivals, end in [({"c": 1.0, "b": 3.0, "a": 6.0}, 7.0), ({"c": 1.2, "b": 3.2, "a": 6.6}, 7.5),
                          ({"c": 0.8, "b": 2.8, "a": 5.8}, 6.9)]:
        t0 = clock.t
        for name, t in arrivals.items():
            clock.t = t0 + t
            prof.arrived(name)
        clock.t = t0 + end
        prof.boundary()
    p = prof.profile()
    assert p.steps == 3 and p.names == ("c", "b", "a") and p.sizes_bytes == (4, 8, 12)
    assert p.forward_s == pytest.approx(1.0)
    assert p.backward_times == pytest.approx((0.0, 2.0, 3.0))
    assert p.period_s == pytest.approx(7.0)
    assert (p.out_of_order, p.missing) == (0, 0)
    assert p.to_json()["tensors"][2] == {"name": "a", "bytes": 12, "backward_s": pytest.approx(3.0)}


def test_profiler_out_of_order_and_missing_gradients():
    clock = Clock()
    prof = StepProfiler(["c", "b", "a", "z"], [4, 4, 4, 4], clock)
    prof.boundary()
    t0 = clock.t
    for name, t in [("b", 3.0), ("c", 5.0), ("a", 6.0)]:  # b before c; z never arrives
        clock.t = t0 + t
        prof.arrived(name)
    clock.t = t0 + 8.0
    prof.boundary()
    p = prof.profile()
    # effective ready = running max in backward order: c 5, b 5, a 6, z (missing: last arrival) 6
    assert p.forward_s == pytest.approx(3.0)
    assert p.backward_times == pytest.approx((2.0, 0.0, 1.0, 0.0))
    assert (p.out_of_order, p.missing) == (1, 1)


def test_profiler_needs_a_recorded_step():
    prof = StepProfiler(["a"], [4])
    prof.boundary()
    with pytest.raises(ValueError, match="no profiled step"):
        prof.profile()


# -- the plan is rank 0's, on every rank (T-MG-6 in-process) ---------------------------------------
@pytest.mark.parametrize("rank0_tb, other_tb", [(SLOW, FAST), (FAST, SLOW)])
def test_plan_identical_on_all_ranks_although_profiles_differ(rank0_tb, other_tb):
    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "mgwfbp", clock)
        tb = rank0_tb if comm.rank == 0 else other_tb
        run_until_planned(eng, clock, tb, comm.rank)
        own = eng.tuner._profiler.profile()   # what this rank would have planned from alone
        return eng.plan, [list(b.names) for b in eng.buckets], eng.fusion_report, own
    out = run_ranks(3, body)
    plans = [o[0] for o in out]
    assert plans[0] == plans[1] == plans[2]
    assert out[0][1] == out[1][1] == out[2][1]
    # the plan is MG-WFBP's on rank 0's profile (first tb folded into forward_s, see profiler)
    tb0 = [0.0] + list(rank0_tb[1:])
    assert plans[0] == plan_mgwfbp(BWD_SIZES, tb0, COST.allreduce)
    own1 = out[1][3]
    assert plan_mgwfbp(BWD_SIZES, list(own1.backward_times), COST.allreduce) != plans[0]  # meaningful
    assert len(plans[0]) == (len(SPECS) if rank0_tb is SLOW else 1)
    rep = out[0][2]
    assert rep["chosen"] == "mgwfbp" and rep["buckets"] == len(plans[0]) and rep["phase"] == "settle"
    assert sum(rep["bucket_bytes"]) == sum(BWD_SIZES)


def test_report_predicted_matches_simulator_and_measured_is_the_median_period():
    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "optimal", clock, measure_steps=3)
        run_until_planned(eng, clock, SLOW, comm.rank, extra=4)  # settle + 3 measured
        return eng.fusion_report, eng.plan
    rep, plan = run_ranks(2, body)[0]
    tb = [0.0] + SLOW[1:]
    fwd = FWD + SLOW[0]
    assert plan == plan_optimal(BWD_SIZES, tb, COST.allreduce)
    sim = simulate(plan, BWD_SIZES, tb, COST.allreduce, forward_time=fwd)
    assert rep["predicted_s"] == pytest.approx(sim.iteration_time)
    assert rep["non_overlapped_comm_s"] == pytest.approx(sim.non_overlapped_comm)
    period = FWD + sum(SLOW)  # the fake clock does not advance while communicating
    assert rep["measured_s"] == pytest.approx(period) and rep["measured_steps"] == 3
    assert rep["prediction_error"] == pytest.approx(sim.iteration_time / period - 1)
    assert rep["threshold"]["measured_s"] == pytest.approx(period)
    assert rep["threshold"]["buckets"] == len(SPECS)  # fusion_threshold=0 while profiling
    assert rep["phase"] == "done" and rep["profile"]["steps"] == 3
    assert rep["cost_model"] == COST.to_dict()


def test_auto_keeps_the_fastest_candidate():
    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "auto", clock, threshold=2000)
        run_until_planned(eng, clock, FAST, comm.rank)
        return eng.fusion_report, eng.plan
    (rep, plan), (rep1, plan1) = run_ranks(2, body)
    assert plan == plan1
    cands = rep["candidates_s"]
    assert set(cands) == {"per_tensor", "single", "threshold", "mgwfbp", "optimal"}
    assert cands[rep["chosen"]] == min(cands.values())
    assert rep["predicted_s"] == cands[rep["chosen"]]


# -- re-planning --------------------------------------------------------------------------------
def test_replans_when_the_tensor_set_changes_and_keeps_the_plan_otherwise():
    specs2 = SPECS[:4] + [TensorSpec("extra.w", (64,), "float32")]

    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "mgwfbp", clock)
        run_until_planned(eng, clock, FAST, comm.rank)
        first = eng.plan
        assert eng.tuner.plans_made == 1
        eng.register(SPECS)  # same set: same plan, no new profiling
        assert eng.plan == first and eng.tuner.phase == "settle"
        eng.register(specs2)  # new set: back to the threshold plan, profile again
        rep = eng.fusion_report
        assert rep["phase"] == "warmup" and rep["chosen"] == "threshold" and "predicted_s" not in rep
        assert eng.plan == plan_threshold([s.nbytes for s in reversed(specs2)], 0)
        run_until_planned(eng, clock, SLOW if comm.rank == 0 else FAST, comm.rank)
        return first, eng.plan, eng.tuner.plans_made, [list(b.names) for b in eng.buckets]
    out = run_ranks(2, body)
    assert out[0] == out[1]
    first, second, made, names = out[0]
    assert made == 2 and len(first) == 1 and len(second) == len(specs2)
    assert sorted(n for b in names for n in b) == sorted(s.name for s in specs2)


# -- correctness of planned bucketing (T-MG-5) ----------------------------------------------------
@pytest.mark.parametrize("size", [2, 3])
def test_planned_buckets_unpack_to_per_tensor_allreduce_results(size):
    big_alpha = CostModel(AlphaBeta(0.5, 1e-9), AlphaBeta(0.5, 1e-9), ranks=size)

    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "optimal", clock, cost_model=big_alpha)
        run_until_planned(eng, clock, SLOW, comm.rank)
        assert len(eng.buckets) == 1 and eng.tuner.plans_made == 1  # planned, merged
        grads = grads_for(comm.rank, 99)
        out = {k: v.copy() for k, v in run_step(eng, clock, SLOW, grads).items()}
        ref = {}
        for s in SPECS:  # one allreduce per tensor
            buf = grads[s.name].reshape(-1).copy()
            ref[s.name] = comm.allreduce_(buf, name=f"ref.{s.name}").reshape(s.shape) / comm.size
        return out, ref
    for out, ref in run_ranks(size, body):
        for s in SPECS:
            assert out[s.name].shape == s.shape
            if size == 2:  # two summands: the reduction order cannot differ
                np.testing.assert_array_equal(out[s.name], ref[s.name])
            else:
                np.testing.assert_allclose(out[s.name], ref[s.name], rtol=1e-6, atol=1e-7)


# -- sparse reducers (OMGS) and cost models --------------------------------------------------------
def test_sparse_topk_uses_omgs_and_the_compressed_cost():
    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "mgwfbp", clock, compression=Compression.topk(0.05), select_s=1e-9)
        run_until_planned(eng, clock, SLOW if comm.rank else FAST, comm.rank)
        run_step(eng, clock, SLOW, grads_for(comm.rank, 50))  # trains on with the new buckets
        return eng.plan, eng.fusion_report
    (p0, rep), (p1, _) = run_ranks(2, body)
    assert p0 == p1
    assert rep["chosen"] == "omgs" and "top-k" in rep["comm"] and rep["select_s"] == 1e-9


def test_gtopk_without_p2p_fit_fails_on_every_rank():
    no_p2p = CostModel(AlphaBeta(1e-3, 1e-9), AlphaBeta(1e-3, 1e-9), None, ranks=2)

    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "optimal", clock, compression=Compression.gtopk(0.05), cost_model=no_p2p,
                          select_s=0.0)
        try:
            run_until_planned(eng, clock, FAST, comm.rank)
        except ConfigError as e:
            return str(e), eng.tuner.phase
        return None
    for msg, phase in run_ranks(2, body):
        assert "planning failed on rank 0" in msg and "point-to-point" in msg and phase == "static"


def test_per_layer_density_is_refused_up_front():
    with pytest.raises(ConfigError, match="per-layer densities"):
        run_ranks(1, lambda c: make_engine(c, "auto", compression=Compression.topk({"default": 0.1})))


def test_cost_model_from_json_file_and_unreadable_file(tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(COST.to_dict()))

    def body(comm, where):
        clock = Clock()
        eng = make_engine(comm, "mgwfbp", clock, cost_model=where)
        try:
            run_until_planned(eng, clock, FAST, comm.rank)
        except ConfigError as e:
            return "error", str(e)
        return "ok", eng.fusion_report["cost_model"]
    assert run_ranks(2, body, str(path)) == [("ok", COST.to_dict())] * 2
    out = run_ranks(2, body, str(tmp_path / "missing.json"))
    assert all(kind == "error" and "missing.json" in msg for kind, msg in out)


def test_calibrates_when_no_cost_model_is_given():
    def body(comm):
        eng = make_engine(comm, "auto", cost_model=None, calibrate={"sizes": [4096, 16384], "repeats": 2,
                                                                   "warmup": 1})
        run_until_planned(eng, Clock(), FAST, comm.rank)  # real clock inside: mechanics only
        return eng.plan, eng.fusion_report["cost_model"], eng.tuner.cost_model.to_dict()
    out = run_ranks(2, body)
    assert out[0][0] == out[1][0]
    assert out[0][1]["ranks"] == 2 and out[0][2] == out[1][2]  # calibrated once, fit broadcast


# -- reporting ------------------------------------------------------------------------------------
def test_verbose_prints_once_on_rank_0():
    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "optimal", clock, verbose=True)
        lines = []
        eng.tuner.log = lines.append
        run_until_planned(eng, clock, SLOW, comm.rank, extra=6)
        return lines
    lines0, lines1 = run_ranks(2, body)
    assert lines1 == [] and len(lines0) == 1
    assert "strategy=optimal -> optimal" in lines0[0] and "measured" in lines0[0]


def test_verbose_from_environment(monkeypatch, capsys):
    monkeypatch.setenv("HVD_COMMOPT_VERBOSE", "1")

    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "mgwfbp", clock, measure_steps=0)
        run_until_planned(eng, clock, SLOW, comm.rank)
        return eng.fusion_report["phase"]
    assert run_ranks(1, body) == ["done"]
    assert capsys.readouterr().out.count("hvd_commopt fusion: strategy=mgwfbp") == 1


def test_static_strategies_and_argument_checks():
    def body(comm):
        none = make_engine(comm, "none")
        thr = make_engine(comm, "threshold", threshold=1300)
        return none.plan, none.fusion_report, thr.plan, thr.tuner.phase
    none_plan, rep, thr_plan, phase = run_ranks(1, body)[0]
    assert none_plan == [[i] for i in range(len(SPECS))] and rep["buckets"] == len(SPECS)
    assert thr_plan == plan_bucket_cap(BWD_SIZES, 1300, first_bytes=1 << 20) and phase == "static"
    with pytest.raises(ConfigError, match="fusion must be one of"):
        run_ranks(1, lambda c: make_engine(c, "greedy"))
    with pytest.raises(ConfigError, match="unknown fusion option"):
        FusionOptions.coerce({"profile_step": 3})
    with pytest.raises(ConfigError, match="profile_steps >= 1"):
        FusionOptions(profile_steps=0)
    with pytest.raises(ConfigError, match="synchronous"):
        run_ranks(1, lambda c: build_engine(c, NumpyOps(), fusion="auto", schedule=Schedule.od()))
    assert FusionOptions.coerce(FusionOptions(profile_steps=4), verbose=True) == FusionOptions(profile_steps=4,
                                                                                              verbose=True)
    assert "bucket" in format_report(rep)


def test_single_rank_plans_without_calibrating():
    def body(comm):
        clock = Clock()
        eng = make_engine(comm, "mgwfbp", clock, cost_model=None)
        run_until_planned(eng, clock, SLOW, 0)
        return eng.tuner.cost_model.to_dict(), eng.plan
    cm, plan = run_ranks(1, body)[0]
    assert cm["ranks"] == 1 and cm["allreduce"] == {"alpha": 0.0, "beta": 0.0}
    assert plan == [[i] for i in range(len(SPECS))]


def test_tuner_alone_is_framework_free_and_counts_steps():
    class OneRank:
        rank, size, buffer_kind = 0, 1, "numpy"

        def broadcast_object(self, obj, root=0, name=""):
            return obj
    clock = Clock()
    t = FusionTuner("optimal", OneRank(), threshold_bytes=0, options={"warmup_steps": 0, "profile_steps": 2,
                                                                      "measure_steps": 1, "cost_model": COST},
                    clock=clock)
    assert t.initial_plan(["b", "a"], [8, 8]) == [[0], [1]] and t.phase == "profile"
    plans = []
    for step in range(4):
        clock.t += 1.0
        t.grad_ready("b")
        clock.t += 1.0
        t.grad_ready("a")
        plans.append(t.step_end())
    # step 1: no start time yet; steps 2-3 recorded -> plan; step 4 settles
    assert plans[:2] == [None, None] and plans[2] is not None and plans[3] is None
    assert t.phase == "measure" and t.profile.steps == 2
