"""Rank-side checks of the sparse reducers under a real ``mpirun -np P`` (docs/gtopk.md#invariants).

Launched by tests/parallel/test_run_gtopk.py for P in {2, 3, 4, 5, 6, 8}; every rank runs these
tests and any failing rank fails the job. Outside mpirun (or at size 1) the module is skipped.
"""
from __future__ import annotations

import weakref

import numpy as np
import pytest

from tests.parallel.ranks import gather_rows as _gather_rows, init_comm, require_mpirun

require_mpirun("tests/parallel/test_run_gtopk.py")

from hvd_commopt import Compression, NumpyOps  # noqa: E402
from hvd_commopt.compress.randomk import randomk_indices  # noqa: E402
from hvd_commopt.reduce import DenseAllreduce, ReduceContext  # noqa: E402
from hvd_commopt.reduce.gtopk import gtopk_simulate  # noqa: E402
from tests.reducers import reduce_once, start  # noqa: E402

comm = init_comm()
P, R = comm.size, comm.rank
ops = NumpyOps()
# NumPy tensors need a host-buffer backend (MPI); the torch tests below run on any backend.
host_only = pytest.mark.skipif(comm.buffer_kind != "numpy", reason="NumPy buffers need a host backend (mpi)")


def local_data(step, n, dtype=np.float32, integer=False, rank=R):
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.integers(-40, 41, n) if integer else rng.standard_normal(n) * (1 + rank)
    return x.astype(dtype)


def gather_rows(x):
    """Every rank's 1-D array or tensor (same length), as a P x n stack of the same kind."""
    return _gather_rows(comm, x)


_ROUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_with(red, name, x, post):
    """One round of bucket ``name`` (rounds counted per reducer and bucket, as the engine's steps)."""
    rounds = _ROUNDS.setdefault(red, {})
    step = rounds[name] = rounds.get(name, -1) + 1
    ctx = ReduceContext(comm, ops, 1.0, post)
    residual = getattr(red, "residual", lambda *a: None)  # DenseAllreduce keeps none
    before = residual(ops, name, x)
    before = np.zeros_like(x) if before is None else before.copy()
    p = start(red, name, x.copy(), ctx, step=step)
    out = red.finish(p, ctx)
    after = residual(ops, name, x)
    return before, out, (np.zeros_like(x) if after is None else after.copy()), p.bytes_sent


def gtopk_bytes(k, word=8):
    m = 1 << (P.bit_length() - 1)
    rem, rounds = P - m, m.bit_length() - 1
    if R >= m:
        return k * word
    return rounds * k * word + (k * word + k if R < rem else 0)


@host_only
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "allgather"])
def test_gtopk_equals_oracle_identical_and_conserves(algorithm):
    n, k, steps = 4000, 40, 4
    red = Compression.gtopk(k / n, algorithm=algorithm)
    for s in range(steps):
        x = local_data(s, n)
        before, out, after, sent = step_with(red, "bucket0:w", x, 1.0)
        acc = x + before
        accs = gather_rows(acc)
        leaves = [(i, v) for v, i in (ops.topk_abs(accs[r], k) for r in range(P))]
        I, V, alive = gtopk_simulate(ops, leaves, k)
        ref = np.zeros(n, np.float32)
        ref[I] = V
        assert np.array_equal(out, ref)                                   # T-GT-4, bit-exact
        assert len(np.unique(I)) == len(I) <= k                           # T-GT-2
        assert np.array_equal(gather_rows(out), np.broadcast_to(out, (P, n)))  # T-GT-1
        expect = acc.copy()
        expect[leaves[R][0][alive[R]]] = 0                                # survival mask (docs/gtopk.md#recursive-doubling)
        assert np.array_equal(after, expect)
        if algorithm == "recursive_doubling":
            assert sent == gtopk_bytes(k)                                 # 2k words per round + fold/unfold
        else:
            assert sent == 2 * (P - 1) * k * 4


@host_only
def test_gtopk_conservation_exact_integers():
    n, steps = 1000, 4
    red = Compression.gtopk(0.02)
    for s in range(steps):
        x = local_data(s, n, np.float64, integer=True)
        before, out, after, _ = step_with(red, "b", x, 1.0)
        total_acc = gather_rows(x + before).sum(axis=0)
        total_left = gather_rows(after).sum(axis=0)
        assert np.array_equal(total_acc, out + total_left)               # T-GT-5


@host_only
def test_gtopk_two_ranks_equals_topk_of_sum_and_density_one_is_dense():
    n = 500
    x = local_data(0, n)
    if P == 2:
        k = 10  # below the default floor of 16: the reference rule (min_k=1) is what T-GT-3 states
        _, out, _, _ = step_with(Compression.gtopk(k / n, min_k=1), "b", x, 1.0)
        leaves = [ops.topk_abs(row, k) for row in gather_rows(x)]
        summed = np.zeros(n, np.float32)
        for v, i in leaves:
            np.add.at(summed, i, v)
        v, i = ops.topk_abs(summed, k)
        ref = np.zeros(n, np.float32)
        ref[i] = v
        assert np.array_equal(out, ref)                                   # T-GT-3
    _, dense, _, _ = step_with(DenseAllreduce(), "b", x, 1.0 / P)
    for factory in (Compression.gtopk, Compression.topk, Compression.randomk):
        _, out, after, _ = step_with(factory(1.0), "b", x, 1.0 / P)
        assert np.array_equal(out, dense) and not after.any()             # T-GT-6


@host_only
def test_topk_allgather_average_and_traffic():
    n, k = 3000, 30
    red = Compression.topk(k / n)
    for s in range(3):
        x = local_data(s, n)
        before, out, after, sent = step_with(red, "b", x, 1.0 / P)
        acc = x + before
        ref = np.zeros(n, np.float32)
        for row in gather_rows(acc):
            v, i = ops.topk_abs(row, k)
            np.add.at(ref, i, v)
        np.testing.assert_allclose(out, ref * np.float32(1.0 / P), rtol=1e-6, atol=1e-7)
        assert sent == (P - 1) * k * (4 + 4)
        assert np.array_equal(gather_rows(out), np.broadcast_to(out, (P, n)))


@host_only
def test_randomk_same_indices_on_every_rank():
    n, k = 2000, 20
    red = Compression.randomk(k / n, seed=5)
    for s in range(3):
        x = local_data(s, n)
        before, out, after, sent = step_with(red, "bucket1:b", x, 1.0 / P)
        idx = randomk_indices(5, "bucket1:b", s, n, k)
        assert np.flatnonzero(after == 0).tolist() == idx.tolist()
        np.testing.assert_allclose(out[idx], gather_rows(x + before).sum(axis=0)[idx] / P, rtol=1e-5)
        assert sent == int(2 * (P - 1) / P * k * 4)


@host_only
def test_dgc_ranks_agree():
    n = 50_000
    red = Compression.dgc(0.001, momentum=0.9)
    for s in range(2):
        _, out, after, _ = step_with(red, "b", local_data(s, n), 1.0 / P)
        assert np.array_equal(gather_rows(out), np.broadcast_to(out, (P, n)))
        assert 40 <= n - np.count_nonzero(after) <= 50


@host_only
@pytest.mark.parametrize("comp,mantissa_bits", [(Compression.fp16, 10), (Compression.bf16, 7)])
def test_half_precision_dense_round_trip_over_mpi(comp, mantissa_bits):
    """fp16/bf16 through MPI's half-precision sum ops: float32 back, error of a few half ulps."""
    x = local_data(0, 1000) * 10
    _, out, _, _ = step_with(DenseAllreduce(comp), "b", x, 1.0 / P)
    rows = gather_rows(x).astype(np.float64)
    assert out.dtype == np.float32
    ulp = np.abs(rows).max() / P * 2.0 ** -mantissa_bits  # of the largest predivided input
    np.testing.assert_allclose(out, rows.mean(axis=0), rtol=0, atol=(P + 1) * ulp)


def _torch_ops():
    """(torch, TorchOps()) with one thread per rank; skips without torch."""
    torch = pytest.importorskip("torch")
    from torch_plugin.ops import TorchOps
    torch.set_num_threads(1)
    return torch, TorchOps()


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "allgather"])
def test_torch_gtopk_equals_oracle_on_any_backend(algorithm):
    """TorchOps end to end; under mpi the wire is packed host bytes, under gloo torch tensors."""
    torch, tops = _torch_ops()
    n, k = 3000, 30
    red = Compression.gtopk(k / n, algorithm=algorithm)
    ctx = ReduceContext(comm, tops, 1.0, 1.0)
    for s in range(3):
        x = torch.from_numpy(local_data(s, n))
        before = red.residual(tops, "b", x)
        acc = x + (torch.zeros_like(x) if before is None else before)
        p = start(red, "b", x.clone(), ctx, step=s)
        out = red.finish(p, ctx)
        accs = gather_rows(acc)
        leaves = [(i, v) for v, i in (tops.topk_abs(accs[r], k) for r in range(P))]
        I, V, alive = gtopk_simulate(tops, leaves, k)
        ref = torch.zeros(n).index_add_(0, I, V)
        assert torch.equal(out, ref)
        expect = acc.clone()
        expect[leaves[R][0][alive[R]]] = 0
        assert torch.equal(red.residual(tops, "b", x), expect)
        if algorithm == "recursive_doubling":
            assert p.bytes_sent == gtopk_bytes(k)
        for dtype in (torch.bfloat16,):  # half-precision values on the wire (uint16 bits on hosts)
            h = reduce_once(red, "h", x.clone().to(dtype), ctx, step=s)
            assert h.dtype == dtype and torch.equal(gather_rows(h.float()), h.float().expand(P, n))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_torch_topk_is_one_packed_collective_equal_to_the_oracle_on_any_backend(dtype, index_dtype):
    """Top-k's values and indices as one byte message (docs/topk.md#one-message): under mpi host
    bytes, under gloo torch uint8 tensors; the result bit for bit the scatter-add of every rank's
    top-k, and one collective with the bytes of two allgathers."""
    torch, tops = _torch_ops()
    from torch_plugin.ops import TORCH_DTYPES
    n, k = 3000, 30
    red = Compression.topk(k / n, index_dtype=index_dtype)
    ctx = ReduceContext(comm, tops, 1.0, 1.0)
    rows = [torch.from_numpy(local_data(0, n, rank=r)).to(TORCH_DTYPES[dtype]) for r in range(P)]
    comm.traffic.reset()
    p = start(red, "b", rows[R].clone(), ctx)
    out = red.finish(p, ctx)
    stats = comm.traffic.snapshot()
    leaves = [tops.topk_abs(x, k) for x in rows]
    ref = tops.scatter_add(torch.zeros(n, dtype=TORCH_DTYPES[dtype]), torch.cat([i for _, i in leaves]),
                           torch.cat([v for v, _ in leaves]))
    assert out.dtype == ref.dtype and torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    w = torch.empty(0, dtype=TORCH_DTYPES[dtype]).element_size() + (4 if index_dtype == "int32" else 8)
    assert len(p.handles) == 1 and stats["collectives"] == 1
    assert stats["bytes_sent"] == (P - 1) * k * w == stats["bytes_received"]
