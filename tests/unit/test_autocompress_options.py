"""compression="auto"'s accuracy rule (docs/auto-compression.md#accuracy-floor): the methods chosen
from by default (the casts and the int8/int4 quantisers), the density floor of the sparse methods
named, and the shared memory's momentum: kept where a sparse
method sent (no momentum factor masking), restarted from zero on every rank where a whole bucket
was sent (the flush before a dense round). Exact values."""
from __future__ import annotations

import numpy as np

from hvd_commopt import build_engine, run_ranks
from hvd_commopt.autocompress import DEFAULT_ALLOW, DEFAULT_MIN_DENSITY, AutoOptions, AutoReducer, Method
from hvd_commopt.autocompress.dense import AutoMemory
from hvd_commopt.autocompress.options import DENSITY_GRID
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.numpy_ops import NumpyOps

SPECS = [TensorSpec("l0.w", (300, 1), "float32")]
MU = 0.5


def test_the_default_methods_are_those_within_target_on_every_task():
    """docs/auto-compression.md#accuracy-floor: dense fp32, bf16 and int8 with error feedback, under
    SGD and Adam alike (the candidates of a 1-D bucket or an Adam-type optimizer are the same); no
    int4, 2-bit or sparse method unless named."""
    assert DEFAULT_MIN_DENSITY == 0.1
    assert DEFAULT_ALLOW == ("none", "bf16", "quant8")
    opts = AutoOptions()
    assert opts.densities == (0.1,) and not opts.any_sparse
    assert [m.key for m in opts.candidates()] == ["none", "bf16", "quant8"]
    assert [m.key for m in opts.candidates(sparse_ok=False)] == ["none", "bf16", "quant8"]


def test_sparse_methods_and_lower_densities_stay_the_users_call():
    opts = AutoOptions(allow=("bf16", "topk", "dgc"))
    assert opts.any_sparse
    assert [m.key for m in opts.candidates()] == ["none", "bf16", "topk@0.1", "dgc@0.1"]
    assert [m.key for m in opts.candidates(sparse_ok=False)] == ["none", "bf16"]
    opts = AutoOptions(allow=("bf16", "quant4", "topk", "dgc"), min_density=0.01)
    assert opts.densities == (0.1, 0.03, 0.01)
    assert [m.key for m in opts.candidates()] == ["none", "bf16", "quant4", "topk@0.1", "dgc@0.1", "topk@0.03",
                                                  "dgc@0.03", "topk@0.01", "dgc@0.01"]
    assert AutoOptions(min_density=0.0001).densities == DENSITY_GRID


def test_the_shared_memory_does_not_mask_the_momentum():
    assert AutoMemory().momentum_masking is False


def _grads(rank: int, step: int) -> np.ndarray:
    """Small integers: with momentum 0.5 every value below is exact in float32."""
    return np.random.default_rng(100 * rank + step).integers(-8, 9, size=(300, 1)).astype(np.float32)


def _run(comm, keys):
    red = AutoReducer(AutoOptions(allow=("topk",)))
    eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
    eng.register(SPECS)
    red.memory.bind_momentum(MU)
    rows = []
    for t, key in enumerate(keys):
        red.assign({b.name: Method.parse(key) for b in eng.buckets})
        g = _grads(comm.rank, t)
        for n in eng.backward_names:
            eng.grad_ready(n, g)
        out = {k: np.asarray(v).copy() for k, v in eng.reduce_step().items()}
        sd = red.memory.state_dict()
        rows.append((g.reshape(-1), out["l0.w"].reshape(-1),
                     {k: np.asarray(v).copy() for k, v in sd.get("momentums", {}).items()},
                     {k: np.asarray(v).copy() for k, v in sd.get("velocities", {}).items()}))
    return rows


def test_a_sparse_send_keeps_the_momentum_where_it_sent():
    """One Top-k 10 % round from zero momentum: u = g on each rank, also at the 30 entries sent
    (masking would have zeroed them), and the velocity is g but 0 at exactly those 30."""
    for rows in run_ranks(2, lambda c: _run(c, ["topk@0.1"])):
        g, _, u, v = rows[0]
        (uu,), (vv,) = u.values(), v.values()
        assert uu.tobytes() == g.tobytes()
        assert int(np.count_nonzero(vv != g)) == 30
        assert not np.any(vv[vv != g])


def test_the_flush_to_dense_restarts_every_ranks_momentum_and_the_ranks_agree():
    """Sparse, then dense: the flush sends every velocity and starts each rank's momentum from 0, so
    the dense rounds after it apply ``mu*u + mean(g)`` from the same ``u`` on every rank (the
    momentum kept by sparse rounds differs by rank)."""
    keys = ["topk@0.1", "topk@0.1", "none", "none", "none"]
    res = run_ranks(2, lambda c: _run(c, keys))
    for t in range(len(keys)):
        assert res[0][t][1].tobytes() == res[1][t][1].tobytes()  # every rank applies the same update
    for rows in res:
        for uu in rows[2][2].values():  # after the flush
            assert not np.any(uu)
        for vv in rows[2][3].values():
            assert not np.any(vv)
    # the rounds after the flush: S-SGD's momentum from zero, u = mean(g) then mu*u + mean(g)
    u = np.zeros(300, np.float32)
    for t in (3, 4):
        u = MU * u + (res[0][t][0] + res[1][t][0]) / 2
        assert res[0][t][1].tobytes() == u.tobytes()


def test_dgc_masked_zeroes_the_momentum_where_it_sent_and_only_on_its_buckets():
    """docs/auto-compression.md#dgc-masked: one DGC 10 % round with masking from zero momentum: u = g
    but 0 where the velocity was sent (the same entries), on every rank; a following Top-k round on
    the same bucket keeps the momentum where it sends (no masking)."""
    for rows in run_ranks(2, lambda c: _run(c, ["dgc_masked@0.1", "topk@0.1"])):
        g, _, u, v = rows[0]
        (uu,), (vv,) = u.values(), v.values()
        sent = vv != g
        assert int(np.count_nonzero(sent)) > 0 and not np.any(vv[sent])
        assert not np.any(uu[sent]) and uu[~sent].tobytes() == g[~sent].tobytes()
        g1, _, u1, _ = rows[1]
        (uu1,) = u1.values()
        assert uu1.tobytes() == (MU * uu + g1).astype(np.float32).tobytes()  # Top-k: nothing masked


def test_dgc_masked_is_priced_and_timed_as_dgc():
    from hvd_commopt.autocompress.pricing import allgather_sparse_time, fit_kind
    from hvd_commopt.fusion import AlphaBeta, CostModel
    cost = CostModel(AlphaBeta(1e-4, 1e-8), AlphaBeta(1e-4, 1e-8), None, ranks=2)
    assert fit_kind(Method("dgc_masked", 0.01)) == "dgc"
    assert allgather_sparse_time(Method("dgc_masked", 0.01), 4 << 20, cost) == allgather_sparse_time(
        Method("dgc", 0.01), 4 << 20, cost)
    red = AutoReducer(AutoOptions(allow=("dgc_masked",), min_density=0.01))
    red.assign({"b0": Method("dgc_masked", 0.01), "b1": Method("dgc", 0.01)})
    assert red.memory.masked == frozenset({"b0"})
    red.assign({"b0": Method("none")})
    assert red.memory.masked == frozenset()
