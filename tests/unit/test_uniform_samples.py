"""DGC's uniform samples by a counter hash (docs/dgc.md#uniform-samples): the statistics that make
them a uniform sample, exactly (fixed keys: the figures are deterministic), on NumPy; the torch
and TF adapters compute the same integers (tests/torch, tests/tf)."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt.compress.dgc import DGCSelector
from hvd_commopt.compress.sampling import KEYS_PER_HASH, PRIME, counter_hash, uniform_positions
from hvd_commopt.numpy_ops import NumpyOps

OPS = NumpyOps()
KEYS = [int(k) for k in np.random.default_rng(0).integers(0, PRIME, 2 * KEYS_PER_HASH)]


def _chi2(counts: np.ndarray, expected: float) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("n,count", [(10 ** 6, 10 ** 5), (25_000_000, 250_000), (3_000_000_007, 200_000),
                                     (2 ** 20, 2 ** 20), (12_345, 1_000)])
def test_positions_are_a_uniform_sample(n, count):
    """In range; 100 equal bins and the 400 bins of consecutive pairs within the 0.1 % tails of
    the chi-square (99 and 399 degrees of freedom: 148.2 and 482.1); the low four bits uniform
    (15 dof: 37.7); the duplicates those of draws with replacement (1 - n(1 - e^{-c/n})/c) within
    five standard deviations; consecutive samples uncorrelated."""
    p = uniform_positions(OPS, n, count, KEYS, None)
    assert p.dtype == np.int64 and p.shape == (count,) and p.min() >= 0 and p.max() < n
    bins = 100
    assert _chi2(np.bincount(p * bins // n, minlength=bins), count / bins) < 148.2
    x = np.minimum(p * 20 // n, 19)
    assert _chi2(np.bincount(x[:-1] * 20 + x[1:], minlength=400), (count - 1) / 400) < 482.1
    assert _chi2(np.bincount(p % 16, minlength=16), count / 16) < 37.7
    expected = 1 - n * (1 - np.exp(-count / n)) / count
    dup = 1 - np.unique(p).size / count
    assert abs(dup - expected) < 5 * np.sqrt(max(expected, 1 / count) / count) + 1e-4
    assert abs(np.corrcoef(p[:-1] / n, p[1:] / n)[0, 1]) < 5 / np.sqrt(count)


def test_the_two_hashes_and_other_keys_are_independent():
    i = OPS.arange(200_000)
    a = counter_hash(OPS, i, KEYS[:KEYS_PER_HASH])
    b = counter_hash(OPS, i, KEYS[KEYS_PER_HASH:])
    c = counter_hash(OPS, i, [k + 1 for k in KEYS[:KEYS_PER_HASH]])  # keys one apart
    for u, v in ((a, b), (a, c)):
        assert abs(np.corrcoef(u, v)[0, 1]) < 5 / np.sqrt(i.size)
    assert a.min() >= 0 and a.max() < PRIME


def test_pinned_values():
    """The draw is part of a run's reproducibility: these values change only on purpose."""
    assert uniform_positions(OPS, 10 ** 6, 6, list(range(1, 11)), None).tolist() == PINNED


PINNED = [92970, 3974, 555209, 677184, 368183, 339068]


def test_selector_draws_uniform_or_strided_positions():
    """The selector's positions: uniform ones with (seed, bucket, step) keys, different per step
    and bucket, the same for the same triple; strided ones from a random start."""
    c = DGCSelector(0.01, strided_sample=False)
    n, stride, num = 100_000, 97, 1_030
    a = c.sample_positions(OPS, n, stride, num, "b0", 3, None)
    assert a.shape == (num,) and np.array_equal(a, c.sample_positions(OPS, n, stride, num, "b0", 3, None))
    assert not np.array_equal(a, c.sample_positions(OPS, n, stride, num, "b0", 4, None))
    assert not np.array_equal(a, c.sample_positions(OPS, n, stride, num, "b1", 3, None))
    s = DGCSelector(0.01).sample_positions(OPS, n, stride, num, "b0", 3, None)
    assert 0 <= s[0] < stride and np.array_equal(np.diff(s), np.full(s.size - 1, stride)) and s[-1] + stride >= n
