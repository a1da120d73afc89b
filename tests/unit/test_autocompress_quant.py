"""compression="auto"'s quantisers (docs/auto-compression.md#quantised): int8/int4/2-bit as methods
over the shared memory, their error feedback exact (``sent + velocity == compensated`` bit for bit,
the momentum kept), the switch to dense flushing them, their price (the two phases' bytes plus the
scales: exact alpha-beta sums) and their compute timed like every candidate's."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hvd_commopt import build_engine, run_ranks
from hvd_commopt.autocompress import AutoOptions, AutoReducer, Method
from hvd_commopt.autocompress.decide import Profile, decide
from hvd_commopt.autocompress.dense import AutoMemory
from hvd_commopt.autocompress.local_cost import measure_local_costs
from hvd_commopt.autocompress.methods import build_method
from hvd_commopt.autocompress.pricing import method_costs, quantised_time
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.compress.quantize import decode, encode, encoded_bytes
from hvd_commopt.errors import ConfigError
from hvd_commopt.fusion.cost_model import AlphaBeta, CostModel
from hvd_commopt.numpy_ops import NumpyOps
from hvd_commopt.reduce.quantized import QuantizedAllreduce, split_counts

# distinct alphas and betas, so each term can be told apart
LINK = CostModel(AlphaBeta(0.5, 2.0 ** -10), AlphaBeta(0.25, 2.0 ** -12), None, ranks=2)
MB = 1 << 20
MU = np.float32(0.5)
N = 1000
SPECS = [TensorSpec("l0.w", (N, 1), "float32")]


def test_the_quantisers_are_methods_that_hold_a_residual():
    for kind, bits in (("quant8", 8), ("quant4", 4), ("quant2", 2)):
        m = Method.parse(kind)
        assert (m.key, m.bits, m.quantised, m.sparse, m.holds_residual) == (kind, bits, True, False, True)
    assert [Method(k).bits for k in ("none", "bf16", "fp16")] == [32, 16, 16]
    assert Method("topk", 0.1).holds_residual and not Method("bf16").holds_residual
    # least lossy first: the casts, then int8, int4, 2-bit, then sparse
    keys = ["topk@0.1", "quant2", "bf16", "quant8", "none", "quant4"]
    assert [m.key for m in sorted(map(Method.parse, keys), key=lambda m: m.lossiness)] == \
        ["none", "bf16", "quant8", "quant4", "quant2", "topk@0.1"]


def test_allow_knows_the_quantisers_and_bad_input_is_one_clear_error():
    opts = AutoOptions(allow=["quant4"], min_density=0.5)  # no density on the grid: the quantiser is dense
    assert [m.key for m in opts.candidates()] == ["none", "quant4"]
    # 1-D buckets and Adam-type optimizers (sparse_ok False) keep every dense-shaped method
    assert [m.key for m in AutoOptions(allow=["bf16", "quant8", "topk"]).candidates(sparse_ok=False)] == \
        ["none", "bf16", "quant8"]
    with pytest.raises(ConfigError, match="unknown methods \\['quant3'\\]"):
        AutoOptions(allow=["quant3"])
    with pytest.raises(ConfigError, match="excludes every candidate"):
        AutoOptions(allow=["topk"], min_density=0.5)


def test_a_quantiser_with_a_memory_of_its_own_choosing_is_dense_only():
    with pytest.raises(ConfigError, match="dense exchange only"):
        QuantizedAllreduce(4, density=0.01, memory=AutoMemory())


# -- error feedback over the shared memory, exact -------------------------------------------------
def _floats(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng(100 * rank + step).standard_normal(N).astype(np.float32)


def _first_quantisation(acc: np.ndarray, bits: int, size: int) -> np.ndarray:
    """What each rank sends of ``acc`` (decoded): its P parts quantised one by one."""
    ops, out, off = NumpyOps(), [], 0
    for c in split_counts(acc.size, size):
        out.append(np.asarray(encode(ops, acc[off:off + c], bits, 256)[1]))
        off += c
    return np.concatenate(out)


def _run(comm, keys):
    red = AutoReducer(AutoOptions(allow=("quant8", "quant4", "quant2", "topk"), warmup_steps=10 ** 6))
    eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
    eng.register(SPECS)
    red.memory.bind_momentum(float(MU))
    rows = []
    for t, key in enumerate(keys):
        red.assign({b.name: Method.parse(key) for b in eng.buckets})
        g = _floats(comm.rank, t)
        for n in eng.backward_names:
            eng.grad_ready(n, g.reshape(N, 1))
        out = np.asarray(eng.reduce_step()["l0.w"]).reshape(-1).copy()
        sd = red.memory.state_dict()
        u = [np.asarray(x).copy() for x in sd.get("momentums", {}).values()]
        v = [np.asarray(x).copy() for x in sd.get("velocities", {}).values()]
        rows.append((g, out, u[0] if u else np.zeros(N, np.float32), v[0] if v else np.zeros(N, np.float32)))
    return rows


@pytest.mark.parametrize("kind", ["quant8", "quant4", "quant2"])
def test_the_quantisers_error_feedback_is_exact_and_keeps_the_momentum(kind):
    """Each round, per rank: ``u' = mu*u + g`` (kept: nothing is masked), ``acc = v + u'``, the
    parts of ``acc`` quantised and sent, and the new velocity is ``acc - sent`` with ``sent + v' ==
    acc`` bit for bit; every rank applies the same values, within two quantisations of the mean."""
    bits = Method(kind).bits
    res = run_ranks(2, lambda c: _run(c, [kind] * 4))
    for t in range(4):
        assert res[0][t][1].tobytes() == res[1][t][1].tobytes()
    for rows in res:
        u, v = np.zeros(N, np.float32), np.zeros(N, np.float32)
        for g, _, u_mem, v_mem in rows:
            u = MU * u + g
            acc = v + u
            sent = _first_quantisation(acc, bits, 2)
            assert u_mem.tobytes() == u.tobytes()
            assert v_mem.tobytes() == (acc - sent).tobytes()
            assert (sent + v_mem).tobytes() == acc.tobytes()
            v = v_mem
    # the applied average: the owner's sum of the two first quantisations, quantised once more
    ops = NumpyOps()
    for t in range(4):
        firsts = []
        for rows in res:
            u, v = np.zeros(N, np.float32), np.zeros(N, np.float32)
            for s in range(t + 1):
                u = MU * u + rows[s][0]
                acc = v + u
                v = rows[s][3]
            firsts.append(_first_quantisation(acc, bits, 2))
        total, want, off = firsts[0] + firsts[1], [], 0
        for c in split_counts(N, 2):
            part = total[off:off + c]
            want.append(np.asarray(decode(ops, encode(ops, part, bits, 256)[0], c, bits, 256)))
            off += c
        assert res[0][t][1].tobytes() == (np.concatenate(want) * np.float32(0.5)).tobytes()


def test_switching_through_the_quantisers_keeps_the_velocity_and_the_flush_empties_it():
    """quant8 -> quant4 -> Top-k -> 2-bit -> dense: between residual-holding methods the velocity
    carries on (Top-k's round compensates from the quantiser's residual); the switch to dense sends
    it all (the flush) and restarts every rank's momentum; the ranks agree at every step."""
    keys = ["quant8", "quant4", "topk@0.1", "quant2", "none", "none"]
    res = run_ranks(2, lambda c: _run(c, keys))
    for t in range(len(keys)):
        assert res[0][t][1].tobytes() == res[1][t][1].tobytes()
    for rows in res:
        g2, _, u2, v2 = rows[2]
        acc = rows[1][3] + (MU * rows[1][2] + g2)  # the Top-k round starts from the quantiser's velocity
        assert u2.tobytes() == (MU * rows[1][2] + g2).tobytes()
        sent = v2 != acc
        assert int(np.count_nonzero(sent)) == 100 and not np.any(v2[sent])
        assert not np.any(rows[4][2]) and not np.any(rows[4][3])  # the flush: u and v are zero
    u = np.zeros(N, np.float32)
    u = MU * u + (res[0][5][0] + res[1][5][0]) / 2  # then S-SGD's momentum from zero
    assert res[0][5][1].tobytes() == u.tobytes()


# -- price and compute ------------------------------------------------------------------------------
def test_the_quantiser_is_priced_as_two_allgathers_of_one_quantised_part():
    # 1 MiB = 262144 elements; a part of 131072: 131072 * bits/8 code bytes + 512 float32 scales
    for kind, codes in (("quant8", 131072), ("quant4", 65536), ("quant2", 32768)):
        part = encoded_bytes(131072, Method(kind).bits, 256)
        assert part == codes + 4 * 512
        t = quantised_time(Method(kind), MB, LINK)
        assert t == 2 * (0.25 + part * 2.0 ** -12)
        assert method_costs(Method(kind), MB, LINK, {kind: (1e-9, 1e-4)}) == (1e-4 + 1e-9 * 262144, t)
    # an odd bucket: the larger part, ceil(n / P)
    assert quantised_time(Method("quant8"), 4 * 1001, LINK) == 2 * (0.25 + encoded_bytes(501, 8, 256) * 2.0 ** -12)
    one = CostModel(AlphaBeta(0.5, 1.0), AlphaBeta(0.5, 1.0), None, ranks=1)
    assert quantised_time(Method("quant4"), MB, one) == 0.0 and quantised_time(Method("quant4"), 0, LINK) == 0.0


def test_the_quantisers_compute_is_timed_like_every_candidates():
    """Timed whole on one rank (the owner's decode, sum and second quantisation included: the
    round on one rank runs the whole exchange) and fitted over dense fp32."""
    fits = measure_local_costs(NumpyOps(), np.zeros(1, np.float32), [Method("quant8"), Method("quant4")], 1 << 15,
                               0.9, False, build_method, repeats=1, passes=1)
    assert set(fits) == {"quant8", "quant4"}
    assert all(s >= 0 and c0 >= 0 for s, c0 in fits.values())


def test_one_rank_runs_the_whole_exchange_when_asked():
    ops, x = NumpyOps(), _floats(0, 0)
    from hvd_commopt.buckets import Bucket
    from hvd_commopt.comm.communicator import Communicator
    from hvd_commopt.comm.inproc import InProcBackend, InProcWorld
    from hvd_commopt.reduce.base import ReduceContext, RoundInfo
    comm = Communicator(InProcBackend(InProcWorld(1), 0), timeout_s=10.0)
    try:
        b = Bucket.of(0, [TensorSpec("w", (N, 1), "float32")])
        ctx = ReduceContext(comm, ops)
        once = np.asarray(QuantizedAllreduce(4).reduce(b, RoundInfo(0), x.copy(), ctx))
        whole = np.asarray(QuantizedAllreduce(4, whole_round_alone=True).reduce(b, RoundInfo(0), x.copy(), ctx))
    finally:
        comm.shutdown()
    first = np.asarray(encode(ops, x, 4, 256)[1])
    assert once.tobytes() == first.tobytes()
    summed = np.zeros(N, np.float32) + first  # the owner's sum starts from zeros (-0.0 becomes 0.0)
    assert whole.tobytes() == np.asarray(encode(ops, summed, 4, 256)[1]).tobytes()


def test_a_slow_link_picks_a_quantiser_under_adam_too():
    """Under an Adam-type optimizer the quantisers stay candidates (sparse methods do not): on a
    100 Mbit/s link a 4 MiB bucket goes to the most compact quantiser allowed."""
    link = CostModel.from_link(AlphaBeta(1e-4, 8e-8), 2)
    buckets = [SimpleNamespace(name="a", numel=MB, dtype="float32", dense=False)]
    opts = AutoOptions(allow=["bf16", "quant8", "quant4", "topk"])
    out = decide(buckets, Profile((0.0,), (0.0,), 0.0, 0), [Method("none")], link, opts, lambda ms, top: {},
                 ranks=2, adaptive=True, banned=set(), comm_cpu=1.0)
    assert out["assignment"] == {"a": "quant4"}
    assert out["report"]["adaptive_optimizer"] is True
