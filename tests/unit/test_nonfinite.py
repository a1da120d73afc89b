"""NaN/Inf never enter a memory; a skipped step costs exactly one step (docs/wrapper.md#nonfinite).

In-process ranks, NumpyOps. Run A injects an Inf into rank 0's gradient at step BAD and skips the
step when the reduced bucket is non-finite (what a GradScaler does); run B never runs step BAD.
Every later output and the final memories must be bit-identical.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, run_ranks
from hvd_commopt.buckets import Bucket
from hvd_commopt.compress import TernaryCompressor
from hvd_commopt.memory import ErrorFeedback
from hvd_commopt.compress.cast import FP16Compressor
from hvd_commopt.compress.nonfinite import NonFiniteGradientError
from hvd_commopt.errors import ConfigError
from hvd_commopt.reduce import DenseAllreduce, ReduceContext
from hvd_commopt.reduce.base import RoundInfo

ops = NumpyOps()
N, STEPS, BAD = 64, 6, 2

FACTORIES = {
    "topk": lambda: Compression.topk(0.1),
    "topk_dense": lambda: Compression.topk(1.0),
    "randomk": lambda: Compression.randomk(0.1, seed=3),
    "dgc": lambda: Compression.dgc(0.1, momentum=0.9, sample_ratio=1.0),
    "dgc_dense": lambda: Compression.dgc(1.0, momentum=0.9),
    "gtopk": lambda: Compression.gtopk(0.1),
    "fp16_ef": lambda: DenseAllreduce(FP16Compressor(), ErrorFeedback()),
}


def grads(P, bad_value, n=N):
    out = {}
    for r in range(P):
        rng = np.random.default_rng(100 + r)
        for s in range(STEPS):
            out[r, s] = (rng.standard_normal(n) * (1 + r)).astype(np.float32)
    out[0, BAD] = out[0, BAD].copy()
    out[0, BAD][[5, 17]] = bad_value
    return out


def memory_state(red):
    """Every tensor the memory holds, as host copies."""
    sd = red.state_dict().get("memory", {})
    return {f"{k}/{n}": np.array(t, copy=True) for k, d in sd.items() for n, t in d.items()}


def run(P, factory, data, skip_bad_step, ops=ops, stats=False):
    """Per rank: (outputs, memory) of STEPS rounds (step BAD left out if skip_bad_step), and the
    reducer's selection statistics when ``stats``."""
    bucket = Bucket.single("b", data[0, 0].size, "float32")

    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        red = factory()
        outs = {}
        for s in range(STEPS):
            if skip_bad_step and s == BAD:
                continue
            out = red.reduce(bucket, RoundInfo(s), data[comm.rank, s].copy(), ctx)
            outs[s] = np.array(out, copy=True)
            for k, v in memory_state(red).items():
                assert np.isfinite(v).all(), (comm.rank, s, k)
        return (outs, memory_state(red)) + ((red.stats(),) if stats else ())
    return run_ranks(P, body)


def assert_skip_left_no_trace(kind, P, a, b):
    """Run ``a`` (with the bad step, skipped) equals run ``b`` (without it) on every rank, outputs
    and memories bit for bit, and every rank saw the skipped step."""
    for r in range(P):
        outs_a, mem_a = a[r]
        outs_b, mem_b = b[r]
        assert not np.isfinite(outs_a[BAD]).all(), "every rank sees the skipped step"
        for s in outs_b:
            np.testing.assert_array_equal(outs_a[s], outs_b[s], err_msg=f"{kind} rank {r} step {s}")
        assert mem_a.keys() == mem_b.keys()
        for k in mem_a:
            np.testing.assert_array_equal(mem_a[k], mem_b[k], err_msg=f"{kind} rank {r} {k}")


@pytest.mark.parametrize("kind", sorted(FACTORIES))
@pytest.mark.parametrize("bad_value", [np.inf, np.nan])
def test_skipped_step_costs_one_step(kind, bad_value):
    P = 2
    data = grads(P, bad_value)
    with pytest.warns(RuntimeWarning, match=r"rank 0: the gradient of bucket 'b' holds NaN or Inf"):
        a = run(P, FACTORIES[kind], data, skip_bad_step=False)
    b = run(P, FACTORIES[kind], data, skip_bad_step=True)
    assert_skip_left_no_trace(kind, P, a, b)
    np.testing.assert_array_equal(a[0][0][BAD], a[1][0][BAD])  # the same result on every rank


class _CountingOps(NumpyOps):
    """NumpyOps recording the size of every all_finite call."""

    def __init__(self):
        super().__init__()
        self.checked: list[int] = []

    def all_finite(self, t):
        self.checked.append(int(np.size(t)))
        return super().all_finite(t)


# buckets above the exact selector's small_n, so the candidate pass runs (docs/selection.md#finite-sweep)
BIG = {
    "topk_exact": lambda: Compression.topk(0.01),
    "topk_nomc": lambda: Compression.topk(0.01, momentum_correction=False),
    "topk_sampled": lambda: Compression.topk(0.01, selection="sampled"),
    "dgc": lambda: Compression.dgc(0.01, momentum=0.9),
    "dgc_exact": lambda: Compression.dgc(0.01, momentum=0.9, selection="exact"),
    "topk_thr": lambda: Compression.topk(0.01, selection="threshold"),
    "dgc_thr": lambda: Compression.dgc(0.01, momentum=0.9, selection="threshold"),
}


EXACT_CALLS = {  # (factory, bucket size, one exact selection a round)
    "topk": (FACTORIES["topk"], N, True), "gtopk": (FACTORIES["gtopk"], N, True),
    "topk_big": (BIG["topk_exact"], 50_000, True), "dgc_exact_big": (BIG["dgc_exact"], 50_000, True),
    "topk_thr_big": (BIG["topk_thr"], 50_000, False), "dgc_thr_big": (BIG["dgc_thr"], 50_000, False),
}


@pytest.mark.parametrize("kind", sorted(EXACT_CALLS))
def test_skipped_step_is_not_counted_in_the_exact_selection_calls(kind):
    """The exact selector's "calls" counts the rounds that took effect: the rolled-back round
    (locally non-finite on rank 0, after the exchange on rank 1) is taken back."""
    factory, n, every_round = EXACT_CALLS[kind]
    P = 2
    data = grads(P, np.inf, n)
    with pytest.warns(RuntimeWarning, match="holds NaN or Inf"):
        a = run(P, factory, data, skip_bad_step=False, stats=True)
    b = run(P, factory, data, skip_bad_step=True, stats=True)
    for r in range(P):
        calls_a, calls_b = a[r][2]["exact"]["calls"], b[r][2]["exact"]["calls"]
        assert calls_a == calls_b, (r, calls_a, calls_b)
        if every_round:
            assert calls_a == STEPS - 1
        else:
            assert calls_a >= 1


@pytest.mark.parametrize("kind", sorted(BIG))
@pytest.mark.parametrize("bad_value", [np.inf, np.nan])
def test_skipped_step_costs_one_step_with_the_check_in_the_selection(kind, bad_value):
    """The selection's pass decides finiteness; a non-finite step is still skipped exactly, and a
    finite step checks no n-element buffer (only k-sized ones) where the mode folds the check."""
    P, n = 2, 50_000
    data = grads(P, bad_value, n)
    counting = _CountingOps()
    with pytest.warns(RuntimeWarning, match=r"rank 0: the gradient of bucket 'b' holds NaN or Inf"):
        a = run(P, BIG[kind], data, skip_bad_step=False, ops=counting)
    b = run(P, BIG[kind], data, skip_bad_step=True)
    assert_skip_left_no_trace(kind, P, a, b)
    full = sum(1 for c in counting.checked if c == n)
    if kind.endswith("_thr"):  # threshold reuse keeps state: the check stays before the selection
        assert full >= P * STEPS
    else:  # only the bad step's rank 0 looks at its whole bucket (to tell Inf from an overflow)
        assert full == 1, counting.checked


@pytest.mark.parametrize("kind", ["topk_exact", "dgc"])
def test_overflow_of_finite_values_is_not_reported_as_a_bad_gradient(kind):
    """A finite gradient whose sum with the memory overflows is sent as it is (no warning, as
    before the check moved into the selection); the non-finite result rolls the memory back."""
    P, n = 2, 50_000
    data = grads(P, 0.0, n)
    big = np.float32(3e38)
    for r in range(P):
        data[r, BAD - 1] = data[r, BAD - 1].copy()
        data[r, BAD - 1][:3000] = big  # more than k: most stay in the memory
        data[r, BAD] = data[r, BAD].copy()
        data[r, BAD][:3000] = big  # memory + gradient overflows to +Inf
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
        warnings.filterwarnings("error", ".*holds NaN or Inf", RuntimeWarning)
        a = run(P, BIG[kind], data, skip_bad_step=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
        b = run(P, BIG[kind], data, skip_bad_step=True)
    for r in range(P):
        outs_a, mem_a = a[r]
        outs_b, mem_b = b[r]
        assert not np.isfinite(outs_a[BAD]).all()
        for s in outs_b:
            np.testing.assert_array_equal(outs_a[s], outs_b[s], err_msg=f"{kind} rank {r} step {s}")
        for k in mem_a:
            np.testing.assert_array_equal(mem_a[k], mem_b[k], err_msg=f"{kind} rank {r} {k}")


def test_ternary_drops_the_contribution_and_keeps_the_residual():
    """Integer sums cannot carry Inf: the bad rank sends zeros, its residual stays as it was."""
    P = 2
    data = grads(P, np.inf)
    bucket = Bucket.single("b", N, "float32")

    def body(comm):
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / comm.size)
        red = DenseAllreduce(TernaryCompressor(0.5, comm.size), ErrorFeedback())
        rec = []
        for s in range(STEPS):
            before = memory_state(red)
            out = red.reduce(bucket, RoundInfo(s), data[comm.rank, s].copy(), ctx)
            rec.append((before, memory_state(red), np.array(out, copy=True)))
        return rec
    with pytest.warns(RuntimeWarning, match="rank 0"):
        res = run_ranks(P, body)
    before, after, out = res[0][BAD]
    assert np.isfinite(out).all()
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    for r in range(P):
        for _, mem, o in res[r]:
            assert np.isfinite(o).all() and all(np.isfinite(v).all() for v in mem.values())


def test_raise_names_rank_and_bucket_and_leaves_memory_alone():
    bucket = Bucket.single("layer.w", N, "float32")
    red = Compression.topk(0.1, nonfinite="raise")
    x = np.ones(N, np.float32)

    def body(comm):
        ctx = ReduceContext(comm, ops)
        red.reduce(bucket, RoundInfo(0), x.copy(), ctx)
        before = memory_state(red)
        bad = x.copy()
        bad[3] = np.nan
        with pytest.raises(NonFiniteGradientError, match=r"rank 0: the gradient of bucket 'layer.w'"):
            red.reduce(bucket, RoundInfo(1), bad, ctx)
        after = memory_state(red)
        for k in before:
            np.testing.assert_array_equal(before[k], after[k])
    run_ranks(1, body)


def test_policy_is_checked_and_part_of_the_config():
    with pytest.raises(ConfigError, match="nonfinite must be one of"):
        Compression.dgc(0.1, nonfinite="ignore")
    with pytest.raises(ConfigError, match="nonfinite must be one of"):
        ErrorFeedback(nonfinite=None)
    assert Compression.topk(0.1).config()["memory"]["nonfinite"] == "skip"
    assert Compression.gtopk(0.1, nonfinite="raise").config()["memory"]["nonfinite"] == "raise"


def test_warning_once_per_rank_and_bucket_under_the_default_filter():
    data = grads(1, np.inf)
    bucket = Bucket.single("b", N, "float32")

    def body(comm):
        ctx = ReduceContext(comm, ops)
        red = Compression.topk(0.1)
        for _ in range(3):
            red.reduce(bucket, RoundInfo(0), data[0, BAD].copy(), ctx)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("default")
        run_ranks(1, body)
    assert len([x for x in w if "holds NaN or Inf" in str(x.message)]) == 1
