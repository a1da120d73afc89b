"""Rank-side Adasum checks (docs/adasum.md#invariants) under ``mpirun -np P`` (P = 2, 3, 4); run
by test_adasum_mpi.py. Every rank asserts; skipped at size 1."""
import numpy as np
import pytest

from hvd_commopt import NumpyOps, collectives, runtime
from hvd_commopt.reduce import Adasum
from hvd_commopt.reduce.adasum import adasum_tree
from tests.parallel.ranks import require_mpirun

COMM = runtime.init()
P, R = COMM.size, COMM.rank
ops = NumpyOps()
require_mpirun("tests/parallel/test_adasum_mpi.py")


def adasum(v, **kw):
    return collectives.allreduce(COMM, ops, v.copy(), op=Adasum, **kw)


def everyone(v):
    return COMM.allgather_object(v.tobytes())


def test_orthogonal_gradients_are_summed():
    """T-AS-1."""
    v = np.zeros(4 * P + 1, np.float32)
    v[R::P] = np.arange(1, len(v[R::P]) + 1) * (R + 1)
    total = np.zeros_like(v)
    for r in range(P):
        total[r::P] = np.arange(1, len(total[r::P]) + 1) * (r + 1)
    np.testing.assert_array_equal(adasum(v), total)


def test_identical_gradients_are_averaged():
    """T-AS-2."""
    v = np.random.default_rng(7).standard_normal(33).astype(np.float32)
    np.testing.assert_array_equal(adasum(v), v)


@pytest.mark.parametrize("n", [1, 5, 1000])
def test_same_on_every_rank_and_equal_to_the_operator_tree(n):
    """T-AS-3 (and the closed form for P = 2)."""
    vecs = [np.random.default_rng(100 + r).standard_normal(n) for r in range(P)]
    out = adasum(vecs[R])
    assert len(set(everyone(out))) == 1
    np.testing.assert_allclose(out, adasum_tree(ops, [v.copy() for v in vecs], [(0, n)]), rtol=1e-10, atol=1e-12)
    if P == 2:
        a, b = vecs
        d = a @ b
        np.testing.assert_allclose(out, (1 - d / (2 * (a @ a))) * a + (1 - d / (2 * (b @ b))) * b, rtol=1e-10)


def test_torch_optimizer_op_adasum():
    """DistributedOptimizer(op=Adasum), plain SGD: one step moves every rank's weights by
    -lr·adasum(gradients), per tensor."""
    torch = pytest.importorskip("torch")
    import torch_plugin as tp  # noqa: PLC0415
    torch.set_num_threads(1)
    tp.init()
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = tp.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], op=tp.Adasum)
    g = np.zeros(3)
    g[R % 3] = 1.0 + R
    (w * torch.from_numpy(g)).sum().backward()
    opt.step()
    vecs = []
    for r in range(P):
        x = np.zeros(3)
        x[r % 3] = 1.0 + r
        vecs.append(x)
    np.testing.assert_allclose(w.detach().numpy(), -adasum_tree(ops, vecs, [(0, 3)]), rtol=1e-12)
    assert len(set(everyone(w.detach().numpy()))) == 1
