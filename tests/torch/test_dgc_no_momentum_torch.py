"""Compression.dgc() around an optimizer without momentum (the DGC paper's optimizer, momentum left
at None) warns once, at wrap time, naming the fix (docs/dgc.md#no-momentum); the set-ups with a
momentum somewhere, or an explicit momentum=0.0, do not."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402


def _warnings(compression, opt_momentum, steps=3):
    def body(comm):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt = hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=opt_momentum),
                                           named_parameters=m.named_parameters(), compression=compression(),
                                           communicator=comm)
            at_wrap = len(w)
            for _ in range(steps):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
                opt.step()
        return at_wrap, [str(x.message) for x in w if "no momentum at all" in str(x.message)]
    # one rank: warnings.catch_warnings is process-wide, in-process ranks would record each other's
    return run_ranks(1, body)


def test_dgc_without_any_momentum_warns_once_at_wrap():
    for at_wrap, msgs in _warnings(lambda: Compression.dgc(0.2), 0.0):
        assert len(msgs) == 1 and at_wrap >= 1
        assert "Compression.dgc(..., momentum=0.9)" in msgs[0]


@pytest.mark.parametrize("compression, opt_momentum", [
    (lambda: Compression.dgc(0.2), 0.9),                 # the optimizer's momentum, applied by DGC
    (lambda: Compression.dgc(0.2, momentum=0.9), 0.0),   # the paper's set-up, written out
    (lambda: Compression.dgc(0.2, momentum=0.0), 0.0),   # no momentum, on purpose
    (lambda: Compression.topk(0.2), 0.0),                # momentum correction with mu = 0: error feedback
])
def test_no_warning_when_momentum_is_set_somewhere_or_declined(compression, opt_momentum):
    for _, msgs in _warnings(compression, opt_momentum):
        assert msgs == []
