"""compression="auto" times the candidates' compute on every rank at once, as the step runs every
rank's compression at once, and rank 0 decides from its own figures; each rank measures a layout
once (docs/auto-compression.md#costs-every-rank)."""
from __future__ import annotations

import threading

import hvd_commopt.autocompress.policy as P
from hvd_commopt import run_ranks

from tests.unit.test_autocompress_trial import run_with_given_model


def test_every_rank_measures_the_same_candidates_once_and_rank0_decides_from_its_own(monkeypatch):
    calls: list[tuple[str, tuple[str, ...], int]] = []
    lock = threading.Lock()
    real = P.measure_local_costs

    def spy(ops, like, methods, max_numel, *a, **k):
        with lock:
            calls.append((threading.current_thread().name, tuple(m.key for m in methods), max_numel))
        return real(ops, like, methods, max_numel, *a, repeats=1, passes=1, **k)
    monkeypatch.setattr(P, "measure_local_costs", spy)

    reports = run_ranks(2, lambda comm: run_with_given_model(comm).policy.report)  # the link model given
    # one measurement a rank (the step-0 decision and the profiled one share the layout)
    assert len(calls) == 2 and len({c[0] for c in calls}) == 2
    assert calls[0][1:] == calls[1][1:]
    assert set(calls[0][1]) == {"bf16"} | {k for k in calls[0][1] if k.startswith("topk")} and calls[0][2] == 100_000
    assert reports[0]["select_fits"] == reports[1]["select_fits"]  # rank 0's figures, broadcast
