"""``warmup_steps=`` on the sparse factories (docs/adaptive-optimizers.md#warmup-steps)."""
from __future__ import annotations

import pytest

from hvd_commopt import Compression, ConfigError
from hvd_commopt.compress.warmup import DensityWarmup
from hvd_commopt.host import ADAPTIVE
from hvd_commopt.reduce.adaptive import ADAPTIVE_WARMUP_STEPS
from hvd_commopt.reduce.momentum import bind_momentum_memory
from tests.unit.test_adaptive_optimizers import Host

FACTORIES = {"topk": Compression.topk, "gtopk": Compression.gtopk, "oktopk": Compression.oktopk,
             "randomk": Compression.randomk, "dgc": Compression.dgc}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_warmup_steps_sends_whole_buckets_then_the_density(name):
    red = FACTORIES[name](0.01, warmup_steps=3, min_k=1) if name != "dgc" else FACTORIES[name](0.01, warmup_steps=3)
    assert red.compressor.warmup.steps == 3 and not red.compressor.warmup.exponential
    k = red.compressor.k_for(1000, None, 3)
    assert [red.compressor.k_for(1000, None, s) for s in range(5)] == [1000, 1000, 1000, k, k]
    assert k == 10


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_default_is_none_under_sgd_and_the_adaptive_warmup_under_adam(name):
    red = FACTORIES[name](0.3)
    assert red.compressor.warmup is None
    bind_momentum_memory(red.memory, Host(ADAPTIVE), ["w"], red.compressor)
    assert red.compressor.warmup.steps == ADAPTIVE_WARMUP_STEPS


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_zero_is_no_warmup_even_under_adam_and_a_length_replaces_its_default(name):
    red = FACTORIES[name](0.3, warmup_steps=0)
    bind_momentum_memory(red.memory, Host(ADAPTIVE), ["w"], red.compressor)
    assert red.compressor.warmup.steps == 0
    assert red.compressor.k_for(1000, None, 0) == 300
    red = FACTORIES[name](0.3, warmup_steps=20)
    bind_momentum_memory(red.memory, Host(ADAPTIVE), ["w"], red.compressor)
    assert red.compressor.warmup.steps == 20
    assert [red.compressor.k_for(1000, None, s) for s in (19, 20)] == [1000, 300]


@pytest.mark.parametrize("bad", [-1, 2.5, True, "100"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_bad_warmup_steps_is_one_clear_error(name, bad):
    with pytest.raises(ConfigError, match=r"warmup_steps is a whole number of optimizer steps >= 0"):
        FACTORIES[name](0.01, warmup_steps=bad)


def test_dgc_takes_one_warmup():
    with pytest.raises(ConfigError, match=r"pass one warm-up: warmup_steps=5 .* warmup_epochs=4"):
        Compression.dgc(0.01, warmup_steps=5, warmup_epochs=4, steps_per_epoch=10)


def test_none_and_from_steps():
    assert DensityWarmup.from_steps(None) is None
    w = DensityWarmup.none()
    assert w.steps == 0 and [w.k(10, 1000, s) for s in range(3)] == [10, 10, 10]
    assert w.config() == {"warmup_steps": 0, "exponential": False}
    assert DensityWarmup.from_steps(7).steps == 7
