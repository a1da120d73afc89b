"""The trial keeps the decision against an alternative measured faster by no more than
TRIAL_MARGIN (docs/auto-compression.md#trial-margin); one faster by more replaces it."""
from __future__ import annotations

from hvd_commopt import run_ranks
from hvd_commopt.autocompress.trial import TRIAL_MARGIN
from tests.unit.test_autocompress_trial import STEPS, TRIAL, assert_decision_back, dense_alternative, run  # noqa: F401


def test_the_margin_is_five_percent():
    assert TRIAL_MARGIN == 0.05


def test_an_alternative_within_the_margin_leaves_the_decision(dense_alternative):  # noqa: F811
    assert_decision_back(0.097)  # dense 97 ms a step against the decision's 100 ms: 3 % faster, within the margin


def test_an_alternative_beyond_the_margin_is_kept(dense_alternative):  # noqa: F811
    # dense 94 ms: 6 % faster than the decision's 100 ms
    (k0, phase, rep), _ = run_ranks(2, lambda c: run(c, 0.094, 0.1, STEPS + 2 * TRIAL))
    assert k0[STEPS - 1:STEPS - 1 + TRIAL] == [["none"]] * TRIAL and k0[-1] == ["none"]
    assert phase == "watch" and rep["trial"].startswith("kept none x3 at 94 ms (tried none x3: 94 ms;")
