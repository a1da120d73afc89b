"""compression="auto"'s dense fp32 round (docs/auto-compression.md#dense-path): S-SGD's allreduce
with the momentum applied once, in one pass. Exact: the values are S-SGD with momentum bit for bit
(and the old density-1 sparse path's), the momentum and the gradient mass survive dense -> sparse
-> dense switches, and a NaN/Inf step leaves the momentum as it was."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from hvd_commopt import build_engine, host_memory, run_ranks
from hvd_commopt.autocompress import AutoOptions, AutoReducer, Method
from hvd_commopt.autocompress.choose import DENSE
from hvd_commopt.autocompress.dense import DenseMomentum
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.compress.topk import TopKSelector
from hvd_commopt.numpy_ops import NumpyOps
from hvd_commopt.reduce.sparse_allgather import SparseAllgather
from hvd_commopt.select import host_native

SPECS = [TensorSpec(f"l{i}.w", (n, 1), "float32") for i, n in enumerate([300, 500, 200])]
SHAPES = {s.name: s.shape for s in SPECS}
MU = 0.9


class _OldDense(AutoReducer):
    """The A/B reference: dense fp32 through the sparse reducers' density-1 path, as before."""

    def sub(self, method):
        if method == DENSE and DENSE not in self._subs:
            self._subs[DENSE] = SparseAllgather(TopKSelector(1.0, min_k=1), self.memory)
        return super().sub(method)


def _normal(rank: int, step: int) -> dict:
    rng = np.random.default_rng(1000 * rank + step)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}


def _int(rank: int, step: int) -> dict:
    """Small integers: with momentum 0.5 every value below is a short dyadic fraction, exact in float32."""
    rng = np.random.default_rng(100 * rank + step)
    return {s.name: rng.integers(-8, 9, size=s.shape).astype(np.float32) for s in SPECS}


def _engine(comm, compression, mu=None):
    eng = build_engine(comm, NumpyOps(), compression=compression, fusion_threshold=0)
    eng.register(SPECS)
    if mu is not None:
        compression.memory.bind_momentum(mu)
    return eng


def _step(eng, grads) -> dict:
    for n in eng.backward_names:
        eng.grad_ready(n, grads[n])
    return {k: np.asarray(v).copy() for k, v in eng.reduce_step().items()}


def _momenta(red) -> dict:
    return {k: np.asarray(v).copy() for k, v in red.memory.state_dict().get("momentums", {}).items()}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("post", [1.0, 0.5, 1 / 3])
@pytest.mark.parametrize("simd", [True, False])
def test_native_momentum_average_is_torchs_mul_then_add(dtype, post, simd):
    native = host_native.native()
    if native is None:
        pytest.skip("the native host kernels are not built")
    was = native._set_simd(simd) == "avx2"
    try:
        rng = np.random.default_rng(7)
        for n in (0, 1, 7, 33, 4099):
            x, u = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
            g = x * dtype(post) if post != 1.0 else x.copy()
            want = u * dtype(MU)
            want = want + g  # two roundings, in torch's order: buf.mul_(mu).add_(g)
            xx, uo = x.copy(), np.empty_like(u)
            assert host_memory.momentum_average(xx, post, u, MU, uo) is True
            assert uo.tobytes() == want.tobytes() and xx.tobytes() == want.tobytes()
        for bad in (np.nan, np.inf, -np.inf):
            x = rng.standard_normal(40).astype(dtype)
            x[17] = bad
            assert host_memory.momentum_average(x.copy(), post, u[:40], MU, np.empty(40, dtype)) is False
        big = np.full(8, np.finfo(dtype).max, dtype)  # finite values whose product overflows
        assert host_memory.momentum_average(big.copy(), 4.0, np.zeros(8, dtype), MU, np.empty(8, dtype)) is False
    finally:
        native._set_simd(was)


@pytest.mark.parametrize("native", [True, False])
def test_dense_rounds_are_ssgd_with_momentum_bit_for_bit(native):
    """Each dense round hands back S-SGD's momentum buffer ``mu*u + avg`` (torch.optim.SGD's
    ``buf.mul_(mu).add_(g)``), which the optimizer then steps with, and the old density-1 path's
    values, bit for bit; on the native kernel and on the framework's ops."""
    def body(comm, make):
        red = make()
        eng = _engine(comm, red, MU) if red is not None else _engine(comm, None)
        outs = [_step(eng, _normal(comm.rank, t)) for t in range(5)]
        return outs, (_momenta(red) if red is not None else None)

    host_native.USE_NATIVE = native
    try:
        new = run_ranks(2, lambda c: body(c, lambda: AutoReducer(AutoOptions(allow=("none",)))))
        old = run_ranks(2, lambda c: body(c, lambda: _OldDense(AutoOptions(allow=("none",)))))
        plain = run_ranks(2, lambda c: body(c, lambda: None))
    finally:
        host_native.USE_NATIVE = True
    buf = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    for t, avg in enumerate(plain[0][0]):
        for k in buf:
            buf[k] = buf[k] * np.float32(MU)
            buf[k] = buf[k] + avg[k]
            for r in range(2):
                assert new[r][0][t][k].tobytes() == buf[k].tobytes()
                assert old[r][0][t][k].tobytes() == buf[k].tobytes()
    assert new[0][1].keys() == old[0][1].keys()
    for k in new[0][1]:
        assert new[0][1][k].tobytes() == old[0][1][k].tobytes() == new[1][1][k].tobytes()
    assert isinstance(AutoReducer().sub(DENSE), DenseMomentum)


# dense, then sparse (the momentum carries over), then back to dense through the flush
SWITCHES = ["none", "none", "topk@0.1", "dgc@0.1", "topk@0.1", "none", "none", "bf16", "none"]


def _copies(d: dict) -> dict:
    return {k: np.asarray(v).copy() for k, v in d.items()}


def test_dense_sparse_dense_keeps_the_momentum_and_loses_no_mass():
    """Every step, what is applied plus what the velocity gained equals what entered it: the mean
    over ranks of ``u_r = mu*u_r + g_r``, each rank's momentum as the memory held it (a dense round
    applies all of it, ``mu*u + avg(g)``, and leaves the velocity alone). So the momentum the dense
    rounds built is the one the sparse rounds continue from, and the flush back to dense leaves no
    velocity. Momentum 0.5 and integer gradients: every value is exact."""
    mu = 0.5

    def body(comm):
        red = AutoReducer(AutoOptions(allow=("bf16", "topk", "dgc"), min_density=0.1))
        eng = _engine(comm, red, mu)
        rows = []
        for t, key in enumerate(SWITCHES):
            red.assign({b.name: Method.parse(key) for b in eng.buckets})
            sd = red.memory.state_dict()
            u0, v0 = _copies(sd.get("momentums", {})), _copies(sd.get("velocities", {}))
            g = _int(comm.rank, t)
            out = _step(eng, g)
            rows.append((u0, v0, g, out, _copies(red.memory.state_dict().get("velocities", {}))))
        return [(b.name, b.names) for b in eng.buckets], rows

    res = run_ranks(2, body)
    buckets = res[0][0]
    ranks = [r[1] for r in res]

    def flat(d, members):
        return np.concatenate([np.asarray(d[n], np.float64).reshape(-1) for n in members])

    ssgd_u = {b: 0.0 for b, _ in buckets}
    for t, key in enumerate(SWITCHES):
        for b, members in buckets:
            zero = np.zeros(sum(int(np.prod(SHAPES[n])) for n in members))
            u_in = sum(mu * rows[t][0].get(b, zero) + flat(rows[t][2], members) for rows in ranks) / 2
            applied = flat(ranks[0][t][3], members)
            np.testing.assert_array_equal(applied, flat(ranks[1][t][3], members))  # the same on every rank
            gained = sum(rows[t][4].get(b, zero) - rows[t][1].get(b, zero) for rows in ranks) / 2
            np.testing.assert_array_equal(applied + gained, u_in)
            if t < 2:  # the dense rounds before any switch: S-SGD's momentum buffer
                ssgd_u[b] = mu * ssgd_u[b] + sum(flat(rows[t][2], members) for rows in ranks) / 2
                np.testing.assert_array_equal(applied, ssgd_u[b])
    for rows in ranks:
        for b, _ in buckets:  # the first sparse round started from S-SGD's momentum
            np.testing.assert_array_equal(rows[2][0][b], ssgd_u[b])
        for v in rows[-1][4].values():  # the switch back to dense flushed every velocity
            np.testing.assert_array_equal(v, 0 * v)


def _memory_unchanged(before: dict, after: dict) -> None:
    for part in ("momentums", "velocities"):
        for k in before[part]:
            assert np.asarray(after[part][k]).tobytes() == np.asarray(before[part][k]).tobytes()


def _equals_the_run_without_step_1(body) -> None:
    """``body(comm, skip)`` with the bad step 1 against the run that skips it: the same bits after."""
    bad = run_ranks(2, lambda c: body(c, False))
    clean = run_ranks(2, lambda c: body(c, True))
    for r in range(2):
        for t_bad, t_clean in ((0, 0), (2, 1), (3, 2)):
            for k in bad[r][t_bad]:
                assert bad[r][t_bad][k].tobytes() == clean[r][t_clean][k].tobytes()


def test_a_nonfinite_dense_step_keeps_the_momentum_and_is_skipped_everywhere():
    """NaN on one rank in a dense bucket: every rank gets a non-finite result, the momentum is
    the one before the step, a sparse bucket's velocity too (the whole step is skipped,
    docs/wrapper.md#nonfinite-step), and the steps after equal a run without that step."""
    def body(comm, skip):
        red = AutoReducer(AutoOptions(allow=("topk",), min_density=0.1))
        eng = _engine(comm, red, MU)
        red.assign({b.name: Method.parse("topk@0.1" if b.index == 0 else "none") for b in eng.buckets})
        outs = []
        for t in range(4):
            g = _normal(comm.rank, t)
            if t == 1:
                if skip:
                    continue
                g[eng.buckets[1].names[0]][3] = np.nan if comm.rank == 1 else g[eng.buckets[1].names[0]][3]
            before = {part: _copies(d) for part, d in red.memory.state_dict().items()}
            out = _step(eng, g)
            outs.append(out)
            if t == 1:
                _memory_unchanged(before, red.memory.state_dict())
                assert not all(np.isfinite(v).all() for v in out.values())
        return outs

    _equals_the_run_without_step_1(body)


def test_without_momentum_every_bucket_dense_checks_nothing():
    """With no momentum and every bucket dense nothing is remembered, so no NaN/Inf verdict is
    made (S-SGD's round); with a sparse bucket beside it the dense rounds make one."""
    red = AutoReducer(AutoOptions(allow=("topk",), min_density=0.1))
    dense = red.sub(DENSE)
    red.assign({"b0": DENSE, "b1": DENSE})
    assert dense.verdict is False
    red.assign({"b0": Method.parse("topk@0.1"), "b1": DENSE})
    assert dense.verdict is True


class _OldFlush(AutoReducer):
    """The A/B reference: the flush as a Top-k round at density 1 through the sparse allgather."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._flush = SparseAllgather(TopKSelector(1.0, min_k=1), self.memory, dense_when_full=False)


FLUSHES = ["topk@0.1", "quant8", "bf16", "none", "quant4", "dgc@0.1", "none", "topk@0.1", "bf16"]


@pytest.mark.parametrize("ranks,device", [(2, False), (3, False), (2, True)])
def test_the_flush_is_one_allreduce_with_the_sparse_flushs_values(ranks, device, monkeypatch):
    """docs/auto-compression.md#flush: the switches to a dense method (steps 2, 3 through the
    quantiser, 6, 8) send ``v + mu*u + g`` whole by one allreduce: what the density-1 Top-k round
    applied and left in the memory, bit for bit (momentum 0.5, integer gradients: every value is
    exact), at the bytes of a dense fp32 round instead of values and int32 indices gathered. Also
    on the device route (no host decision, docs/selection.md#device-route), taken here by host
    memory with the host kernels off (Top-k for DGC there: NumPy has no device route for DGC's
    sampled threshold)."""
    from hvd_commopt.select import kernels
    monkeypatch.setattr(kernels, "HOST_KERNELS", not device)
    keys = [k.replace("dgc", "topk") for k in FLUSHES] if device else FLUSHES
    mu = 0.5

    def body(comm, cls):
        red = cls(AutoOptions(allow=("bf16", "quant8", "quant4", "topk", "dgc"), min_density=0.1,
                              warmup_steps=10 ** 6))
        eng = _engine(comm, red, mu)
        rows = []
        for t, key in enumerate(keys):
            red.assign({b.name: Method.parse(key) for b in eng.buckets})
            before = comm.traffic.bytes_sent
            out = _step(eng, _int(comm.rank, t))
            sd = red.memory.state_dict()
            rows.append((out, _copies(sd.get("momentums", {})), _copies(sd.get("velocities", {})),
                         comm.traffic.bytes_sent - before))
        return rows

    new = run_ranks(ranks, lambda c: body(c, AutoReducer))
    old = run_ranks(ranks, lambda c: body(c, _OldFlush))
    n = sum(int(np.prod(s.shape)) for s in SPECS)
    for r in range(ranks):
        for t, key in enumerate(keys):
            for part in range(3):
                assert new[r][t][part].keys() == old[r][t][part].keys()
                for k in new[r][t][part]:
                    assert new[r][t][part][k].tobytes() == old[r][t][part][k].tobytes(), (t, part, k)
            if t in (2, 6, 8):  # flushes: the bytes of step 3's dense fp32 round, against 8n gathered
                assert new[r][t][3] == new[r][3][3]
                assert old[r][t][3] == 8 * n * (ranks - 1)
        for t in (2, 6, 8):
            for d in (new[r][t][1], new[r][t][2]):
                for v in d.values():
                    assert not np.any(v)


@pytest.mark.parametrize("device", [False, True])
def test_a_flush_round_skipped_for_a_nan_is_owed_again(device, monkeypatch):
    """NaN on rank 1 in the flush round: every rank's result is non-finite, the memory stays as it
    was, and the next round flushes instead of running bf16 over an unsent velocity; from there on
    the run equals one that never had the bad step. On the device route too (the memory flushed
    whatever the data, then rolled back by the settle's flag)."""
    from hvd_commopt.select import kernels
    monkeypatch.setattr(kernels, "HOST_KERNELS", not device)

    def body(comm, skip):
        red = AutoReducer(AutoOptions(allow=("bf16", "topk"), min_density=0.1))
        eng = _engine(comm, red, MU)
        outs = []
        for t, key in enumerate(["topk@0.1", "bf16", "bf16", "bf16"]):
            red.assign({b.name: Method.parse(key) for b in eng.buckets})
            g = _normal(comm.rank, t)
            if t == 1:
                if skip:
                    continue
                if comm.rank == 1:
                    g[eng.buckets[0].names[0]][3] = np.nan
            before = {part: _copies(d) for part, d in red.memory.state_dict().items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # rank 1 names its NaN
                out = _step(eng, g)
            outs.append(out)
            if t == 1:
                assert not all(np.isfinite(v).all() for v in out.values())
                _memory_unchanged(before, red.memory.state_dict())
                assert red._flush_next == {b.name for b in eng.buckets}
        assert not red._flush_next
        return outs

    _equals_the_run_without_step_1(body)
