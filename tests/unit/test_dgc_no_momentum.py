"""DGC with no momentum anywhere warns once, naming the fix (docs/dgc.md#no-momentum); momentum
correction's μ = 0 (plain error feedback) and an explicit momentum do not."""
from __future__ import annotations

import warnings

import pytest

from hvd_commopt.memory.dgc import DGCMemory
from hvd_commopt.memory.momentum import MomentumCorrection


def _bind(mem, mu):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mem.bind_momentum(mu)
        mem._check_bound()  # as each round's compensate does: no second warning
    return [x for x in w if issubclass(x.category, RuntimeWarning)]


def test_zero_momentum_from_the_optimizer_warns_once_with_the_fix():
    w = _bind(DGCMemory(momentum=None), 0.0)
    assert len(w) == 1
    msg = str(w[0].message)
    assert "no momentum at all" in msg and "momentum=0.9" in msg and "SGD(..., momentum=0.9)" in msg
    assert "momentum=0.0" in msg  # how to say it is on purpose


@pytest.mark.parametrize("mem, mu", [(DGCMemory(momentum=None), 0.9), (MomentumCorrection(), 0.0),
                                     (MomentumCorrection(), 0.9)])
def test_no_warning_with_momentum_or_for_momentum_correction(mem, mu):
    assert _bind(mem, mu) == []


def test_explicit_momentum_never_warns():
    for mu in (0.0, 0.9):
        mem = DGCMemory(momentum=mu)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mem._check_bound()
