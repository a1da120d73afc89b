"""Sparse compression under an adaptive optimizer (docs/adaptive-optimizers.md): DGC's exponential
density warm-up per step (exact counts), the selector's k under it, and what attaching an adaptive
optimizer changes (warm-up set unless one is, no momentum correction, DGC's own momentum warned)."""
from __future__ import annotations

import math
import warnings

import pytest

from hvd_commopt import Compression
from hvd_commopt.compress.topk import TopKSelector
from hvd_commopt.compress.warmup import DensityWarmup
from hvd_commopt.errors import ConfigError
from hvd_commopt.host import ADAPTIVE, OptimizerFamily
from hvd_commopt.reduce.adaptive import ADAPTIVE_WARMUP_STEPS, adapt_to_optimizer, is_adaptive
from hvd_commopt.memory.dgc import DGCMemory
from hvd_commopt.memory.error_feedback import ErrorFeedback
from hvd_commopt.memory.momentum import MomentumCorrection
from hvd_commopt.reduce.momentum import bind_momentum_memory


class Host:
    """A weight-holding host whose optimizer is of ``family`` and has no momentum (Adam)."""

    holds_weights = True

    def __init__(self, family: str, momentum: float = 0.0):
        self.family, self.momentum = family, momentum

    def optimizer_family(self) -> str:
        return self.family

    def param_hyper(self, name, key, default=None):
        return self.momentum if key == "momentum" else default


class NoFamilyHost(Host):
    optimizer_family = None  # type: ignore[assignment]  # a host that does not implement the seam


def test_dense_warmup_sends_everything_then_the_density():
    w = DensityWarmup(3)
    assert [w.k(10, 1000, s) for s in range(5)] == [1000, 1000, 1000, 10, 10]
    assert w.density(0.01, 2) == 1.0 and w.density(0.01, 3) == 0.01


def test_exponential_warmup_counts_follow_dgc_schedule_per_step():
    w = DensityWarmup(4, exponential=True)  # r^((s+1)/5) with r = 0.01: 0.398, 0.158, 0.0631, 0.0251, then 0.01
    assert [w.k(10, 1000, s) for s in range(7)] == [399, 159, 64, 26, 10, 10, 10]
    assert w.density(0.01, 0) == 0.01 ** 0.2 and w.density(0.01, 4) == 0.01
    assert w.k(1000, 1000, 0) == 1000 and w.k(0, 0, 0) == 0


def test_warmup_never_sends_fewer_than_the_selector_and_reaches_dense():
    w = DensityWarmup(1000, exponential=True)
    assert w.k(500, 1000, 0) == 1000  # 0.5 ** (1/1001) * 1000 rounds up to all of it: dense
    for s in range(0, 1000, 37):
        assert 10 <= w.k(10, 1000, s) <= 1000
        assert w.k(10, 1000, s) == min(max(10, math.ceil(1000 * 0.01 ** ((s + 1) / 1001))), 1000)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "100"])
def test_warmup_length_is_checked(bad):
    with pytest.raises(ConfigError, match="whole number of optimizer steps"):
        DensityWarmup(bad)
    with pytest.raises(ConfigError, match="exponential must be True"):
        DensityWarmup(5, exponential=1)  # type: ignore[arg-type]


def test_selector_k_under_warmup():
    sel = TopKSelector(0.01, min_k=1)
    assert sel.k_for(1000, None, 0) == 10
    sel.warmup = DensityWarmup(4, exponential=True)
    assert [sel.k_for(1000, None, s) for s in range(5)] == [399, 159, 64, 26, 10]
    sel.warmup = DensityWarmup(2)
    assert [sel.k_for(1000, None, s) for s in range(3)] == [1000, 1000, 10]


def test_the_seam_is_a_protocol():
    assert isinstance(Host(ADAPTIVE), OptimizerFamily)
    assert is_adaptive(Host(ADAPTIVE)) and not is_adaptive(Host("sgd")) and not is_adaptive(object())


@pytest.mark.parametrize("make", [lambda: Compression.topk(0.01), lambda: Compression.gtopk(0.01),
                                  lambda: Compression.oktopk(0.01), lambda: Compression.randomk(0.3),
                                  lambda: Compression.dgc(0.01)])
def test_adaptive_optimizer_gets_the_warmup(make):
    red = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning under Adam (random-k's momentum warning included)
        bind_momentum_memory(red.memory, Host(ADAPTIVE), ["w"], red.compressor)
    assert isinstance(red.compressor.warmup, DensityWarmup)
    assert red.compressor.warmup.steps == ADAPTIVE_WARMUP_STEPS
    red = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # DGC / random-k under plain SGD: not this test's
        bind_momentum_memory(red.memory, Host("sgd"), ["w"], red.compressor)
    assert red.compressor.warmup is None


def test_a_chosen_warmup_is_kept():
    red = Compression.topk(0.01)
    red.compressor.warmup = DensityWarmup(7)
    bind_momentum_memory(red.memory, Host(ADAPTIVE), ["w"], red.compressor)
    assert red.compressor.warmup.steps == 7


def test_no_momentum_correction_and_no_dgc_warning_under_adam():
    for mem in (MomentumCorrection(auto=True), DGCMemory(momentum=None)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert bind_momentum_memory(mem, Host(ADAPTIVE), ["w"], TopKSelector(0.01)) is None
            mem._check_bound()
        assert mem.momentum == 0.0


def test_dgc_own_momentum_under_adam_warns_with_the_fix():
    with pytest.warns(RuntimeWarning, match=r"two momenta in series.*momentum=None"):
        adapt_to_optimizer(DGCMemory(momentum=0.9), TopKSelector(0.01), Host(ADAPTIVE))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapt_to_optimizer(DGCMemory(momentum=0.0), TopKSelector(0.01), Host(ADAPTIVE))
        adapt_to_optimizer(ErrorFeedback(), TopKSelector(0.01), Host(ADAPTIVE))


def test_low_density_randomk_under_adam_warns_with_the_fix():
    red = Compression.randomk(0.01)
    with pytest.warns(RuntimeWarning, match=r"random-k at density 0.01 under an adaptive.*Compression.topk"):
        bind_momentum_memory(red.memory, Host(ADAPTIVE), ["w"], red.compressor)
    assert isinstance(red.compressor.warmup, DensityWarmup)
