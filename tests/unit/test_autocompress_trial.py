"""compression="auto" measures the model's best uniform assignments after its decision, where
they differ, and keeps the fastest (docs/auto-compression.md#trial). A fake clock sets what each
assignment costs; the link model is fixed, the decision's alternative forced to dense fp32."""
from __future__ import annotations

import numpy as np
import pytest

import hvd_commopt.autocompress.policy as P
from hvd_commopt import build_engine, run_ranks
from hvd_commopt.autocompress import AutoOptions, AutoReducer
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.fusion.cost_model import AlphaBeta, CostModel
from hvd_commopt.numpy_ops import NumpyOps

# 400 KB buckets on a 10 MB/s link: the model sends them sparse
SLOW = CostModel(AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), ranks=2)
BIG = [TensorSpec(f"fc{i}.w", (100, 1000), "float32") for i in range(3)]
STEPS = 1 + 3 + 5 + 1 + 5  # first step, warm-up, profile, settle, measure (the decision)
TRIAL = 1 + 5  # settle, measure (the alternative)


@pytest.fixture
def dense_alternative(monkeypatch):
    """The link calibrates to SLOW (no cost model given, so the trial runs); the decision's
    alternative is dense fp32 everywhere."""
    monkeypatch.setattr(P, "calibrate", lambda *a, **k: SLOW)
    real = P.decide

    def decide(*a, **k):
        out = real(*a, **k)
        out["alternatives"] = [{b: "none" for b in out["assignment"]}]
        return out
    monkeypatch.setattr(P, "decide", decide)


def run(comm, dense_s, sparse_s, steps):
    return run_costed(comm, lambda i, dense: dense_s if dense else sparse_s, steps)


def run_costed(comm, cost, steps):
    """``steps`` steps, step i taking ``cost(i, dense)`` seconds on the fake clock (dense: every
    bucket sends fp32); the assignments after each step, the policy's phase and its report."""
    t = [0.0]
    red = AutoReducer(AutoOptions(period=1000, allow=("bf16", "topk")), clock=lambda: t[0])
    eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
    eng.register(BIG)
    rng = np.random.default_rng(comm.rank)
    kinds = []
    for i in range(steps):
        t[0] += cost(i, all(m.kind == "none" for m in red.assignment.values()))
        for n in eng.backward_names:
            eng.grad_ready(n, rng.standard_normal((100, 1000)).astype(np.float32))
        eng.reduce_step()
        kinds.append(sorted({m.kind for m in red.assignment.values()}))
    return kinds, red.policy.phase, red.policy.report


def test_a_faster_alternative_is_kept_and_its_step_stands_as_the_prediction(dense_alternative):
    # dense 90 ms a step, the sparse decision 100 ms: not slower by the margin (no revert), but slower
    res = run_ranks(2, lambda c: run(c, 0.09, 0.1, STEPS + 2 * TRIAL))
    (k0, phase, rep), (k1, _, rep1) = res
    assert k0 == k1
    sparse = k0[STEPS - 2]
    assert sparse != ["none"] and k0[STEPS - 1:STEPS - 1 + TRIAL] == [["none"]] * TRIAL  # sparse decided, dense tried
    assert k0[STEPS - 1 + TRIAL:STEPS - 1 + 2 * TRIAL] == [sparse] * TRIAL  # the decision measured again
    assert k0[-1] == ["none"]  # and dense kept
    assert "reverted" not in rep
    assert phase == "watch"
    assert rep["trial"] == "kept none x3 at 90 ms (tried none x3: 90 ms; topk@0.1 x3 again: 100 ms)"
    assert rep1["trial"] == rep["trial"]
    assert rep["predicted_s"] == rep["measured_s"] == pytest.approx(0.09)
    assert {b["method"] for b in rep["buckets"]} == {"none"}


def assert_decision_back(dense_s: float) -> None:
    """Dense fp32 tried at ``dense_s`` a step against the sparse decision's 100 ms, and the decision kept."""
    (k0, phase, rep), (k1, _, _) = run_ranks(2, lambda c: run(c, dense_s, 0.1, STEPS + TRIAL + 2))
    assert k0 == k1
    assert k0[STEPS - 1:STEPS - 1 + TRIAL] == [["none"]] * TRIAL  # tried ...
    assert k0[-1] == k0[STEPS - 2] != ["none"]  # ... and the decision back
    assert phase == "watch" and rep["trial"] == f"kept topk@0.1 x3 at 100 ms (tried none x3: {dense_s * 1000:.0f} ms)"
    assert rep["measured_s"] == pytest.approx(0.1)


def test_a_slower_alternative_gives_the_decision_back(dense_alternative):
    assert_decision_back(0.2)


def test_no_trial_with_a_given_cost_model(monkeypatch):
    real = P.decide
    monkeypatch.setattr(P, "decide", lambda *a, **k: dict(real(*a, **k), alternatives=[{f"b{i}": "none" for i in range(3)}]))

    def body(comm):
        red = run_with_given_model(comm)
        return red.policy.phase, red.policy.report
    for phase, rep in run_ranks(2, body):
        assert phase == "watch" and "trial" not in rep and "trying" not in rep


def run_with_given_model(comm) -> AutoReducer:
    """STEPS steps of 100 ms on the fake clock with the link model SLOW given; the reducer."""
    t = [0.0]
    red = AutoReducer(AutoOptions(cost_model=SLOW, period=1000, allow=("bf16", "topk")), clock=lambda: t[0])
    eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
    eng.register(BIG)
    for _ in range(STEPS):
        t[0] += 0.1
        for n in eng.backward_names:
            eng.grad_ready(n, np.ones((100, 1000), np.float32))
        eng.reduce_step()
    return red
