"""DAG simulator (docs/dag-model.md#task-graph, docs/mgwfbp.md#timeline-model): closed-form cases and invariants."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt.fusion.cost_model import AlphaBeta
from hvd_commopt.fusion.simulator import ready_times, simulate
from hvd_commopt.fusion.threshold import plan_per_tensor, plan_single

SIZES = [400, 40, 4000, 800]
TB = [0.5, 0.25, 0.125, 1.0]  # dyadic: every sum below is exact in binary floating point
AB = AlphaBeta(0.5, 1 / 1024)


def test_ready_times():
    assert ready_times(TB) == [0.5, 0.75, 0.875, 1.875]
    assert ready_times(TB, start=1.0) == [1.5, 1.75, 1.875, 2.875]


def test_one_bucket_is_backward_plus_comm():
    r = simulate(plan_single(4), SIZES, TB, AB)
    comm = 0.5 + sum(SIZES) / 1024
    assert r.iteration_time == sum(TB) + comm
    assert r.non_overlapped_comm == comm
    assert r.bucket_ready == (1.875,) and r.bucket_start == (1.875,) and r.bucket_end == (1.875 + comm,)
    r2 = simulate(plan_single(4), SIZES, TB, AB, forward_time=2.0, update_time=0.25)
    assert r2.iteration_time == 2.0 + sum(TB) + comm + 0.25
    assert r2.compute_time == 2.0 + sum(TB) + 0.25


@pytest.mark.parametrize("plan", [plan_single(4), plan_per_tensor(4), [[0, 1], [2, 3]], [[0], [1, 2, 3]]])
def test_free_communication_is_compute_only(plan):
    r = simulate(plan, SIZES, TB, AlphaBeta(0.0, 0.0), forward_time=0.75, update_time=0.5)
    assert r.iteration_time == 0.75 + sum(TB) + 0.5
    assert r.non_overlapped_comm == 0.0 and r.comm_total == 0.0


def test_per_tensor_by_hand():
    # ready 0.5, 0.75, 0.875, 1.875; durations 0.5 + bytes/1024
    d = [0.5 + s / 1024 for s in SIZES]
    e0 = 0.5 + d[0]
    e1 = max(e0, 0.75) + d[1]
    e2 = max(e1, 0.875) + d[2]
    e3 = max(e2, 1.875) + d[3]
    r = simulate(plan_per_tensor(4), SIZES, TB, AB)
    assert r.bucket_end == (e0, e1, e2, e3)
    assert r.iteration_time == e3 and r.comm_total == sum(d)


def test_comm_hidden_except_last_bucket():
    tiny = AlphaBeta(0.001, 0.0)  # every message finishes before the next gradient is ready
    r = simulate(plan_per_tensor(4), SIZES, TB, tiny)
    assert r.iteration_time == sum(TB) + 0.001
    assert r.non_overlapped_comm == pytest.approx(0.001)


def test_compression_on_compute_stream():
    ts = lambda nbytes: nbytes / 4096  # noqa: E731
    tcs = lambda nbytes: 0.0 if nbytes == 0 else 0.25  # noqa: E731
    r = simulate(plan_single(4), SIZES, TB, tcs, compress_time=ts)
    assert r.iteration_time == sum(TB) + sum(SIZES) / 4096 + 0.25
    # two buckets: top-k of bucket 0 delays the backward of tensor 2
    r2 = simulate([[0, 1], [2, 3]], SIZES, TB, tcs, compress_time=ts)
    s0 = 0.75 + 440 / 4096
    g_end = s0 + 0.125 + 1.0 + 4800 / 4096
    assert r2.bucket_ready == (s0, g_end)
    assert r2.compute_end == g_end
    assert r2.iteration_time == max(s0 + 0.25, g_end) + 0.25


def test_schedule_invariants_random():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 10))
        sizes = rng.integers(0, 10**6, n).tolist()
        tb = rng.uniform(0, 0.1, n).tolist()
        cuts = sorted(set(rng.integers(1, n, int(rng.integers(0, n))).tolist())) if n > 1 else []
        bounds = [0] + cuts + [n]
        plan = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
        ab = AlphaBeta(float(rng.uniform(0, 0.01)), float(rng.uniform(0, 1e-7)))
        r = simulate(plan, sizes, tb, ab, forward_time=0.1, update_time=0.05)
        rt = ready_times(tb, start=0.1)
        prev = 0.0
        for b, g in enumerate(plan):
            assert r.bucket_ready[b] == rt[g[-1]]
            assert r.bucket_start[b] == max(prev, rt[g[-1]])
            assert r.bucket_end[b] == r.bucket_start[b] + ab.time(sum(sizes[i] for i in g))
            prev = r.bucket_end[b]
        assert r.iteration_time == max(prev, rt[-1]) + 0.05
        assert r.iteration_time >= r.compute_time - 1e-12


def test_empty_model():
    r = simulate([], [], [], AB, forward_time=1.0, update_time=0.5)
    assert r.iteration_time == 1.5 and r.bucket_end == ()


@pytest.mark.parametrize("plan,sizes,tb,msg", [
    ([[0, 2], [1]], [1, 1, 1], [0.1] * 3, "contiguous"),
    ([[0, 1]], [1, 1, 1], [0.1] * 3, "cover"),
    ([[0, 1]], [1, 1], [0.1], "one backward time per tensor"),
    ([[0, 1]], [1, -1], [0.1, 0.1], "non-negative"),
    ([[0, 1]], [1, 1], [0.1, float("nan")], "finite"),
])
def test_invalid_inputs(plan, sizes, tb, msg):
    with pytest.raises(ValueError, match=msg):
        simulate(plan, sizes, tb, AB)


def test_negative_cost_function_rejected():
    with pytest.raises(ValueError, match="cost functions"):
        simulate([[0]], [4], [0.1], lambda n: -1.0)
