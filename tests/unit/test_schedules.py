"""Scheduler state machine and their invariants (T-OD, T-SSD, T-CD, T-CoCoD of docs/README.md#invariant-ids), on in-process
ranks with NumPy tensors (no framework)."""
import copy

import numpy as np
import pytest

from hvd_commopt import Compression, Schedule, build_engine, run_ranks
from hvd_commopt.compress import TernaryCompressor, wire_dtype_for
from hvd_commopt.memory import ErrorFeedback
from hvd_commopt.errors import ConfigError, RankMismatchError
from hvd_commopt.reduce import DenseAllreduce
from hvd_commopt.schedule import CDScheduler
from hvd_commopt.schedule.local_opt import LocalOptimizer
from tests.reducers import start
from tests.unit.schedule_helpers import (OPS, NumpyHost, batch, init_params, loss_grads, make_engine,
                                         mean_in_rank_order, one_step, sgd_step)


def train(P, schedule, steps, *, lr=0.1, momentum=0.0, wd=0.0, identical=False, fusion_threshold=None,
          finalize=False, record=None):
    """Run `steps` steps on P in-process ranks; return per rank (model, replica, host)."""
    def body(comm):
        host = NumpyHost(init_params(), lr=lr, momentum=momentum, wd=wd)
        eng = make_engine(comm, schedule, host, fusion_threshold=fusion_threshold)
        grads = []
        for t in range(steps):
            grads.append(one_step(eng, host, comm.rank, t, identical=identical))
            if record is not None:
                record(comm, eng, host, t)
        if finalize:
            eng.finalize()
        rep = eng.scheduler.global_weights()
        return ({k: v.copy() for k, v in host.w.items()},
                None if rep is None else {k: v.copy() for k, v in rep.items()}, grads, eng.step)
    return run_ranks(P, body)


def assert_same(a, b):
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# -- configuration ------------------------------------------------------------------------------
def test_defaults_are_the_references_with_a_mirroring_local_optimizer():
    od, ssd, cd = Schedule.od(), Schedule.ssd(), Schedule.cd()
    # the local optimizer follows the wrapped one (docs/od-sgd.md#local-defaults)
    for c in (od, ssd, cd):
        assert (c.local_lr, c.local_momentum, c.local_scale) == (None, None, 1.0)
    assert (od.delay, od.warmup_steps, ssd.delay, ssd.warmup_steps, ssd.glu) == (1, 200, 5, 500, 0.0)
    assert (cd.delay, cd.warmup_steps, cd.correction_every, cd.threshold) == (1, 1000, 5, 0.5)
    assert cd.flush_residual_on_correction is False
    od, ssd, cd = Schedule.od(local="reference"), Schedule.ssd(local="reference"), Schedule.cd(local="reference")
    assert (od.local_lr, od.local_momentum, od.local_scale) == (0.1, 0.1, None)
    assert (ssd.local_lr, ssd.local_momentum, ssd.local_scale) == (0.1, 0.0, None)
    assert (cd.local_lr, cd.local_momentum, cd.local_scale) == (0.1, 0.1, None)
    # a value given explicitly overrides the preset
    assert Schedule.od(local="reference", local_momentum=0.5).local_momentum == 0.5
    assert Schedule.cd(threshold=0.5, batch_size=32).theta == 0.5 / 32
    assert Schedule.cocod(4).period == 4 and Schedule.local_sgd(8).kind == "local_sgd"


@pytest.mark.parametrize("make, match", [
    (lambda: Schedule.ssd(delay=-1), "delay must be an integer >= 0"),
    (lambda: Schedule.ssd(delay=2.5), "delay must be an integer"),
    (lambda: Schedule.od(warmup_steps=-3), "warmup_steps"),
    (lambda: Schedule.od(local_lr=-0.1), "local_lr"),
    (lambda: Schedule.od(local_momentum=1.0), "local_momentum"),
    (lambda: Schedule.od(local_scale=0), "local_scale"),
    (lambda: Schedule.od(local_optimizer="adam"), "local_optimizer must be one of"),
    (lambda: Schedule.od(local="paper"), "local must be one of"),
    (lambda: Schedule.ssd(delay=0, glu=0.5), "glu has no effect with delay=0"),
    (lambda: Schedule.ssd(local_optimizer="dcasgd", glu=0.5), "choose one compensation"),
    (lambda: Schedule.cd(correction_every=0), "correction_every"),
    (lambda: Schedule.cd(threshold=0), "threshold"),
    (lambda: Schedule.cd(batch_size=0), "batch_size"),
    (lambda: Schedule.cocod(0), "period must be an integer >= 1"),
    (lambda: Schedule.local_sgd(2, warmup_steps=-1), "warmup_steps"),
])
def test_bad_arguments_name_the_fix(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


@pytest.mark.parametrize("schedule, compression, match", [
    (Schedule.cd(), Compression.fp16, "cd\\(\\) quantizes gradients itself"),
    # averaging schedules take compression (on the pseudo-gradient, tests/unit/test_diloco.py), not Adasum
    (Schedule.cocod(2), "adasum", "does not average"),
    (Schedule.local_sgd(2), "adasum", "does not average"),
    ("ssd", None, "must be a Schedule"),
])
def test_unsupported_combinations_are_refused(schedule, compression, match):
    def body(comm):
        with pytest.raises(ConfigError, match=match):
            if compression == "adasum":
                build_engine(comm, OPS, schedule=schedule, op="adasum")
            else:
                build_engine(comm, OPS, schedule=schedule, compression=compression)
    run_ranks(1, body)


def test_sparse_with_od_and_ssd_is_allowed():  # docs/ssd-sgd.md#sparse-delayed
    for sched in (Schedule.od(), Schedule.ssd()):
        run_ranks(1, lambda comm: build_engine(comm, OPS, schedule=sched, compression=Compression.topk(0.01)))


def test_fp16_with_od_is_allowed():
    run_ranks(1, lambda comm: build_engine(comm, OPS, schedule=Schedule.od(), compression=Compression.fp16))


# -- the state machine --------------------------------------------------------------------------
def test_ssd_state_machine_rounds_names_and_base_switches():
    """k = 3, W = 2: which round is launched, which are applied, when the base switches."""
    log = []

    def record(comm, eng, host, t):
        s = eng.scheduler
        if comm.rank == 0:
                log.append((t, s.outstanding, s.applied, [c["replica"] for c in host.calls[-3:]], len(host.calls)))

    def body(comm):
        host = NumpyHost(init_params())
        eng = make_engine(comm, Schedule.ssd(delay=3, warmup_steps=2, glu=0), host, fusion_threshold=0)
        names = []
        orig = eng.reducer.start

        def spy(bucket, rnd, flat, ctx):
            names.append(rnd.wire(bucket))
            return orig(bucket, rnd, flat, ctx)
        eng.reducer.start = spy
        for t in range(9):
            one_step(eng, host, comm.rank, t)
            record(comm, eng, host, t)
            assert not eng.in_flight  # rounds of earlier steps don't block zero_grad
        return names, max(len(s) for s in eng.engine._pool.spares)
    names, pool = run_ranks(2, body)[0]
    # warm-up steps keep the synchronous names; later rounds are tagged with their step
    assert names[:6] == ["bucket0:v", "bucket1:b", "bucket2:w"] * 2
    assert names[6:9] == ["bucket0:v@r2", "bucket1:b@r2", "bucket2:w@r2"] and names[-1] == "bucket2:w@r8"
    # (step, outstanding after the step, rounds applied to the replica since the switch)
    assert [(t, out, app) for t, out, app, _, _ in log] == [
        (0, 0, 0), (1, 0, 0),          # warm-up: synchronous
        (2, 1, 0),                     # switch at step 2 (t-W = 0): nothing older to apply; round 2 in flight
        (3, 2, 0), (4, 3, 0),          # local steps: rounds pile up (k rounds)
        (5, 1, 3),                     # base switch: rounds 2, 3, 4 applied, round 5 in flight (T-SSD-3)
        (6, 2, 3), (7, 3, 3), (8, 1, 6)]
    assert pool <= 4  # released buffers kept per bucket (NumPy cannot tell a view: never reused)


def test_ssd_base_switch_uses_the_replica_bit_exactly():
    """T-SSD-3: at t with (t-W) % k == 0 the FIFO holds only round t and w_loc(t+1) = U_loc(w_g(t), g)."""
    def body(comm):
        host = NumpyHost(init_params(), lr=0.05)
        sched = Schedule.ssd(delay=2, warmup_steps=1, glu=0, local_lr=0.3, local_momentum=0.0, local_scale=0.5)
        eng = make_engine(comm, sched, host)
        for t in range(7):
            rep_before = {k: v.copy() for k, v in (eng.scheduler.replica or host.w).items()}
            w_before = {k: v.copy() for k, v in host.w.items()}
            g = one_step(eng, host, comm.rank, t)
            if t >= 1 and (t - 1) % 2 == 0:
                assert eng.scheduler.outstanding == 1 and eng.scheduler.fifo[0].step == t
                rep = eng.scheduler.replica  # = w_g(t): all rounds < t applied
                for k in host.w:
                    np.testing.assert_array_equal(host.w[k], rep[k] - np.float32(0.3) * (g[k] * np.float32(0.5)))
            elif t >= 1:  # base = local weights
                for k in host.w:
                    np.testing.assert_array_equal(host.w[k], w_before[k] - np.float32(0.3) * (g[k] * np.float32(0.5)))
                assert all(np.array_equal(rep_before[k], eng.scheduler.replica[k]) for k in rep_before)
    run_ranks(2, body)


# -- OD-SGD invariants ---------------------------------------------------------------------------
def test_T_OD_1_single_rank_equals_plain_sgd_bit_for_bit():
    sched = Schedule.od(warmup_steps=3, local_lr=None, local_momentum=0.0, local_scale=1.0)
    (model, rep, _, _), = train(1, sched, 10, lr=0.1, wd=1e-3)
    (ref, _, _, _), = train(1, Schedule.sync(), 10, lr=0.1, wd=1e-3)
    assert_same(model, ref)
    # the replica lags one step behind: draining it gives the same weights too
    (model2, rep2, _, _), = train(1, sched, 10, lr=0.1, wd=1e-3, finalize=True)
    assert_same(model2, ref)
    assert_same(rep2, ref)


def test_mirroring_local_optimizer_is_plain_momentum_sgd_at_one_rank():
    """The default local optimizer mirrors the wrapped one (docs/od-sgd.md#local-defaults): with no
    warm-up its momentum buffer sees the same gradients as the global one, so at P = 1 OD-SGD's
    local weights are momentum SGD's bit for bit."""
    (ref, _, _, _), = train(1, Schedule.sync(), 10, lr=0.1, momentum=0.9, wd=1e-3)
    (model, _, _, _), = train(1, Schedule.od(warmup_steps=0), 10, lr=0.1, momentum=0.9, wd=1e-3)
    assert_same(model, ref)
    (model, _, _, _), = train(1, Schedule.cd(warmup_steps=0, correction_every=1), 10, lr=0.1, momentum=0.9,
                              wd=1e-3)
    assert_same(model, ref)


def test_T_OD_2_identical_data_reproduces_single_worker_sgd():
    sched = Schedule.od(warmup_steps=2, local_lr=None, local_momentum=0.0, local_scale=1.0)
    (ref, _, _, _), = train(1, Schedule.sync(), 9, identical=True)
    for model, rep, _, _ in train(2, sched, 9, identical=True):
        assert_same(model, ref)  # P = 2: (g + g) / 2 == g exactly
    outs = train(4, sched, 9, identical=True)
    for model, _, _, _ in outs:
        assert_same(model, outs[0][0])
        for k in ref:
            np.testing.assert_allclose(model[k], ref[k], rtol=1e-5, atol=1e-6)  # allreduce rounding


@pytest.mark.parametrize("P", [2, 3])
def test_T_OD_3_delay_disabled_is_ssgd_bit_for_bit(P):
    ref = train(P, Schedule.sync(), 8, momentum=0.9, wd=1e-4)
    got = train(P, Schedule.ssd(delay=0, warmup_steps=2, glu=0), 8, momentum=0.9, wd=1e-4)
    for (a, _, _, _), (b, rep, _, _) in zip(ref, got):
        assert_same(a, b)
        assert_same(a, rep)


def test_T_OD_4_replica_identical_across_ranks_after_every_step():
    digests = {}

    def record(comm, eng, host, t):
        digests.setdefault(t, {})[comm.rank] = eng.scheduler.replica_digest()
    train(3, Schedule.od(warmup_steps=2, check_replica_every=1), 8, momentum=0.9, record=record)
    for t, d in digests.items():
        assert len(set(d.values())) == 1, t
    assert digests[1][0] is None and digests[2][0] is not None


def test_replica_check_detects_a_diverged_rank():
    def body(comm):
        host = NumpyHost(init_params())
        eng = make_engine(comm, Schedule.od(warmup_steps=0, check_replica_every=2), host)
        one_step(eng, host, comm.rank, 0)
        if comm.rank == 1:
            eng.scheduler.replica["w"][0, 0] += 1.0
        one_step(eng, host, comm.rank, 1)
    with pytest.raises(RankMismatchError, match="ranks \\[1\\] differ"):
        run_ranks(2, body)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_T_OD_5_and_T_SSD_2_replica_is_the_replayed_ssgd_update_for_any_k(k):
    """w_g after T steps = S-SGD on the gradients actually produced, whatever k (replay test)."""
    sched = Schedule.ssd(delay=k, warmup_steps=2, glu=0, local_momentum=0.5)
    outs = train(3, sched, 11, momentum=0.9, wd=1e-4, finalize=True)
    W, state = init_params(), {}
    h = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
    for t in range(11):
        sgd_step(W, mean_in_rank_order([o[2][t] for o in outs]), state, h)
    for model, rep, _, _ in outs:
        assert_same(rep, W)
        assert_same(model, W)  # finalize leaves the model at the replica


def test_T_SSD_1_ssd_with_k_1_is_od():
    common = dict(warmup_steps=2, local_lr=0.2, local_momentum=0.1, local_scale=None)
    a = train(2, Schedule.od(**common), 9, momentum=0.9)
    b = train(2, Schedule.ssd(delay=1, glu=0, **common), 9, momentum=0.9)
    for (ma, ra, _, _), (mb, rb, _, _) in zip(a, b):
        assert_same(ma, mb)
        assert_same(ra, rb)


def test_T_SSD_4_zero_local_lr_computes_every_gradient_at_the_last_replica():
    def record(comm, eng, host, t):
        s = eng.scheduler
        if t >= 2 and (t - 2) % 3 == 0:
            record.snap[comm.rank] = {k: v.copy() for k, v in s.replica.items()}
        if t >= 2:
            assert_same(host.w, record.snap[comm.rank])
    record.snap = {}
    train(2, Schedule.ssd(delay=3, warmup_steps=2, local_lr=0.0, glu=0), 10, record=record)


def test_lr_schedule_applies_each_round_with_its_own_step_lr():
    """A round applied k steps late still uses the lr of the step that produced it (as a PS would)."""
    def body(comm):
        host = NumpyHost(init_params(), lr=1.0)
        eng = make_engine(comm, Schedule.ssd(delay=3, warmup_steps=0, glu=0), host)
        for t in range(7):
            host.group["lr"] = 0.1 / (t + 1)  # an LR scheduler
            one_step(eng, host, comm.rank, t)
        eng.drain()
        return [c["lr"] for c in host.calls if c["replica"]]
    assert run_ranks(2, body)[0] == [0.1 / (t + 1) for t in range(7)]


def test_glu_direction_is_the_mean_global_step_of_the_last_period():
    def body(comm):
        host = NumpyHost(init_params(), lr=0.1)
        eng = make_engine(comm, Schedule.ssd(delay=2, warmup_steps=1, glu=0.5), host)
        s = eng.scheduler
        snaps = {}
        for t in range(6):
            one_step(eng, host, comm.rank, t)
            if t in (1, 3, 5):
                snaps[t] = ({k: v.copy() for k, v in s.replica.items()},
                            None if s._glu_dir is None else {k: v.copy() for k, v in s._glu_dir.items()})
        assert snaps[1][1] is None  # first switch: no direction yet
        for k in host.w:
            expect = (snaps[1][0][k] - snaps[3][0][k]) * np.float32(1.0 / (2 * 0.1))
            np.testing.assert_allclose(snaps[3][1][k], expect, rtol=1e-5, atol=1e-7)
    run_ranks(2, body)


def test_dcasgd_compensates_with_the_distance_to_where_the_gradient_was_computed():
    ops = OPS
    opt = LocalOptimizer(ops, "dcasgd", momentum=0.0, scale=0.5, dc_lambda=0.04)
    w = np.array([1.0, 2.0, -1.0], np.float32)
    base = np.array([1.5, 2.0, -0.5], np.float32)
    g = np.array([0.2, -0.4, 1.0], np.float32)
    out = opt.update("x", w.copy(), base, g, lr=0.1)
    gs = g * np.float32(0.5)
    comp = gs + np.float32(0.04) * gs * gs * (base - w)
    np.testing.assert_allclose(out, base - np.float32(0.1) * comp, rtol=1e-6)
    # no base switch: no staleness, no compensation
    np.testing.assert_allclose(opt.update("x", w.copy(), None, g, lr=0.1), w - np.float32(0.1) * gs, rtol=1e-6)


# -- CD-SGD -------------------------------------------------------------------------------------
def test_T_CD_1_correction_every_step_is_od_bit_for_bit():
    common = dict(warmup_steps=2, local_lr=0.2, local_momentum=0.1)
    a = train(3, Schedule.od(**common), 9, momentum=0.9)
    b = train(3, Schedule.cd(correction_every=1, **common), 9, momentum=0.9)
    for (ma, ra, _, _), (mb, rb, _, _) in zip(a, b):
        assert_same(ma, mb)
        assert_same(ra, rb)


def test_T_CD_2_T_CD_3_quantizer_conservation_and_values():
    rs = np.random.RandomState(0)
    for theta in (0.5, 0.25):
        r = (rs.randint(-8, 9, 1000) / 8).astype(np.float32)    # dyadic: every operation exact
        g = (rs.randint(-8, 9, 1000) / 16).astype(np.float32)
        total = r + g
        s, dtype = TernaryCompressor(theta, 2).compress(OPS, total)
        ef = ErrorFeedback()
        ef.update_quantized(OPS, "b", total.copy(), TernaryCompressor(theta, 2).decompress(OPS, s, dtype))
        r_new = ef.residual(OPS, "b", total)
        assert s.dtype == np.int8 and set(np.unique(s)) <= {-1, 0, 1}        # q in {-theta, 0, theta}
        np.testing.assert_array_equal(r_new + s.astype(np.float32) * np.float32(theta), total)  # r' + q == r + g
        assert np.all((s == 1) == (total >= theta)) and np.all((s == -1) == (total <= -theta))


@pytest.mark.parametrize("theta, exact", [(0.5, True), (0.3, False)])
def test_T_CD_4_int8_sum_equals_fp32_dequantize_then_sum(theta, exact):
    P = 5

    def body(comm):
        red = DenseAllreduce(TernaryCompressor(theta, comm.size), ErrorFeedback())
        ctx_post = 1.0 / comm.size
        from hvd_commopt.reduce.base import ReduceContext
        ctx = ReduceContext(comm, OPS, 1.0, ctx_post)
        g = np.random.RandomState(comm.rank).randn(257).astype(np.float32)
        pend = start(red, "bucket0:x", g.copy(), ctx, step=7, tag="r7")
        assert pend.state.payload.dtype == np.int8 and pend.handles[0].name == "bucket0:x@r7"
        s = np.sign(g) * (np.abs(g) >= theta)
        out = red.finish(pend, ctx)
        return out, s.astype(np.float32), pend.bytes_sent
    res = run_ranks(P, body)
    ref = np.zeros(257, np.float32)
    for _, s, _ in res:  # the server: dequantize each worker's q = theta*s, sum in fp32, rescale
        ref += s * np.float32(theta)
    ref *= np.float32(1.0 / P)
    for out, _, sent in res:
        if exact:
            np.testing.assert_array_equal(out, ref)
        else:
            np.testing.assert_allclose(out, ref, rtol=4 * np.finfo(np.float32).eps, atol=1e-7)
        assert sent == int(2 * (P - 1) / P * 257)  # one byte per element on the wire


def test_int8_overflow_guard():
    assert wire_dtype_for(127) == "int8" and wire_dtype_for(128) == "int16"
    assert wire_dtype_for(40000) == "int32"


@pytest.mark.parametrize("flush", [False, True])
def test_T_CD_5_residual_on_correction_steps(flush):
    def body(comm):
        host = NumpyHost(init_params())
        eng = make_engine(comm, Schedule.cd(warmup_steps=1, correction_every=3, threshold=0.01,
                                            flush_residual_on_correction=flush), host)
        s: CDScheduler = eng.scheduler
        seen = []
        for t in range(8):
            before = {k: v.copy() for k, v in s.ternary.memory.residuals().items()}
            one_step(eng, host, comm.rank, t)
            after = s.ternary.memory.residuals()
            if t >= 1 and t % 3 == 0:  # a correction round (t = 3, 6)
                seen.append(t)
                for k in after:
                    if flush:
                        assert not after[k].any()
                    elif k in before:
                        np.testing.assert_array_equal(after[k], before[k])
            elif t >= 1:
                assert after and any(not np.array_equal(after[k], before.get(k, 0 * after[k])) for k in after)
        assert seen == [3, 6]
    run_ranks(2, body)


# -- CoCoD-SGD and local SGD ----------------------------------------------------------------------
@pytest.mark.parametrize("schedule", [Schedule.cocod(3), Schedule.local_sgd(2), Schedule.cocod(1, warmup_steps=2)])
def test_T_CoCoD_1_identical_data_reproduces_single_worker_sgd(schedule):
    (ref, _, _, _), = train(1, Schedule.sync(), 10, momentum=0.9, identical=True)
    for model, _, _, _ in train(2, schedule, 10, momentum=0.9, identical=True, finalize=True):
        assert_same(model, ref)  # P = 2: x/2 + x/2 == x, and x + (z - s) == x when z == s
    outs = train(4, schedule, 10, momentum=0.9, identical=True)
    for model, _, _, _ in outs:
        assert_same(model, outs[0][0])
        for k in ref:
            np.testing.assert_allclose(model[k], ref[k], rtol=1e-5, atol=1e-6)


def test_T_CoCoD_2_T_CoCoD_4_conservation_and_first_sync():
    tau, P = 2, 3

    def body(comm):
        host = NumpyHost(init_params(), momentum=0.5)
        eng = make_engine(comm, Schedule.cocod(tau), host)
        hist = []
        for t in range(7):
            g = loss_grads(host.w, *batch(comm.rank, t))
            host.g = g
            for n in eng.backward_names:
                eng.grad_ready(n, g[n])
            before_step = {k: v.copy() for k, v in host.w.items()}
            eng.run_step()
            # the local step alone (what the model would be without the sync)
            local = copy.deepcopy(before_step)
            sgd_step(local, g, copy.deepcopy(hist[-1][2]) if hist else {}, host.group)
            hist.append(({k: v.copy() for k, v in host.w.items()}, local, copy.deepcopy(host.state)))
        return hist
    res = run_ranks(P, body)
    # first sync (after step index 1): x unchanged
    for hist in res:
        assert_same(hist[1][0], hist[1][1])
    # sync n = 2 (after step index 3): mean_i x_i = xbar^{n-1} + mean_i(delta_i), delta_i = x_i^n - s_i
    xbar_prev = {k: np.mean([h[1][1][k] for h in res], axis=0) for k in res[0][1][0]}
    mean_after = {k: np.mean([h[3][0][k] for h in res], axis=0) for k in xbar_prev}
    mean_delta = {k: np.mean([h[3][1][k] - h[1][0][k] for h in res], axis=0) for k in xbar_prev}
    for k in xbar_prev:
        np.testing.assert_allclose(mean_after[k], xbar_prev[k] + mean_delta[k], rtol=1e-5, atol=1e-6)


def test_local_sgd_tau_1_without_momentum_is_ssgd():
    ref = train(2, Schedule.sync(), 6, momentum=0.0)
    got = train(2, Schedule.local_sgd(1), 6, momentum=0.0)
    for (a, _, _, _), (b, _, _, _) in zip(ref, got):
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_cocod_and_local_sgd_send_no_gradients():
    def body(comm):
        host = NumpyHost(init_params())
        eng = make_engine(comm, Schedule.cocod(4, warmup_steps=1), host)
        base = comm.traffic.collectives
        counts = []
        for t in range(5):
            one_step(eng, host, comm.rank, t)
            eng.drain()
            counts.append(comm.traffic.collectives - base)
        return counts
    # one warm-up gradient allreduce (one bucket), then nothing until the averaging after 4 local steps
    assert run_ranks(2, body)[0] == [1, 1, 1, 1, 2]


# -- checkpoint / resume --------------------------------------------------------------------------
SCHEDULES = {
    "od": Schedule.od(warmup_steps=2),
    "ssd": Schedule.ssd(delay=3, warmup_steps=2),
    "ssd_glu": Schedule.ssd(delay=3, warmup_steps=2, glu=0.5),
    "ssd_dc": Schedule.ssd(delay=2, warmup_steps=1, glu=0, local_optimizer="dcasgd", local_momentum=0.3),
    "cd": Schedule.cd(warmup_steps=2, correction_every=3, threshold=0.02),
    "cocod": Schedule.cocod(3, warmup_steps=1),
    "local_sgd": Schedule.local_sgd(2),
}


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_resume_after_n_steps_is_bit_exact(kind):
    sched, N, M = SCHEDULES[kind], 7, 6

    def body(comm):
        # A: uninterrupted
        host = NumpyHost(init_params(), momentum=0.9, wd=1e-4)
        eng = make_engine(comm, sched, host)
        for t in range(N + M):
            one_step(eng, host, comm.rank, t)
        a = {k: v.copy() for k, v in host.w.items()}
        # B: checkpoint after N steps (state_dict drains), continue in the same process
        host = NumpyHost(init_params(), momentum=0.9, wd=1e-4)
        eng = make_engine(comm, sched, host)
        for t in range(N):
            one_step(eng, host, comm.rank, t)
        ckpt = copy.deepcopy(eng.state_dict())
        fw = host.snapshot()
        for t in range(N, N + M):
            one_step(eng, host, comm.rank, t)
        b = {k: v.copy() for k, v in host.w.items()}
        # C: a fresh process resumes from the checkpoint
        host = NumpyHost(init_params(seed=5), momentum=0.9, wd=1e-4)
        eng = make_engine(comm, sched, host)
        host.restore(fw)
        eng.load_state_dict(ckpt)
        assert eng.step == N
        for t in range(N, N + M):
            one_step(eng, host, comm.rank, t)
        c = {k: v.copy() for k, v in host.w.items()}
        return a, b, c
    for a, b, c in run_ranks(2, body):
        assert_same(a, b)
        assert_same(a, c)


def test_checkpoint_of_another_schedule_is_refused():
    def body(comm):
        host = NumpyHost(init_params())
        eng = make_engine(comm, Schedule.od(warmup_steps=0), host)
        one_step(eng, host, comm.rank, 0)
        sd = eng.state_dict()
        other = make_engine(comm, Schedule.cocod(2), NumpyHost(init_params()))
        with pytest.raises(ConfigError, match="written with schedule 'od'"):
            other.load_state_dict(sd)
    run_ranks(1, body)


def test_finalize_leaves_the_model_at_the_drained_replica():
    outs = train(2, Schedule.ssd(delay=4, warmup_steps=1), 8, finalize=True)
    for model, rep, _, _ in outs:
        assert_same(model, rep)
    assert_same(outs[0][0], outs[1][0])


def test_set_plan_mid_training_drains_first():
    def body(comm):
        host = NumpyHost(init_params())
        eng = make_engine(comm, Schedule.ssd(delay=3, warmup_steps=0, glu=0), host)
        for t in range(2):
            one_step(eng, host, comm.rank, t)
        assert eng.scheduler.outstanding == 2
        eng.set_plan([[0], [1], [2]])
        assert eng.scheduler.outstanding == 0
        for t in range(2, 6):
            one_step(eng, host, comm.rank, t)
    run_ranks(2, body)


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("mu,damp,nesterov,wd", [(0.0, 0.0, False, 0.0), (0.9, 0.0, False, 0.0),
                                                 (0.9, 0.1, False, 1e-3), (0.9, 0.0, True, 0.0)])
@pytest.mark.parametrize("kind", ["sgd", "dcasgd"])
def test_local_update_is_the_closed_form_and_leaves_the_gradient_alone(scale, mu, damp, nesterov, wd, kind):
    """The local step (docs/od-sgd.md#update-rule) against its formula in the same operation order,
    bit for bit, over steps with and without a base; the gradient passed in is never written (the
    default path reads it in place instead of copying it)."""
    rng = np.random.default_rng(3)
    lo = LocalOptimizer(OPS, kind, mu, scale, dc_lambda=0.04)
    w = rng.standard_normal(50).astype(np.float32)
    ref_w, ref_m = w.copy(), None
    for step in range(6):
        g = rng.standard_normal(50).astype(np.float32)
        g_before = g.copy()
        base = rng.standard_normal(50).astype(np.float32) if step % 2 else None
        b = ref_w if base is None else base
        d = g * np.float32(scale) if scale != 1.0 else g.copy()
        if kind == "dcasgd" and base is not None:
            d = d + np.float32(0.04) * ((d * d) * (base - ref_w))
        if wd:
            d = d + np.float32(wd) * b
        if mu:
            ref_m = d.copy() if ref_m is None else ref_m * np.float32(mu) + np.float32(1.0 - damp) * d
            d = d + np.float32(mu) * ref_m if nesterov else ref_m
        ref_w = b + np.float32(-0.1) * d
        w = lo.update("p", w, base, g, lr=0.1, weight_decay=wd, momentum=mu, dampening=damp, nesterov=nesterov)
        np.testing.assert_array_equal(g, g_before)
        np.testing.assert_array_equal(w, ref_w)
