"""DiLoCo / Streaming DiLoCo and compressed pseudo-gradients (docs/diloco.md#invariants), on
in-process ranks with NumPy tensors (no framework)."""
import copy

import numpy as np
import pytest

from hvd_commopt import Compression, Schedule, run_ranks
from hvd_commopt.compress import TernaryCompressor
from hvd_commopt.errors import ConfigError
from hvd_commopt.memory import ErrorFeedback
from hvd_commopt.reduce import DenseAllreduce
from hvd_commopt.schedule.diloco import fragment_offsets, plan_fragments
from hvd_commopt.schedule.outer import NesterovOuter, OuterOptimizer
from tests.unit.schedule_helpers import OPS, SPECS, NumpyHost, batch, init_params, loss_grads, make_engine, one_step


def train(P, schedule, steps, *, lr=0.1, momentum=0.0, compression=None, finalize=False, identical=False):
    def body(comm):
        host = NumpyHost(init_params(), lr=lr, momentum=momentum)
        eng = make_engine(comm, schedule, host, compression=compression)
        for t in range(steps):
            one_step(eng, host, comm.rank, t, identical=identical)
        if finalize:
            eng.finalize()
        return {k: v.copy() for k, v in host.w.items()}, eng
    return run_ranks(P, body)


# -- configuration --------------------------------------------------------------------------------
def test_defaults_are_diloco_papers():
    c = Schedule.diloco(50)
    assert (c.period, c.outer_lr, c.outer_momentum, c.nesterov, c.outer, c.fragments, c.overlap) == \
        (50, 0.7, 0.9, True, None, 1, 0)


@pytest.mark.parametrize("make, match", [
    (lambda: Schedule.diloco(0), "period must be an integer >= 1"),
    (lambda: Schedule.diloco(10, fragments=3), "does not divide period=10"),
    (lambda: Schedule.diloco(10, fragments=0), "fragments must be an integer >= 1"),
    (lambda: Schedule.diloco(10, overlap=10), "must be smaller than period"),
    (lambda: Schedule.diloco(10, outer=object()), "optimizer class"),
    (lambda: Schedule.diloco(10, outer_lr=0), "outer_lr"),
    (lambda: Schedule.diloco(10, outer_momentum=1.0), "outer_momentum"),
    (lambda: Schedule.diloco(10, outer_kwargs={"lr": 1}), "outer_kwargs configures"),
    (lambda: Compression.quantize(0), "from 2 to 8"),
    (lambda: Compression.quantize(9), "from 2 to 8"),
    (lambda: Compression.quantize(4, density=0), "density"),
])
def test_bad_arguments_name_the_fix(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_too_many_fragments_and_a_foreign_outer_class_are_refused():
    def body(comm):
        with pytest.raises(ConfigError, match="more than the model's 3 parameter tensors"):
            make_engine(comm, Schedule.diloco(4, fragments=4), NumpyHost(init_params()))
        with pytest.raises(ConfigError, match="not an optimizer class this adapter can build"):
            make_engine(comm, Schedule.diloco(4, outer=dict), NumpyHost(init_params()))
    run_ranks(1, body)


# -- invariants -----------------------------------------------------------------------------------
def test_H1_plain_sgd_inside_and_out_equals_ssgd():
    """H = 1, inner SGD, outer lr 1 without momentum: x - mean(lr*g_i) vs x - lr*mean(g_i)."""
    ref = train(2, Schedule.sync(), 8)
    got = train(2, Schedule.diloco(1, outer_lr=1.0, outer_momentum=0.0), 8)
    for (a, _), (b, _) in zip(ref, got):
        for k in a:  # float rounding only: a few ulps of the weights
            np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7)


def test_one_rank_is_the_inner_optimizer_then_the_outer_step():
    H, steps = 3, 6
    (model, eng), = train(1, Schedule.diloco(H), steps, momentum=0.9)
    # by hand: H inner steps of momentum SGD (the host's optimizer), then Nesterov 0.7/0.9 on global - local
    host = NumpyHost(init_params(), lr=0.1, momentum=0.9)
    glob = {k: v.copy() for k, v in host.w.items()}
    outer = NesterovOuter(OPS, 0.7, 0.9, True)
    for t in range(steps):
        host.g = loss_grads(host.w, *batch(0, t))
        host.apply_optimizer()
        if (t + 1) % H == 0:
            delta = {k: glob[k] - host.w[k] for k in glob}
            glob = outer.step(glob, delta)
            for k in glob:
                np.copyto(host.w[k], glob[k])
    for k in model:
        np.testing.assert_array_equal(model[k], host.w[k])
    assert isinstance(eng.scheduler.outer, OuterOptimizer)


def test_nesterov_outer_is_torch_sgd_form():
    w, d = np.float32([1.0, -2.0]), np.float32([0.5, 0.25])
    out = NesterovOuter(OPS, 0.7, 0.9, True).step({"w": w.copy()}, {"w": d.copy()})["w"]
    m = d  # first step: buf = d
    np.testing.assert_array_equal(out, w - np.float32(0.7) * (d + np.float32(0.9) * m))


@pytest.mark.parametrize("sizes, F", [([15, 3, 6], 2), ([1] * 7, 7), ([100, 1, 1, 1], 3), ([5, 5, 5, 5], 2),
                                      ([3, 1000, 2, 2, 7], 4), ([0, 5, 3], 2), ([7, 7, 7], 3), ([2, 3], 2)])
def test_fragments_partition_the_parameters_exactly(sizes, F):
    groups = plan_fragments(sizes, F)
    assert len(groups) == F and all(groups)
    owner = [[None] * n for n in sizes]  # every element of every tensor in exactly one fragment
    for f, g in enumerate(groups):
        assert g == sorted(g)  # pieces in registration order
        for i, start, stop in g:
            assert 0 <= start <= stop <= sizes[i]
            for e in range(start, stop):
                assert owner[i][e] is None
                owner[i][e] = f
    assert all(o is not None for row in owner for o in row)
    total = sum(sizes)  # balanced: no fragment holds more than ceil(N/F) elements
    assert max(sum(stop - start for _, start, stop in g) for g in groups) == -(-total // F)
    assert all(sum(1 for t in g for s in g if s[0] == t[0]) == len(g) for g in groups)  # a tensor once per fragment


def test_only_tensors_that_do_not_fit_are_cut():
    assert plan_fragments([5, 5, 5, 5], 2) == [[(0, 0, 5), (2, 0, 5)], [(1, 0, 5), (3, 0, 5)]]
    assert plan_fragments([15, 3, 6], 2) == [[(0, 0, 12)], [(0, 12, 15), (1, 0, 3), (2, 0, 6)]]


def test_scheduler_fragments_cover_every_element_once():
    def body(comm):
        eng = make_engine(comm, Schedule.diloco(4, fragments=2), NumpyHost(init_params()))
        sizes = {s.name: int(np.prod(s.shape)) for s in SPECS}
        seen = {n: np.zeros(k, int) for n, k in sizes.items()}
        for f in range(2):
            for key in eng.scheduler.fragment_names(f):
                name, _, rng = key.partition("[")
                start, stop = (int(x) for x in rng[:-1].split(":")) if rng else (0, sizes[name])
                seen[name][start:stop] += 1
        assert all((v == 1).all() for v in seen.values())
        return [sum(b.numel for b in eng.scheduler.fragments[f]) for f in range(2)]
    loads = run_ranks(1, body)[0]
    assert max(loads) - min(loads) <= 1


def test_fragment_offsets_are_staggered():
    assert fragment_offsets(12, 1) == [0]
    assert fragment_offsets(12, 3) == [4, 8, 0]


def test_streaming_sends_one_fragment_at_a_time():
    def body(comm):
        host = NumpyHost(init_params())
        eng = make_engine(comm, Schedule.diloco(4, fragments=2, overlap=1), host, fusion_threshold=0)
        sent = []
        for t in range(8):
            before = comm.traffic.bytes_sent
            one_step(eng, host, comm.rank, t)
            eng.drain()
            sent.append(comm.traffic.bytes_sent - before)
        return sent
    sent = run_ranks(2, body)[0]
    # fragment 0 (12 of w's 15 floats) after local steps 2, 6; fragment 1 (w's last 3, v, b: 12
    # floats) after 4, 8: equal messages, each half of the model
    assert [s > 0 for s in sent] == [False, True, False, True] * 2
    assert sent[1] == sent[3] == sent[5] == sent[7]


def test_identical_data_keeps_ranks_identical_and_models_agree_after_finalize():
    for sched in (Schedule.diloco(3), Schedule.diloco(4, fragments=2, overlap=1)):
        outs = train(2, sched, 7, momentum=0.9, finalize=True)
        for k in outs[0][0]:
            np.testing.assert_array_equal(outs[0][0][k], outs[1][0][k])


# -- compressed pseudo-gradients ------------------------------------------------------------------
COMPRESSORS = {
    "topk": lambda: Compression.topk(0.3, min_k=1),
    "gtopk": lambda: Compression.gtopk(0.3, min_k=1),
    "oktopk": lambda: Compression.oktopk(0.3, min_k=1),
    "dgc": lambda: Compression.dgc(0.3, selection="exact"),
    "randomk": lambda: Compression.randomk(0.3, min_k=1),
    "fp16": lambda: Compression.fp16,
    "bf16": lambda: Compression.bf16,
    "ternary": lambda: DenseAllreduce(TernaryCompressor(0.01, 2), ErrorFeedback()),
    "int8": lambda: Compression.quantize(8),
    "int4": lambda: Compression.quantize(4, block=4),
    "sparseloco": lambda: Compression.quantize(2, density=0.3),
    "sparseloco_chunked": lambda: Compression.quantize(2, density=0.3, chunk=4, ef_decay=0.95),
}
AVERAGING = {"local_sgd": lambda: Schedule.local_sgd(2), "cocod": lambda: Schedule.cocod(2),
             "diloco": lambda: Schedule.diloco(2), "streaming": lambda: Schedule.diloco(2, fragments=2, overlap=1)}


@pytest.mark.parametrize("comp", list(COMPRESSORS))
@pytest.mark.parametrize("sched", list(AVERAGING))
def test_every_compressor_composes_with_every_averaging_schedule(comp, sched):
    mu = 0.0 if comp == "dgc" else 0.9  # DGC takes the optimizer's momentum for the warm-up gradients
    outs = train(2, AVERAGING[sched](), 6, momentum=mu, compression=COMPRESSORS[comp](), finalize=True)
    (a, eng), (b, _) = outs
    for k in a:
        assert np.isfinite(a[k]).all()
        np.testing.assert_array_equal(a[k], b[k])  # the ranks agree after finalize
    assert eng.scheduler.pseudo is not None and eng.scheduler.syncs >= 2
    if comp in ("fp16", "bf16", "int8", "int4"):  # dense: close to the uncompressed run
        ref, _ = train(2, AVERAGING[sched](), 6, momentum=mu, finalize=True)[0]
        init = init_params()
        moved = max(np.abs(ref[k] - init[k]).max() for k in ref)
        assert max(np.abs(a[k] - ref[k]).max() for k in a) < 0.05 * moved


def test_lossless_compression_of_the_pseudo_gradient_is_plain_averaging():
    """Top-k at density 1 sends everything: local SGD through pseudo-gradients is the average."""
    ref = train(2, Schedule.local_sgd(2), 6, momentum=0.9)
    got = train(2, Schedule.local_sgd(2), 6, momentum=0.9, compression=Compression.topk(1.0))
    for (a, _), (b, _) in zip(ref, got):
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6)


SCHEDULES = {
    "diloco": (Schedule.diloco(3), None),
    "streaming": (Schedule.diloco(4, fragments=2, overlap=2), None),
    "diloco_topk_int4": (Schedule.diloco(3), lambda: Compression.quantize(4, density=0.5)),
    "sparseloco_chunked_decay": (Schedule.diloco(3, outer_lr=1.0, outer_momentum=0.0),
                                 lambda: Compression.quantize(2, density=0.3, chunk=4, ef_decay=0.95)),
    "diloco_dgc": (Schedule.diloco(2, warmup_steps=1), lambda: Compression.dgc(0.3, selection="exact", momentum=0.9)),  # inner SGD without momentum
    "local_sgd_topk": (Schedule.local_sgd(2), lambda: Compression.topk(0.3, min_k=1)),
    "cocod_int8": (Schedule.cocod(3, warmup_steps=1), lambda: Compression.quantize(8)),
    "ssgd_int4": (Schedule.sync(), lambda: Compression.quantize(4)),
    "ssd_int2": (Schedule.ssd(delay=2, warmup_steps=1), lambda: Compression.quantize(2, block=8)),
}


@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_resume_after_n_steps_is_bit_exact(kind):
    sched, comp = SCHEDULES[kind]
    N, M, mu = 7, 6, (0.0 if "dgc" in kind else 0.9)

    def run(comm, steps, host, ckpt=None, fw=None):
        eng = make_engine(comm, sched, host, compression=comp() if comp else None)
        if ckpt is not None:
            host.restore(fw)
            eng.load_state_dict(ckpt)
        return eng

    def body(comm):
        host = NumpyHost(init_params(), momentum=mu)
        eng = run(comm, 0, host)
        for t in range(N + M):
            one_step(eng, host, comm.rank, t)
        a = {k: v.copy() for k, v in host.w.items()}
        host = NumpyHost(init_params(), momentum=mu)
        eng = run(comm, 0, host)
        for t in range(N):
            one_step(eng, host, comm.rank, t)
        ckpt, fw = copy.deepcopy(eng.state_dict()), host.snapshot()
        host = NumpyHost(init_params(seed=5), momentum=mu)
        eng = run(comm, 0, host, ckpt, fw)
        assert eng.step == N
        for t in range(N, N + M):
            one_step(eng, host, comm.rank, t)
        return a, {k: v.copy() for k, v in host.w.items()}
    for a, c in run_ranks(2, body):
        for k in a:
            np.testing.assert_array_equal(a[k], c[k], err_msg=k)
