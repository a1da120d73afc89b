"""Rank-side checks of DiLoCo and the quantiser; run by test_diloco_mpi.py under
``mpirun -np P python -m pytest``. Every rank asserts; skipped at size 1."""
import io

import numpy as np
import pytest
import torch

import torch_plugin as hco
from hvd_commopt import NumpyOps, Schedule, runtime
from hvd_commopt.buckets import Bucket
from hvd_commopt.compress.quantize import levels
from hvd_commopt.reduce import QuantizedAllreduce, ReduceContext, RoundInfo
from tests.parallel.mpi_schedules import make_model, params, same, same_on_all_ranks, train
from tests.parallel.ranks import require_mpirun

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
require_mpirun("tests/parallel/test_diloco_mpi.py")

ADAMW = lambda ps: torch.optim.AdamW(ps, lr=0.01)  # noqa: E731
PLAIN = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731


def test_H1_plain_outer_equals_ssgd_up_to_rounding():
    ref, _ = train(None, 6, PLAIN, finalize=False)
    got, _ = train(Schedule.diloco(1, outer_lr=1.0, outer_momentum=0.0), 6, PLAIN)
    for a, b in zip(params(got), params(ref)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("schedule, comp", [
    (Schedule.diloco(3), None),
    (Schedule.diloco(4, fragments=2, overlap=1), None),
    (Schedule.diloco(3), lambda: hco.Compression.quantize(4, density=0.1)),
    (Schedule.diloco(3), lambda: hco.Compression.topk(0.1)),
    (Schedule.local_sgd(2), lambda: hco.Compression.quantize(8)),
    (Schedule.cocod(2), lambda: hco.Compression.quantize(2)),
    (Schedule.diloco(3), lambda: hco.Compression.quantize(2, density=0.1, chunk=16, ef_decay=0.95,
                                                         mean_over="senders")),
], ids=["diloco", "streaming", "diloco_sparseloco4", "diloco_topk", "local_sgd_int8", "cocod_int2",
        "diloco_sparseloco_chunked_senders"])
def test_ranks_agree_after_finalize_and_resume_is_bit_exact(schedule, comp):
    kw = {"compression": comp()} if comp else {}
    model, opt = train(schedule, 7, ADAMW, finalize=False, **kw)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    a, aopt = train(schedule, 5, ADAMW, model=model, opt=opt, start=7)
    model2 = make_model(seed=1)
    opt2 = hco.DistributedOptimizer(ADAMW(model2.parameters()), named_parameters=model2.named_parameters(),
                                    schedule=schedule, **({"compression": comp()} if comp else {}))
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    b, _ = train(schedule, 5, ADAMW, model=model2, opt=opt2, start=7)
    assert same(params(a), params(b))
    assert same_on_all_ranks(params(a))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantised_reduce_scatter_allgather_is_two_quantisations(bits):
    ops, n = NumpyOps(), 4099
    xs = [(np.random.RandomState(r).randn(n) * (1 + r)).astype(np.float32) for r in range(P)]
    red = QuantizedAllreduce(bits, error_feedback=False)
    out = red.reduce(Bucket.single("q", n, "float32"), RoundInfo(0), xs[R].copy(),
                     ReduceContext(runtime.communicator(), ops))
    q = levels(bits)
    exact = np.sum(xs, axis=0, dtype=np.float64)
    first = sum(np.abs(x).max() for x in xs) / (2 * q)
    assert np.abs(out - exact).max() <= (first + (np.abs(exact).max() + first) / (2 * q)) * (1 + 1e-5)
    everyone = hco.allgather(torch.from_numpy(out).reshape(1, -1))
    assert all(torch.equal(everyone[0], everyone[r]) for r in range(P))


def test_quantised_gradients_under_ssgd_track_the_dense_run():
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    ref, _ = train(None, 6, sgd, finalize=False)
    got, _ = train(None, 6, sgd, finalize=False, compression=hco.Compression.quantize(8))
    for a, b in zip(params(got), params(ref)):
        torch.testing.assert_close(a, b, rtol=0, atol=3e-3)
    assert same_on_all_ranks(params(got))
