"""The wrap-time cross-rank check of the settings (docs/cross-rank-check.md#settings), with
in-process ranks: every rank raises the same RankMismatchError naming the setting and each rank's
value; equal settings pass. The same under real mpirun: tests/parallel/test_cross_rank.py."""
import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, Schedule, build_engine, run_ranks
from hvd_commopt.engine import TensorSpec
from hvd_commopt.engine.specs import Setting, verify_same_settings
from hvd_commopt.errors import RankMismatchError

SPECS = [TensorSpec("l1.w", (64, 32), "float32"), TensorSpec("l1.b", (64,), "float32"),
         TensorSpec("l2.w", (8, 64), "float32"), TensorSpec("l2.b", (8,), "float32")]


def _outcomes(size, make_kwargs):
    """Each rank builds an engine with make_kwargs(rank) and registers SPECS; returns what each
    rank raised (None: nothing)."""
    def body(comm):
        try:
            build_engine(comm, NumpyOps(), **make_kwargs(comm.rank)).register(SPECS)
        except RankMismatchError as e:
            return str(e)
        return None
    return run_ranks(size, body, timeout_s=20)


def _same_error_everywhere(outs):
    assert all(o is not None for o in outs), outs
    assert len(set(outs)) == 1, outs
    return outs[0]


def test_fusion_threshold_differing_is_refused_on_every_rank_with_each_value():
    msg = _same_error_everywhere(_outcomes(2, lambda r: {"fusion_threshold": 26214400 if r == 0 else 1024}))
    assert msg.startswith("fusion_threshold differs across ranks: rank 0: 26214400 (argument); "
                          "rank 1: 1024 (argument) (pass the same fusion_threshold= on every rank, or set "
                          "HVD_COMMOPT_FUSION_THRESHOLD"), msg
    assert "bucket plan" not in msg  # the plan follows from the threshold: not reported as well


def test_ranks_are_grouped_by_value_and_several_settings_are_all_named():
    msg = _same_error_everywhere(_outcomes(3, lambda r: {"fusion_threshold": 0 if r == 2 else 1024,
                                                         "op": "sum" if r == 2 else "average"}))
    assert "fusion_threshold differs across ranks: ranks 0, 1: 1024 (argument); rank 2: 0 (argument)" in msg
    assert "op differs across ranks: ranks 0, 1: 'average'; rank 2: 'sum'" in msg
    assert msg.startswith("the DistributedOptimizer is configured differently across ranks:")


@pytest.mark.parametrize("make, expect", [
    (lambda r: Compression.topk(0.01 if r == 0 else 0.001),
     "compression.compressor.density differs across ranks: rank 0: 0.01; rank 1: 0.001"),
    (lambda r: Compression.gtopk(0.01 if r == 0 else 0.02),  # gTop-k densities differing
     "compression.compressor.density differs across ranks: rank 0: 0.01; rank 1: 0.02"),
    (lambda r: Compression.randomk(0.01, seed=r),
     "compression.compressor.seed differs across ranks: rank 0: 0; rank 1: 1"),
    (lambda r: Compression.fp16 if r == 0 else Compression.none,
     "compression.compressor.name differs across ranks: rank 0: 'fp16'; rank 1: 'none'"),
    (lambda r: Compression.topk(0.01) if r == 0 else None,  # different kinds: the whole configs
     "compression differs across ranks: rank 0: {'reducer': 'sparse_allgather'"),
])
def test_compression_differing_names_the_field(make, expect):
    msg = _same_error_everywhere(_outcomes(2, lambda r: {"compression": make(r)}))
    assert msg.startswith(expect), msg
    assert "(pass the same compression= on every rank" in msg


def test_per_layer_density_callable_is_compared_by_the_k_it_gives():
    def density(r):
        return lambda name, numel: 0.5 if r == 1 and name.endswith("l1.w") else 0.1
    msg = _same_error_everywhere(_outcomes(2, lambda r: {"compression": Compression.topk(density(r)),
                                                         "fusion_threshold": 0}))
    # the biases share one bucket sent whole (docs/topk.md#dense-1d): k = its size on both ranks
    assert msg.startswith("compression k per bucket differs across ranks: rank 0: [51, 72, 204]; "
                          "rank 1: [51, 72, 1024]"), msg


def test_schedule_and_predivide_differing_backward_passes_may_differ():
    msg = _same_error_everywhere(_outcomes(2, lambda r: {"schedule": Schedule.ssd(delay=2 + r)}))
    assert msg.startswith("schedule.delay differs across ranks: rank 0: 2; rank 1: 3 (pass the same schedule="), msg
    msg = _same_error_everywhere(_outcomes(2, lambda r: {"gradient_predivide_factor": 1.0 + r}))
    assert msg.startswith("gradient_predivide_factor differs across ranks: rank 0: 1.0; rank 1: 2.0"), msg
    # accumulation may differ (one round per step either way): not refused
    assert _outcomes(2, lambda r: {"backward_passes_per_step": 1 + r}) == [None, None]


def test_planned_fusion_options_differing():
    msg = _same_error_everywhere(_outcomes(2, lambda r: {"fusion": "mgwfbp",
                                                         "fusion_options": {"profile_steps": 3 + r}}))
    assert msg.startswith("fusion_options.profile_steps differs across ranks: rank 0: 3; rank 1: 4"), msg


def test_explicit_plan_differing_is_the_bucket_plan():
    def body(comm):
        eng = build_engine(comm, NumpyOps())
        try:
            eng.register(SPECS, plan=[[0, 1, 2, 3]] if comm.rank == 0 else [[0, 1], [2, 3]])
        except RankMismatchError as e:
            return str(e)
    msg = _same_error_everywhere(run_ranks(2, body, timeout_s=20))
    assert msg.startswith("bucket plan differs across ranks: rank 0: [[0, 1, 2, 3]]; rank 1: [[0, 1], [2, 3]]"), msg


def test_equal_settings_pass_and_the_step_works():
    def body(comm):
        eng = build_engine(comm, NumpyOps(), compression=Compression.topk(0.1), fusion_threshold=1024)
        eng.register(SPECS)
        grads = {s.name: np.full(s.shape, comm.rank + 1.0, np.float32) for s in SPECS}
        for n in eng.backward_names:
            eng.grad_ready(n, grads[n].reshape(-1))
        return eng.reduce_step()
    a, b = run_ranks(2, body, timeout_s=20)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_verify_same_settings_is_free_at_size_one_and_compares_values_not_notes():
    run_ranks(1, lambda comm: verify_same_settings(comm, {"x": Setting(1)}))
    run_ranks(2, lambda comm: verify_same_settings(comm, {"x": Setting(7, "h", note=f"rank {comm.rank}")}))


def test_a_later_plan_that_differs_is_refused_before_use_on_every_rank():
    # docs/cross-rank-check.md#later-plans: the tuner's plan is broadcast by rank 0, so equal by
    # construction; the guard is exercised by handing each rank a different "new" plan.
    def body(comm):
        eng = build_engine(comm, NumpyOps(), fusion_threshold=0)
        eng.register(SPECS)
        before = eng.plan
        eng.tuner.step_end = lambda: [[0, 1, 2, 3]] if comm.rank == 0 else [[0, 1], [2, 3]]
        grads = {s.name: np.ones(s.shape, np.float32).reshape(-1) for s in SPECS}
        try:
            eng.reduce_step(grads)
        except RankMismatchError as e:
            return str(e), eng.plan == before
        return None, eng.plan == before
    outs = run_ranks(2, body, timeout_s=20)
    assert all(kept for _, kept in outs)  # the old plan stays in use
    msg = _same_error_everywhere([m for m, _ in outs])
    assert msg.startswith("bucket plan differs across ranks: rank 0: [[0, 1, 2, 3]]; rank 1: [[0, 1], [2, 3]] "
                          "(fusion='threshold' planned differently on some rank)"), msg

    def same(comm):  # an equal new plan is used
        eng = build_engine(comm, NumpyOps(), fusion_threshold=0)
        eng.register(SPECS)
        eng.tuner.step_end = lambda: [[0, 1], [2, 3]]
        eng.reduce_step({s.name: np.ones(s.shape, np.float32).reshape(-1) for s in SPECS})
        return eng.plan
    assert run_ranks(2, same, timeout_s=20) == [[[0, 1], [2, 3]]] * 2
