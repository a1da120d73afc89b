"""1-D tensors go whole under sparse compression, in buckets of their own (docs/topk.md#dense-1d),
and a step with one non-finite bucket leaves no trace in any bucket (docs/wrapper.md#nonfinite-step).

In-process ranks, NumpyOps, the engine as the adapters drive it (grad_ready, reduce_step).
"""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, build_engine, run_ranks
from hvd_commopt.buckets import TensorSpec, build_buckets
from hvd_commopt.compress.dgc import DGCSelector
from hvd_commopt.compress.topk import TopKSelector
from hvd_commopt.errors import ConfigError, RankMismatchError
from tests.unit.schedule_helpers import reduce_all, reducer_memory

ops = NumpyOps()
# registration (forward) order; backward order is the reverse: l2.b, l2.w, l1.b, l1.w
SPECS = [TensorSpec("l1.w", (16, 8), "float32"), TensorSpec("l1.b", (16,), "float32"),
         TensorSpec("l2.w", (4, 16), "float32"), TensorSpec("l2.b", (4,), "float32")]
SPARSE = {
    "topk": lambda **kw: Compression.topk(0.05, **kw),
    "topk_ef": lambda **kw: Compression.topk(0.05, momentum_correction=False, **kw),
    "gtopk": lambda **kw: Compression.gtopk(0.05, **kw),
    "oktopk": lambda **kw: Compression.oktopk(0.05, **kw),
    "dgc": lambda **kw: Compression.dgc(0.05, momentum=0.9, sample_ratio=1.0, **kw),
    "randomk": lambda **kw: Compression.randomk(0.3, seed=1, **kw),
}


def grads(rank, step, bad=None):
    rng = np.random.default_rng(1000 * rank + step)
    g = {s.name: (rng.standard_normal(s.shape) * (1 + rank)).astype(np.float32) for s in SPECS}
    if bad is not None:
        g[bad][(0,) * len(g[bad].shape)] = np.inf
    return g


def test_build_buckets_moves_1d_members_out_merges_them_and_orders_by_arrival():
    bwd = list(reversed(SPECS))  # l2.b, l2.w, l1.b, l1.w
    one = lambda s: len(s.shape) <= 1  # noqa: E731
    assert [(b.names, b.dense) for b in build_buckets(bwd, [[0, 1, 2, 3]], one)] == [
        (("l2.b", "l1.b"), True), (("l2.w", "l1.w"), False)]  # l1.b (position 2) arrives before l1.w (3)
    # per-layer groups: the sparse parts stay apart, the 1-D parts share one bucket, which launches
    # when its last member (l1.b, position 2) arrives
    assert [(b.names, b.dense) for b in build_buckets(bwd, [[0], [1], [2], [3]], one)] == [
        (("l2.w",), False), (("l2.b", "l1.b"), True), (("l1.w",), False)]
    assert [(b.names, b.dense) for b in build_buckets(bwd, [[0, 1], [2, 3]], one)] == [
        (("l2.w",), False), (("l2.b", "l1.b"), True), (("l1.w",), False)]
    big = [TensorSpec(f"b{i}", (1 << 17,), "float32") for i in range(3)]  # 512 KiB each
    assert [b.names for b in build_buckets(big, [[0], [1], [2]], one)] == [("b0", "b1"), ("b2",)]  # <= 1 MiB
    assert [(b.names, b.dense) for b in build_buckets(bwd, [[0, 1, 2, 3]])] == [
        (("l2.b", "l2.w", "l1.b", "l1.w"), False)]  # no predicate (dense reducers): one bucket
    mixed = [TensorSpec("a", (3, 3), "float32"), TensorSpec("b", (3,), "float32"),
             TensorSpec("c", (3, 3), "float64"), TensorSpec("d", (3,), "float64")]
    assert [(b.names, b.dtype, b.dense) for b in build_buckets(mixed, [[0, 1, 2, 3]], one)] == [
        (("a",), "float32", False), (("c",), "float64", False),  # still split at the dtype change
        (("b",), "float32", True), (("d",), "float64", True)]


@pytest.mark.parametrize("make, k_mat", [(lambda: TopKSelector(0.01), 1),    # int(192 * 0.01)
                                          (lambda: DGCSelector(0.01), 2)])   # ceil(192 * 0.01)
def test_k_of_a_dense_bucket_is_its_size(make, k_mat):
    comp = make()
    vec, mat = build_buckets(list(reversed(SPECS)), [[0, 1, 2, 3]], lambda s: len(s.shape) <= 1)
    assert comp.k_for(vec.numel, vec) == vec.numel == 20
    assert mat.numel == 192 and comp.k_for(mat.numel, mat) == k_mat


@pytest.mark.parametrize("kind", sorted(SPARSE))
def test_1d_tensors_are_averaged_exactly_and_the_rest_is_selected(kind):
    P = 3

    def body(comm):
        out = {}
        for dense_1d in (True, False):
            eng = build_engine(comm, ops, compression=SPARSE[kind](dense_1d=dense_1d))
            eng.register(SPECS)
            g = grads(comm.rank, 0)
            for name in eng.backward_names:
                eng.grad_ready(name, g[name].copy())
            out[dense_1d] = (eng.reduce_step(), [(b.names, b.dense) for b in eng.buckets],
                             eng.last_stats.per_bucket, eng.reducer.config()["compressor"]["dense_1d"])
        return out

    res = run_ranks(P, body)
    mean = {s.name: sum(grads(r, 0)[s.name] for r in range(P)) * np.float32(1.0 / P) for s in SPECS}
    for r in range(P):
        out, layout, per_bucket, flag = res[r][True]
        assert flag is True and layout == [(("l2.b", "l1.b"), True), (("l2.w", "l1.w"), False)]
        for name in ("l1.b", "l2.b"):  # the dense path: the average (first step: the momentum is 0)
            np.testing.assert_array_equal(out[name], mean[name], err_msg=f"{kind} {name}")
        vec = next(v for b, v in per_bucket.items() if b.startswith("bucket0:"))
        assert vec["bytes_sent"] > 0
        for name in ("l1.w", "l2.w"):  # selected: sparse
            assert np.count_nonzero(out[name]) < out[name].size
            np.testing.assert_array_equal(out[name], res[0][True][0][name])  # identical on every rank
        out_f, layout_f, _, flag_f = res[r][False]
        assert flag_f is False and len(layout_f) == 1 and layout_f[0][1] is False
        assert sum(np.count_nonzero(out_f[n]) for n in ("l1.b", "l2.b")) < 20  # selected with the matrices


def test_dense_1d_must_be_a_bool_and_equal_on_every_rank():
    with pytest.raises(ConfigError, match="dense_1d must be True"):
        Compression.topk(0.01, dense_1d="yes")

    def body(comm):
        eng = build_engine(comm, ops, compression=Compression.topk(0.05, dense_1d=comm.rank == 0))
        try:
            eng.register(SPECS)
        except RankMismatchError as e:
            return str(e)
    msgs = run_ranks(2, body)
    assert msgs[0] == msgs[1] and "dense_1d" in msgs[0], msgs


STEPS, BAD = 5, 2


def _run(kind, bad, skip):
    """Run A (``skip=False``): rank 0's ``bad`` tensor holds an Inf at step BAD, which every rank
    then skips; run B (``skip=True``): step BAD never happens. Outputs and memories per rank."""
    def body(comm):
        eng = build_engine(comm, ops, compression=SPARSE[kind](), fusion_threshold=0)
        eng.register(SPECS)
        outs = {}
        for s in range(STEPS):
            if skip and s == BAD:
                continue
            outs[s] = reduce_all(eng, grads(comm.rank, s, bad if (s == BAD and comm.rank == 0) else None))
        return outs, reducer_memory(eng)
    return run_ranks(2, body)


@pytest.mark.parametrize("kind", ["topk", "topk_ef", "gtopk", "dgc"])
@pytest.mark.parametrize("bad", ["l1.w", "l2.b"])
def test_a_step_with_one_nonfinite_bucket_leaves_no_trace_in_the_others(kind, bad):
    a, b = _run(kind, bad, False), _run(kind, bad, True)
    for r in range(2):
        outs_a, mem_a = a[r]
        outs_b, mem_b = b[r]
        assert not np.isfinite(outs_a[BAD][bad]).all()  # every rank sees the skipped step
        assert all(np.isfinite(outs_a[BAD][n]).all() for n in outs_a[BAD] if n != bad)  # others finite
        for s in outs_b:
            for n in outs_b[s]:
                np.testing.assert_array_equal(outs_a[s][n], outs_b[s][n], err_msg=f"{kind} r{r} s{s} {n}")
        assert sorted(mem_a) == sorted(mem_b)
        for k in mem_b:
            np.testing.assert_array_equal(mem_a[k], mem_b[k], err_msg=f"{kind} r{r} {k}")
