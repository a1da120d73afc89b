"""Layer-wise top-k inside fused buckets (docs/lags-omgs.md#lags-merged): LAGS-SGD's per-layer
selection with one exchange per bucket gives, bit for bit, what one bucket per layer gives.

In-process ranks, NumpyOps, the engine as the adapters drive it (grad_ready, reduce_step).
"""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, build_engine, run_ranks
from hvd_commopt.buckets import Bucket, TensorSpec
from hvd_commopt.select.strategies import ExactTopK
from hvd_commopt.compress.topk import TopKSelector
from hvd_commopt.errors import ConfigError
from tests.unit.schedule_helpers import reduce_all, reducer_memory

ops = NumpyOps()
SPECS = [TensorSpec("l1.w", (24, 16), "float32"), TensorSpec("l1.b", (24,), "float32"),
         TensorSpec("l2.w", (40, 24), "float32"), TensorSpec("l2.b", (40,), "float32"),
         TensorSpec("l3.w", (7, 40), "float32"), TensorSpec("l3.b", (7,), "float32")]
STEPS = 6


def grads(rank, step, bad=None):
    rng = np.random.default_rng(1000 * rank + step)
    g = {s.name: (rng.standard_normal(s.shape) * (1 + rank)).astype(np.float32) for s in SPECS}
    for s in SPECS:  # exact ties across layers and inside one, so the tie rule is exercised
        g[s.name].reshape(-1)[:3] = 2.5
    if bad is not None:
        g[bad].reshape(-1)[5] = np.inf
    return g


def _train(make, P, fusion_threshold, bad_step=None, skip=None):
    """Per rank: every step's reduced gradients, then the reducer's memory."""
    def body(comm):
        eng = build_engine(comm, ops, compression=make(), fusion_threshold=fusion_threshold)
        eng.register(SPECS)
        outs = {}
        for s in range(STEPS):
            if s == skip:
                continue
            outs[s] = reduce_all(eng, grads(comm.rank, s, "l2.w" if (s == bad_step and comm.rank == 0) else None))
        return outs, reducer_memory(eng), [(b.names, b.dense) for b in eng.buckets]
    return run_ranks(P, body)


MAKERS = {
    "momentum_correction": lambda lw: Compression.topk(0.05, layerwise=lw),
    "error_feedback": lambda lw: Compression.topk(0.05, momentum_correction=False, layerwise=lw),
    "per_layer_density": lambda lw: Compression.topk({"l2.w": 0.2, "default": 0.03}, min_k=4,
                                                     momentum_correction=False, layerwise=lw),
}
# Not dense_1d=False: a one-layer bucket whose k is its size (a small bias) goes by the dense path,
# which keeps DGC's momentum unmasked; as a member of a fused bucket it is selected whole and masked.


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("P", [2, 3])
def test_layerwise_in_one_bucket_equals_one_bucket_per_layer_bit_for_bit(kind, P):
    make = MAKERS[kind]
    merged = _train(lambda: make(True), P, None)
    per_layer = _train(lambda: make(False), P, 0)
    assert any(len(names) > 1 and not dense for names, dense in merged[0][2])  # really fused
    assert all(len(names) == 1 for names, dense in per_layer[0][2] if not dense)
    for r in range(P):
        for s in range(STEPS):
            for n, v in per_layer[r][0][s].items():
                np.testing.assert_array_equal(merged[r][0][s][n], v, err_msg=f"r{r} s{s} {n}")
        # the memories ({kind: {bucket: tensor}}), per kind summed over the buckets, whose names differ
        tot = lambda mem, kind: sum(float(np.abs(t).sum(dtype=np.float64))  # noqa: E731
                                    for key, t in mem.items() if key.startswith(kind + "/"))
        kinds = {key.split("/", 1)[0] for key in per_layer[r][1]}
        assert kinds == {key.split("/", 1)[0] for key in merged[r][1]}
        for kd in kinds:
            assert tot(merged[r][1], kd) == tot(per_layer[r][1], kd), kd


def test_k_is_the_sum_of_each_members_own_k_and_the_density_is_asked_by_tensor_name():
    b = Bucket.of(0, [SPECS[2], SPECS[0], SPECS[4]])  # 960 + 384 + 280 elements
    asked = []

    def density(name, n):
        asked.append((name, n))
        return {"l2.w": 0.1, "l1.w": 0.01}.get(name, 0.5)

    comp = TopKSelector(density, layerwise=True, min_k=5)
    assert comp.k_for(b.numel, b) == 96 + 5 + 140  # int(960·0.1), max(int(3.84), 5), int(280·0.5)
    assert asked == [("l2.w", 960), ("l1.w", 384), ("l3.w", 280)]
    assert TopKSelector(density, min_k=5).k_for(b.numel, b) == int(b.numel * 0.5)  # whole bucket: its name
    one = Bucket.of(1, [SPECS[2]])
    assert comp.k_for(one.numel, one) == 96  # one tensor: the bucket's rule, which asks the bucket name
    assert comp.config()["layerwise"] is True and "layerwise=True" in repr(comp)


def test_each_member_gets_its_exact_top_k_and_the_bucket_is_accumulated_in_place():
    b = Bucket.of(0, [SPECS[2], SPECS[0], SPECS[4]])
    rng = np.random.default_rng(7)
    g = rng.standard_normal(b.numel).astype(np.float32)
    g[[3, 500, 1000, 1300]] = 9.0  # ties inside members
    r = rng.standard_normal(b.numel).astype(np.float32)
    comp = TopKSelector(0.05, layerwise=True)
    acc_before = r + g
    vals, idx, acc = comp.select_acc(ops, r, b, 0, g, None, fin := [])
    assert acc is r  # NumPy slices are views: one sweep, in place
    assert fin == [True]  # members this small skip the candidate pass: each is checked alone
    np.testing.assert_array_equal(acc, acc_before)
    want_i, want_v = [], []
    for off, n in zip(b.offsets, (960, 384, 280)):
        v, i = ops.topk_abs(acc_before[off:off + n], max(int(n * 0.05), 1))
        want_i.append(i + off)
        want_v.append(v)
    np.testing.assert_array_equal(idx, np.concatenate(want_i))
    np.testing.assert_array_equal(vals, np.concatenate(want_v))
    assert np.all(np.diff(idx) > 0) and idx.dtype == np.int64
    out = np.empty_like(g)
    r2 = rng.standard_normal(b.numel).astype(np.float32)
    keep = r2.copy()
    _, idx2, acc2 = comp.select_acc(ops, r2, b, 0, g, out)
    assert acc2 is out and np.array_equal(r2, keep)  # into out, r intact
    np.testing.assert_array_equal(out, keep + g)
    np.testing.assert_array_equal(idx2[:48], ExactTopK().select(ops, out[:960], 48).indices)


def test_the_finiteness_verdict_is_the_buckets():
    specs = [TensorSpec("a", (200, 200), "float32"), TensorSpec("b", (300, 150), "float32")]
    b = Bucket.of(0, specs)
    comp = TopKSelector(0.01, layerwise=True)
    g = np.random.default_rng(3).standard_normal(b.numel).astype(np.float32)
    for bad, want in ((None, [True]), (41000, [False]), (7, [False])):
        r = np.zeros_like(g)
        gg = g.copy()
        if bad is not None:
            gg[bad] = np.nan
        comp.select_acc(ops, r, b, 0, gg, None, fin := [])
        assert fin == want, bad


def test_a_nonfinite_member_skips_the_step_and_leaves_no_trace():
    make = lambda: Compression.topk(0.05, layerwise=True)  # noqa: E731
    a = _train(make, 2, None, bad_step=2)
    b = _train(make, 2, None, skip=2)
    for r in range(2):
        assert not all(np.isfinite(v).all() for v in a[r][0][2].values())  # every rank sees the skip
        for s in b[r][0]:
            for n, v in b[r][0][s].items():
                np.testing.assert_array_equal(a[r][0][s][n], v, err_msg=f"r{r} s{s} {n}")
        assert sorted(a[r][1]) == sorted(b[r][1])
        for n in b[r][1]:
            np.testing.assert_array_equal(a[r][1][n], b[r][1][n])


def test_bad_layerwise_arguments_name_the_fix():
    with pytest.raises(ConfigError, match="layerwise must be True"):
        Compression.topk(0.01, layerwise=1)
    with pytest.raises(ConfigError, match="fusion_threshold=0"):
        Compression.topk(0.01, layerwise=True, selection="threshold")
    with pytest.raises(ConfigError, match="selection='exact'"):
        Compression.topk(0.01, layerwise=True, selection="sampled")
    comp = TopKSelector({"l1.w": 0.1}, layerwise=True)
    with pytest.raises(ConfigError, match="no density for tensor 'l3.w'"):
        comp.k_for(384 + 280, Bucket.of(0, [SPECS[0], SPECS[4]]))


class _DeviceOps(NumpyOps):
    """NumpyOps that claims a device: the layer-wise selection takes its per-member path."""

    def device_name(self, t):
        return "cuda:0"


def _bucket(sizes):
    return Bucket.of(0, [TensorSpec(f"m{i}", (n,), "float32") for i, n in enumerate(sizes)])


@pytest.mark.parametrize("case", ["normal", "ties", "nan", "inf", "zeros", "scales"])
def test_the_batched_host_path_equals_the_per_member_path(case):
    b = _bucket([70000, 40000, 3000, 65536, 33000])
    rng = np.random.default_rng(5)
    g = rng.standard_normal(b.numel).astype(np.float32)
    r = rng.standard_normal(b.numel).astype(np.float32)
    if case == "ties":
        g[::7] = 3.0
        r[::7] = 0.0
    elif case == "nan":
        g[[5, 80000, 120000]] = np.nan
    elif case == "inf":
        g[[6, 113500]] = -np.inf
    elif case == "zeros":
        g[:], r[:] = 0.0, 0.0
        g[71000] = -0.0
    elif case == "scales":  # members of very different magnitudes
        for i, (off, n) in enumerate(zip(b.offsets, (70000, 40000, 3000, 65536, 33000))):
            g[off:off + n] *= 10.0 ** (3 * i - 6)
    got, want = [], []
    for ops_, res in ((ops, got), (_DeviceOps(), want)):
        comp = TopKSelector(0.003, layerwise=True, min_k=4)
        rr = r.copy()
        with np.errstate(invalid="ignore"):
            v, i, acc = comp.select_acc(ops_, rr, b, 0, g, None, fin := [])
        res.extend([v, i, np.array(acc, copy=True), fin])
    for x, y in zip(got[:3], want[:3]):
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint32 if x.dtype == np.float32 else np.uint64),
                                                     y.view(np.uint32 if y.dtype == np.float32 else np.uint64))
    assert got[3] == want[3] == [case not in ("nan", "inf")]


def test_a_missed_bracket_is_finished_exactly():
    """The sample's largest values lie only at sampled positions: fewer than k candidates, so the
    member is finished by the per-member path, with the same result."""
    from hvd_commopt.select import layerwise_host
    b = _bucket([40000, 50000])
    comp = TopKSelector(0.01, layerwise=True)
    x = np.random.default_rng(2).uniform(-1, 1, b.numel).astype(np.float32)
    plan = layerwise_host._Plan(comp.selection.exact, comp._layers.of(b, b.numel), ops, x)
    x[plan.sidx] = 10.0 + np.arange(plan.sidx.size, dtype=np.float32)  # huge, on the sample only
    v, i, _ = comp.select_acc(ops, x.copy(), b, 0, None)
    assert comp.selection.exact.stats["retries"] >= 2
    want_v, want_i = zip(*(ops.topk_abs(x[o:o + n], k) for o, n, k in comp._layers.of(b, b.numel)))
    np.testing.assert_array_equal(i, np.concatenate([want_i[0], want_i[1] + 40000]))
    np.testing.assert_array_equal(v, np.concatenate(want_v))


@pytest.mark.parametrize("members", [(2000, 3000, 2500), (200, 300, 250)])  # the batched host path; small members
def test_momentum_made_in_each_members_sweep_equals_made_first(members, monkeypatch):
    """Momentum correction in a fused bucket: each member's u' = mu*u + g is made by its own
    sweep (no separate pass over the bucket, docs/selection.md#native-sweep), and the selection,
    the sums and u' equal making u' first, bit for bit."""
    from hvd_commopt.select.addend import MomentumAddend
    b = Bucket.of(0, [TensorSpec(f"m{i}", (n,), "float32") for i, n in enumerate(members)])
    rng = np.random.default_rng(11)
    u, g, v = (rng.standard_normal(b.numel).astype(np.float32) for _ in range(3))
    comp = TopKSelector(0.02, layerwise=True)
    want_u = ops.scale_add_into(np.empty_like(u), u, 0.9, g)
    want = comp.select_acc(ops, v.copy(), b, 0, want_u, np.empty_like(v), [])
    a = MomentumAddend(u.copy(), 0.9, g, np.empty_like(u))
    if members[0] >= 2000:  # every member above the sorting size: each sweep makes its slice
        monkeypatch.setattr(type(ops), "scale_add_into", lambda *args: pytest.fail("a pass of its own"))
    got = comp.select_acc(ops, v.copy(), b, 0, a, np.empty_like(v), [])
    monkeypatch.undo()
    assert a.made is a.out and np.array_equal(a.made.view(np.uint32), want_u.view(np.uint32))
    for x, y in zip(got, want):
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
