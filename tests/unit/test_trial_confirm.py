"""Before an alternative replaces the decision, the decision is measured once more, and the faster
of its two measurements is what the alternative must beat (docs/auto-compression.md#trial-confirm).
The fake clock of tests/unit/test_autocompress_trial.py sets each step's cost."""
from __future__ import annotations

import pytest

from hvd_commopt import run_ranks
from tests.unit.test_autocompress_trial import STEPS, TRIAL, dense_alternative, run_costed  # noqa: F401

FIRST_WINDOW = range(STEPS - 5, STEPS)  # the steps of the decision's first measurement


def test_a_decision_slowed_by_the_machine_is_kept_when_measured_again(dense_alternative):  # noqa: F811
    # the sparse decision costs 100 ms, but the machine adds 30 ms to every step of its first window;
    # dense fp32 costs 110 ms: faster than that window (130 ms), slower than the decision measured again
    def cost(i, dense):
        return 0.11 if dense else 0.1 + (0.03 if i in FIRST_WINDOW else 0.0)
    (k0, phase, rep), (k1, _, rep1) = run_ranks(2, lambda c: run_costed(c, cost, STEPS + 2 * TRIAL + 2))
    assert k0 == k1 and rep1["trial"] == rep["trial"]
    sparse = k0[STEPS - 2]
    assert sparse != ["none"]
    assert k0[STEPS - 1:STEPS - 1 + TRIAL] == [["none"]] * TRIAL  # dense tried ...
    assert k0[STEPS - 1 + TRIAL:] == [sparse] * (TRIAL + 3)  # ... the decision measured again, and kept
    assert phase == "watch"
    assert rep["trial"] == "kept topk@0.1 x3 at 100 ms (tried none x3: 110 ms; topk@0.1 x3 again: 100 ms)"
    assert rep["measured_s"] == pytest.approx(0.1)


def test_no_confirmation_when_the_decision_stays(dense_alternative):  # noqa: F811
    # dense slower: the decision is the fastest, nothing is measured again
    (k0, phase, rep), _ = run_ranks(2, lambda c: run_costed(c, lambda i, dense: 0.2 if dense else 0.1, STEPS + TRIAL + 2))
    assert k0[STEPS - 1 + TRIAL:] == [k0[STEPS - 2]] * 3
    assert phase == "watch" and "again" not in rep["trial"]
