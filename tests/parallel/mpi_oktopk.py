"""Rank-side checks of Ok-Topk under a real ``mpirun -np P`` (docs/oktopk.md): every rank the same
result, the exact global top-k of the summed local selections, the residual, the traffic.

Launched by tests/parallel/test_oktopk_mpi.py; outside mpirun (or at size 1) skipped."""
from __future__ import annotations

import numpy as np
import pytest

from tests.parallel.ranks import gather_rows, init_comm, require_mpirun

require_mpirun("tests/parallel/test_oktopk_mpi.py")

from hvd_commopt import Compression, NumpyOps  # noqa: E402
from hvd_commopt.fusion.sparse_scaling import hist_bins, oktopk_bytes_per_rank  # noqa: E402
from hvd_commopt.reduce import ReduceContext  # noqa: E402
from tests.reducers import start  # noqa: E402

comm = init_comm()
P, R = comm.size, comm.rank
ops = NumpyOps()


def _rows(x):
    return gather_rows(comm, x)


def _exact_topk_of_sum(I, V, n, k):
    """The exact global top-k of the summed selections (rank order), ties to the lower index."""
    U, S = ops.unique_sum(I, V)
    keys = (S.view(np.int32) & 0x7FFFFFFF).astype(np.int64)
    sel = np.sort(np.lexsort((U, -keys))[:k])
    want = np.zeros(n, np.float32)
    want[U[sel]] = S[sel]
    return want


def test_oktopk_same_result_exact_topk_residual_and_traffic():
    n, d, k = 200_000, 0.01, 2000
    red = Compression.oktopk(d)
    ctx = ReduceContext(comm, ops, 1.0, 1.0)
    rng = np.random.default_rng(5 + R)
    sums = []
    for s in range(4):
        x = rng.integers(-50, 51, n).astype(np.float32) if s % 2 else rng.standard_normal(n).astype(np.float32)
        r0 = red.residual(ops, "b", x)
        acc = x + (0 if r0 is None else r0)
        lv, li = ops.topk_abs(acc, k)
        p = start(red, "b", x.copy(), ctx, step=s)
        out = red.finish(p, ctx).copy()
        outs = _rows(out)
        assert all(np.array_equal(outs[0].view(np.int32), o.view(np.int32)) for o in outs[1:])
        want = _exact_topk_of_sum(_rows(li.astype(np.int64)).reshape(-1), _rows(lv).reshape(-1), n, k)
        assert np.array_equal(out.view(np.int32), want.view(np.int32))
        if s % 2:  # integer data: sent summed over ranks == the result, bit for bit
            sent = _rows(acc - red.residual(ops, "b", x)).sum(axis=0)
            assert np.array_equal(sent, out)
        info = red.last_info["b"]
        exact = info["split_pairs"] * 8 + int(2 * (P - 1) / P * hist_bins(k) * 4) + (P - 1) * info["gathered_pairs"] * 8
        if info["rebalanced"]:
            exact += int(2 * (P - 1) / P * min(64 * P, n) * 8)
        if info["histograms"] == 2:
            exact += int(2 * (P - 1) / P * 256 * 4)
        if info["cut_rows"] >= 0:
            exact += (P - 1) * info["cut_rows"] * 16
        assert p.bytes_sent == exact
        assert p.bytes_sent < 6 * k * 8
        steady = p.bytes_sent - (int(2 * (P - 1) / P * min(64 * P, n) * 8) if info["rebalanced"] else 0)
        if s % 2 == 0:  # the closed form assumes balanced regions: the cuts (from step 0) fit the
            sums.append(sum(comm.allgather_object(steady)))  # normal steps, not the integer ones
    closed = P * oktopk_bytes_per_rank(k, P)
    assert all(abs(t - closed) <= 0.05 * closed for t in sums), (sums, closed)


def test_torch_oktopk_exact_global_topk_on_any_backend():
    """TorchOps end to end; under mpi the wire is host bytes, under gloo the host arrays cross as
    CPU tensors sharing their memory (docs/oktopk.md#backends). Same oracle as above."""
    torch = pytest.importorskip("torch")
    from torch_plugin.ops import TorchOps
    torch.set_num_threads(1)
    tops = TorchOps()

    n, k = 20_000, 200
    red = Compression.oktopk(k / n)
    ctx = ReduceContext(comm, tops, 1.0, 1.0)
    x = torch.from_numpy(np.random.default_rng(11 + R).standard_normal(n).astype(np.float32))
    lv, li = tops.topk_abs(x.clone(), k)
    out = red.finish(start(red, "t", x.clone(), ctx, step=0), ctx).clone()
    outs = _rows(out)
    assert all(torch.equal(outs[0].view(torch.int32), o.view(torch.int32)) for o in outs[1:])
    want = _exact_topk_of_sum(_rows(li.to(torch.int64)).reshape(-1).numpy(), _rows(lv).reshape(-1).numpy(), n, k)
    assert np.array_equal(out.numpy().view(np.int32), want.view(np.int32))
