"""compression="auto" at run time: per-bucket routing over one shared memory, switching methods
without losing gradient mass (exactly), and the policy deciding on rank 0 for every rank
(docs/auto-compression.md#shared-memory, docs/auto-compression.md#policy)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from hvd_commopt import Compression, build_engine, run_ranks
from hvd_commopt.autocompress import AutoOptions, AutoReducer, Method
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.fusion.cost_model import AlphaBeta, CostModel
from hvd_commopt.numpy_ops import NumpyOps

SPECS = [TensorSpec(f"l{i}.w", (n, 1), "float32") for i, n in enumerate([300, 500, 200])]
# switches every bucket through every method: sparse -> sparse keeps the memory, sparse -> dense flushes
SCHEDULE = ["none", "topk@0.1", "topk@0.1", "none", "none", "dgc@0.1", "gtopk@0.1", "bf16", "oktopk@0.1",
            "randomk@0.1", "topk@0.1", "none", "dgc_masked@0.1", "dgc_masked@0.1", "topk@0.1", "none", "none"]


def int_grads(rank: int, step: int) -> dict:
    """Small integers: every sum, half and bf16 cast below is exact in float32."""
    rng = np.random.default_rng(100 * rank + step)
    return {s.name: rng.integers(-8, 9, size=s.shape).astype(np.float32) for s in SPECS}


def velocities(eng) -> dict:
    """Each tensor's unsent part (the shared memory's velocity) by tensor name; zeros if none."""
    sd = eng.reducer.memory.state_dict().get("velocities", {})
    out = {}
    for b in eng.buckets:
        flat = np.asarray(sd[b.name]) if b.name in sd else np.zeros(b.numel, np.float32)
        for n, off, shp in zip(b.names, b.offsets, b.shapes):
            out[n] = flat[off:off + int(np.prod(shp))].reshape(shp)
    return out


def test_switching_methods_loses_no_gradient_mass_exactly():
    def body(comm):
        red = AutoReducer(AutoOptions(allow=["bf16", "topk", "dgc", "dgc_masked", "gtopk", "oktopk", "randomk"],
                                      min_density=0.1,
                                      warmup_steps=10 ** 6))
        eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
        eng.register(SPECS)
        sent = {s.name: np.zeros(s.shape, np.float32) for s in SPECS}
        local = {s.name: np.zeros(s.shape, np.float32) for s in SPECS}
        for step, key in enumerate(SCHEDULE):
            red.assign({b.name: Method.parse(key) for b in eng.buckets})
            g = int_grads(comm.rank, step)
            for n in eng.backward_names:
                eng.grad_ready(n, g[n])
                local[n] += g[n]
            out = eng.reduce_step()
            for n in sent:
                sent[n] += np.asarray(out[n]).reshape(sent[n].shape)
        return sent, local, velocities(eng)
    res = run_ranks(2, body)
    (sent0, _, _), (sent1, _, _) = res
    for n in sent0:
        np.testing.assert_array_equal(sent0[n], sent1[n])  # every rank applies the same update
        total = sum(r[1][n] for r in res) / 2            # the average of every gradient ever computed
        unsent = sum(r[2][n] for r in res) / 2
        np.testing.assert_array_equal(sent0[n] + unsent, total)
        np.testing.assert_array_equal(unsent, 0 * unsent)  # the last switch to dense flushed it all


def test_dense_auto_equals_plain_ssgd_bit_for_bit():
    def body(comm, compression):
        eng = build_engine(comm, NumpyOps(), compression=compression, fusion_threshold=0)
        eng.register(SPECS)
        outs = []
        rng = np.random.default_rng(comm.rank)
        for _ in range(3):
            for n in eng.backward_names:
                eng.grad_ready(n, rng.standard_normal((dict((s.name, s.shape) for s in SPECS)[n])).astype(np.float32))
            outs.append({k: np.asarray(v).copy() for k, v in eng.reduce_step().items()})
        return outs
    auto = run_ranks(2, lambda c: body(c, AutoReducer(AutoOptions(warmup_steps=10 ** 6))))[0]
    plain = run_ranks(2, lambda c: body(c, None))[0]
    for a, p in zip(auto, plain):
        for k in a:
            np.testing.assert_array_equal(a[k], p[k])


# 400 KB buckets on a 10 MB/s link: dense is 40 ms per bucket, Top-k at 1 % far less
SLOW = CostModel(AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), AlphaBeta(1e-3, 1e-7), ranks=2)
FAST = CostModel(AlphaBeta(1e-6, 1e-13), AlphaBeta(1e-6, 1e-13), AlphaBeta(1e-6, 1e-13), ranks=2)
BIG = [TensorSpec(f"fc{i}.w", (100, 1000), "float32") for i in range(3)]


def run_policy(comm, cost_model, steps, **kw):
    red = Compression.auto(cost_model=cost_model, **kw)
    eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
    eng.register(BIG)
    rng = np.random.default_rng(comm.rank)
    for _ in range(steps):
        for n in eng.backward_names:
            eng.grad_ready(n, rng.standard_normal((100, 1000)).astype(np.float32))
        eng.reduce_step()
    return eng


def test_policy_decides_on_rank0_and_every_rank_follows():
    def body(comm):  # the link is not slow here: a wide margin keeps the guard from undoing the choice
        eng = run_policy(comm, SLOW, 3 + 5 + 1 + 1 + 5, margin=1e3, allow=("bf16", "topk", "dgc"))
        return {k: m.key for k, m in eng.reducer.assignment.items()}, eng.compression_report
    (a0, rep0), (a1, rep1) = run_ranks(2, body)
    assert a0 == a1 and len(a0) == 3
    chosen = [Method.parse(k) for k in a0.values()]
    assert "none" not in a0.values() and any(m.sparse for m in chosen)  # per bucket: a cast may win one
    assert all(m.density >= 0.01 for m in chosen if m.sparse)
    assert rep0["phase"] == "watch" and rep0["decisions"] == 1
    assert rep0["predicted_s"] < rep0["dense_predicted_s"]
    assert rep0["measured_s"] > 0 and rep0["prediction_error"] is not None
    assert [b["method"] for b in rep0["buckets"]] == [a0[b["bucket"]] for b in rep0["buckets"]]
    assert all(b["why"] for b in rep0["buckets"])


def test_policy_on_a_fast_link_stays_dense():
    def body(comm):
        eng = run_policy(comm, FAST, 3 + 5 + 1)
        return {k: m.key for k, m in eng.reducer.assignment.items()}
    assert set(run_ranks(2, body)[0].values()) == {"none"}


def test_policy_re_decides_when_the_step_disagrees_but_not_before_the_period():
    def body(comm):
        clock = StepClock()
        red = AutoReducer(AutoOptions(cost_model=SLOW, period=3, margin=0.25), clock=clock)
        eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
        eng.register(BIG)
        rng = np.random.default_rng(comm.rank)
        phases = []
        for _ in range(1 + 3 + 5 + 1 + 5 + 3):
            # dense 100 ms, compressed 60 ms: faster than before (kept), far slower than predicted
            clock.t += 0.1 if all(m.kind == "none" for m in red.assignment.values()) else 0.06
            for n in eng.backward_names:
                eng.grad_ready(n, rng.standard_normal((100, 1000)).astype(np.float32))
            eng.reduce_step()
            phases.append(red.policy.phase)
        return phases, red.policy.decisions, red.policy.report
    for phases, decisions, rep in run_ranks(2, body):
        assert decisions == 1 and "reverted" not in rep
        assert phases[-4:] == ["watch", "watch", "watch", "profile"]  # re-profiles after period=3 watched steps


def test_adasum_falls_back_to_dense_with_one_warning():
    def body(comm):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            eng = build_engine(comm, NumpyOps(), compression="auto", op="adasum")
        return eng.reducer.name, [str(x.message) for x in w]
    name, msgs = run_ranks(1, body)[0]
    assert name != "auto" and len(msgs) == 1 and "no compressor applies" in msgs[0]


def test_half_gradients_fall_back_to_dense_with_one_warning():
    specs = [TensorSpec(f"h{i}", (64, 8), "float16") for i in range(2)]

    def body(comm):
        red = Compression.auto(cost_model=SLOW)
        eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
        eng.register(specs)
        for _ in range(3 + 5 + 2 + 6):
            for n in eng.backward_names:
                eng.grad_ready(n, np.ones((64, 8), np.float16))
            eng.reduce_step()
        return {m.key for m in red.assignment.values()}
    with warnings.catch_warnings(record=True) as w:  # around both in-process ranks (threads)
        warnings.simplefilter("always")
        keys = run_ranks(2, body)
    assert keys == [{"none"}, {"none"}]
    msgs = [str(x.message) for x in w if "compression='auto'" in str(x.message)]
    assert len(msgs) == 2 and len(set(msgs)) == 1  # one per rank
    assert "no compressor applies" in msgs[0] and "float16" in msgs[0]


def test_shared_auto_object_gives_each_engine_its_own_state():
    red = Compression.auto()

    def body(comm):
        e1 = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
        e2 = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
        return e1.reducer is not e2.reducer and e2.reducer.policy.reducer is e2.reducer
    assert run_ranks(1, body)[0]


@pytest.mark.parametrize("schedule", ["cd", "local_sgd", "cocod", "diloco"])
def test_schedules_with_their_own_compression_refuse_auto(schedule):
    from hvd_commopt import Schedule
    from hvd_commopt.errors import ConfigError
    sched = Schedule.cd() if schedule == "cd" else getattr(Schedule, schedule)(4)

    def body(comm):
        with pytest.raises(ConfigError, match="drop compression='auto'"):
            build_engine(comm, NumpyOps(), compression="auto", schedule=sched)
        return True
    assert run_ranks(1, body)[0]


def test_checkpoint_keeps_the_choice_and_the_residuals():
    def body(comm):
        def engine():
            red = AutoReducer(AutoOptions(warmup_steps=10 ** 6))
            eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
            eng.register(SPECS)
            return eng
        eng = engine()
        for step, key in enumerate(["topk@0.1", "topk@0.1"]):
            eng.reducer.assign({b.name: Method.parse(key) for b in eng.buckets})
            g = int_grads(comm.rank, step)
            for n in eng.backward_names:
                eng.grad_ready(n, g[n])
            eng.reduce_step()
        eng.reducer.assign({b.name: Method("bf16") for b in eng.buckets})  # decided, not yet run
        sd = eng.state_dict()
        other = engine()
        other.load_state_dict(sd)
        same = {n: np.array_equal(a, velocities(other)[n]) for n, a in velocities(eng).items()}
        return other.reducer.assignment == eng.reducer.assignment, other.reducer._flush_next, same
    for same_choice, flush, same in run_ranks(2, body):
        assert same_choice and all(same.values())
        assert len(flush) == 3  # the switch to bf16 still owes each bucket its flush


class StepClock:
    """A fake clock: each step lasts 10 ms with every bucket dense, 100 ms otherwise (a method the
    link model favours but this machine runs slowly)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_decision_measured_slower_than_before_is_undone_and_not_repeated():
    def body(comm):
        clock = StepClock()
        red = AutoReducer(AutoOptions(cost_model=SLOW, period=3, margin=0.25), clock=clock)
        eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
        eng.register(BIG)
        rng = np.random.default_rng(comm.rank)
        kinds_seen = []
        for _ in range(1 + 3 + 5 + 1 + 5 + 1 + 5 + 3 + 5 + 1):
            clock.t += 0.01 if all(m.kind == "none" for m in red.assignment.values()) else 0.1
            for n in eng.backward_names:
                eng.grad_ready(n, rng.standard_normal((100, 1000)).astype(np.float32))
            eng.reduce_step()
            kinds_seen.append(sorted({m.kind for m in red.assignment.values()}))
        return kinds_seen, red.policy.report, sorted(red.policy._banned)
    (k0, rep0, banned0), (k1, _, banned1) = run_ranks(2, body)
    assert k0 == k1 and banned0 == banned1 and banned0
    assert any(k != ["none"] for k in k0)            # the model chose a sparse method once ...
    assert "reverted" in rep0 or rep0["decisions"] == 2
    first_sparse = next(k for k in k0 if k != ["none"])
    later = k0[k0.index(first_sparse):]
    back = later.index(["none"])                         # ... was undone after its measurement ...
    tried = set(first_sparse) - {"none"}
    assert all((set(k) - {"none"}).isdisjoint(tried) for k in later[back:])  # ... and not repeated


def test_a_revert_that_the_machine_caused_is_withdrawn():
    """The machine slows down (10 ms -> 100 ms a step, whatever the methods) right when the
    decision starts: the guard undoes it, the previous methods measure no faster, so the decision
    comes back and is not banned (docs/auto-compression.md#revert)."""
    def body(comm):
        clock = StepClock()
        red = AutoReducer(AutoOptions(cost_model=SLOW, period=1000, margin=0.25), clock=clock)
        eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
        eng.register(BIG)
        rng = np.random.default_rng(comm.rank)
        slow = False
        kinds_seen = []
        for _ in range(1 + 3 + 5 + 1 + 5 + 1 + 5 + 1 + 5 + 2):
            slow = slow or any(m.kind != "none" for m in red.assignment.values())
            clock.t += 0.1 if slow else 0.01
            for n in eng.backward_names:
                eng.grad_ready(n, rng.standard_normal((100, 1000)).astype(np.float32))
            eng.reduce_step()
            kinds_seen.append(sorted({m.kind for m in red.assignment.values()}))
        return kinds_seen, red.policy.report, sorted(red.policy._banned)
    (k0, rep0, banned0), (k1, _, banned1) = run_ranks(2, body)
    assert k0 == k1 and banned0 == banned1 == []
    first_sparse = next(i for i, k in enumerate(k0) if set(k) - {"none"})
    back = next(i for i in range(first_sparse, len(k0)) if k0[i] == ["none"])  # undone ...
    assert k0[-1] != ["none"] and k0[-1] == k0[first_sparse]                 # ... and restored
    assert "the decision is restored" in rep0["revert_check"] and "reverted" not in rep0
    assert back > first_sparse
