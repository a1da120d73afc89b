"""The compute each candidate of compression="auto" adds, measured on this machine
(docs/auto-compression.md#model, docs/auto-compression.md#interleaved-costs): a fake clock that
each candidate's round advances by a known cost, so the fits are the costs themselves."""
from __future__ import annotations

import pytest

from hvd_commopt.autocompress import Method
from hvd_commopt.autocompress.local_cost import measure_local_costs, probe_sizes
from hvd_commopt.numpy_ops import NumpyOps

# seconds per round: c0 + s·x for x elements (dense fp32 is the base that is subtracted)
COST = {"none": (1e-4, 1e-9), "bf16": (2e-4, 2e-9), "topk@0.01": (5e-4, 3e-9), "dgc@0.01": (9e-4, 5e-9)}
MAX = 3_000_000


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _build(clock, calls, slow=None):
    """A reducer per method whose round advances the clock by COST; ``slow(key, n, r)`` adds a
    burst of load to some rounds."""

    class Fake:
        def __init__(self, m):
            self.m = m

        def reduce(self, bucket, rnd, buf, ctx):
            n = bucket.numel
            calls.append((self.m.key, n, rnd.step))
            c0, s = COST[self.m.key]
            clock.now += c0 + s * n + (slow(self.m.key, n, rnd.step) if slow else 0.0)
            return buf

    return lambda m, mem: Fake(m)


METHODS = [Method("bf16"), Method("topk", 0.01), Method("dgc", 0.01)]


def test_the_fits_are_each_methods_cost_over_dense():
    clock, calls = _Clock(), []
    fits = measure_local_costs(NumpyOps(), None, METHODS, MAX, 0.9, False, _build(clock, calls), clock=clock)
    assert set(fits) == {"bf16", "topk@0.01", "dgc@0.01"}
    for key, (s, c0) in fits.items():
        assert s == pytest.approx(COST[key][1] - COST["none"][1], rel=1e-9)
        assert c0 == pytest.approx(COST[key][0] - COST["none"][0], rel=1e-9)


def test_candidates_are_timed_interleaved_repeat_by_repeat():
    clock, calls = _Clock(), []
    measure_local_costs(NumpyOps(), None, METHODS, MAX, 0.9, False, _build(clock, calls), clock=clock, repeats=2,
                        passes=2)
    sizes = probe_sizes(MAX)
    keys = ["none", "bf16", "topk@0.01", "dgc@0.01"]
    first = [(k, n, r) for n in sizes for r in range(3) for k in keys]  # a round to allocate, then 2 timed
    second = [(k, n, 3 + r) for n in sizes for r in range(2) for k in keys]  # the second pass: 2 timed
    assert calls == first + second


def test_a_burst_of_load_over_consecutive_rounds_is_dropped():
    # timed one method after another, a burst over consecutive rounds covered every repeat of one
    # method at one size and became its cost; interleaved, the same burst covers at most one repeat
    # of each method, and each keeps its fastest repeat
    clock, calls = _Clock(), []
    burst = lambda key, n, r: 0.05 if 10 <= len(calls) < 14 else 0.0  # noqa: E731 - 4 calls in a row
    fits = measure_local_costs(NumpyOps(), None, METHODS, MAX, 0.9, False, _build(clock, calls, burst),
                               clock=clock, repeats=3)
    for key, (s, c0) in fits.items():
        assert s == pytest.approx(COST[key][1] - COST["none"][1], rel=1e-9)
        assert c0 == pytest.approx(COST[key][0] - COST["none"][0], rel=1e-9)


def test_a_method_that_cannot_run_on_one_rank_is_left_out():
    clock, calls = _Clock(), []
    inner = _build(clock, calls)

    def build(m, mem):
        r = inner(m, mem)
        if m.kind == "dgc":
            def fail(*a):
                raise NotImplementedError("needs two ranks")
            r.reduce = fail
        return r

    fits = measure_local_costs(NumpyOps(), None, METHODS, MAX, 0.9, False, build, clock=clock)
    assert set(fits) == {"bf16", "topk@0.01"}


def test_a_first_time_cost_over_a_whole_pass_is_dropped_by_the_second_pass():
    # every round of one method at the largest size is slow in the first pass (a first-time cost in
    # the process), fast in the second: the fit is the steady cost
    clock, calls = _Clock(), []
    first = lambda key, n, r: 0.03 if key == "topk@0.01" and n == MAX and r < 6 else 0.0  # noqa: E731
    fits = measure_local_costs(NumpyOps(), None, METHODS, MAX, 0.9, False, _build(clock, calls, first), clock=clock)
    s, c0 = fits["topk@0.01"]
    assert s == pytest.approx(COST["topk@0.01"][1] - COST["none"][1], rel=1e-9)
    assert c0 == pytest.approx(COST["topk@0.01"][0] - COST["none"][0], rel=1e-9)


def test_with_a_barrier_each_row_is_synchronised_and_each_method_keeps_its_median_repeat():
    # every rank runs the measurement at once (docs/auto-compression.md#costs-every-rank): a sync
    # call before each row of repeats, and the median kept, so that repeats where the other ranks
    # happened to be idle (here the fastest, rounds 1 and 2) do not stand for the contended cost
    clock, calls, rows = _Clock(), [], []
    contended = lambda key, n, r: 0.0 if r in (1, 2) else 0.01 if key == "topk@0.01" else 0.0  # noqa: E731
    fits = measure_local_costs(NumpyOps(), None, METHODS, MAX, 0.9, False, _build(clock, calls, contended),
                               clock=clock, repeats=5, sync=lambda: rows.append(len(calls)))
    sizes = probe_sizes(MAX)
    assert len(rows) == len(sizes) * (6 + 5)  # a row per repeat: 1 untimed + 5, then 5 in the second pass
    assert rows == [4 * i for i in range(len(rows))]  # each before a row of the 4 methods
    s, c0 = fits["topk@0.01"]  # 8 of its 10 timed repeats carry the 10 ms of contention
    assert c0 == pytest.approx(COST["topk@0.01"][0] - COST["none"][0] + 0.01, rel=1e-9)
    assert s == pytest.approx(COST["topk@0.01"][1] - COST["none"][1], rel=1e-6)
    clock2 = _Clock()
    unsynced = measure_local_costs(NumpyOps(), None, METHODS, MAX, 0.9, False, _build(clock2, [], contended),
                                   clock=clock2, repeats=5)  # alone: the fastest repeat, as before
    assert unsynced["topk@0.01"] == pytest.approx((COST["topk@0.01"][1] - COST["none"][1], COST["topk@0.01"][0] - COST["none"][0]))


def test_with_a_barrier_a_first_time_cost_over_a_whole_pass_is_dropped_too():
    # synced, each pass keeps its median and the lower of the passes' medians is the cost: a
    # first-time cost over every repeat of the first pass (half of all the timed repeats, which put
    # the median over both passes halfway to it) is dropped as the fastest repeat drops it alone
    clock, calls = _Clock(), []
    first = lambda key, n, r: 0.03 if key == "topk@0.01" and n == MAX and r < 6 else 0.0  # noqa: E731
    fits = measure_local_costs(NumpyOps(), None, METHODS, MAX, 0.9, False, _build(clock, calls, first), clock=clock,
                               repeats=5, sync=lambda: None)
    s, c0 = fits["topk@0.01"]
    assert s == pytest.approx(COST["topk@0.01"][1] - COST["none"][1], rel=1e-9)
    assert c0 == pytest.approx(COST["topk@0.01"][0] - COST["none"][0], rel=1e-9)
