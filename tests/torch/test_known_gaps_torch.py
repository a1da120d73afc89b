"""Wrapping a torch optimizer warns once for a combination measured short of the target
(docs/convergence-matrix.md#warnings): a sparse compression and CoCoD-SGD under SGD with momentum."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, Schedule, run_ranks  # noqa: E402
from hvd_commopt.reduce import known_gaps  # noqa: E402
from hvd_commopt.reduce.known_gaps import MeasuredGapWarning  # noqa: E402


def wrap_warnings(momentum, adamw=False, **kw):
    def body(comm):
        known_gaps._warned.clear()
        m = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3) if adamw else \
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            hco.DistributedOptimizer(opt,
                                     named_parameters=m.named_parameters(), communicator=comm, **kw)
        known_gaps._warned.clear()
        return [str(x.message) for x in w if issubclass(x.category, MeasuredGapWarning)]
    return run_ranks(1, body)[0]  # one rank: warnings.catch_warnings is process-wide


def test_topk_and_cocod_under_momentum_sgd_warn_once_each():
    msgs = wrap_warnings(0.9, compression=Compression.topk(0.01))
    assert len(msgs) == 1 and msgs[0].startswith("Compression.topk at density 0.01 under SGD with momentum")
    msgs = wrap_warnings(0.9, schedule=Schedule.cocod(4))
    assert len(msgs) == 1 and msgs[0].startswith("Schedule.cocod under SGD with momentum")


def test_plain_sgd_and_dense_do_not_warn():
    assert wrap_warnings(0.0, compression=Compression.topk(0.01)) == []
    assert wrap_warnings(0.9) == []
    assert wrap_warnings(0.0, schedule=Schedule.local_sgd(4)) == []  # SGD without momentum: not measured


@pytest.mark.parametrize("make", [lambda: Schedule.od(), lambda: Schedule.ssd(), lambda: Schedule.cd(batch_size=16),
                                  lambda: Schedule.local_sgd(4)])
def test_every_schedule_measured_short_warns_at_wrap_time(make):
    sched = make()
    msgs = wrap_warnings(0.9, schedule=sched)
    assert len(msgs) == 1 and msgs[0].startswith(f"Schedule.{sched.kind} under SGD with momentum")
    msgs = wrap_warnings(0.0, adamw=True, schedule=make())
    assert len(msgs) == 1 and msgs[0].startswith(f"Schedule.{sched.kind} under an adaptive optimizer")


def test_local_sgd_under_adamw_warns_and_names_diloco():
    msgs = wrap_warnings(0.0, adamw=True, schedule=Schedule.local_sgd(50))
    assert len(msgs) == 1 and msgs[0].startswith("Schedule.local_sgd under an adaptive optimizer")
    assert "Schedule.diloco(50, outer_lr=1.0, outer_momentum=0.5)" in msgs[0]
    assert wrap_warnings(0.0, adamw=True, schedule=Schedule.diloco(50)) == []  # not measured short at 2 ranks
