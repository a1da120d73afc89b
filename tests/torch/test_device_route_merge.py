"""gTop-k and the dense compressors on the device route: with the route forced on CPU
tensors (``select.kernels.HOST_KERNELS = False``) no step waits for the data, and the results are
the host route's, bit for bit (docs/gtopk.md#merge-fixed).

Every aten op that runs in a rank's thread is recorded with a ``TorchDispatchMode``; the ops whose
output shape depends on the data, or that hand a value to the host, are forbidden (FORBIDDEN,
bool-index ``index``/``index_put_``, and ``Tensor.tolist``/``Tensor.numpy``, which do not
dispatch). ``_local_scalar_dense`` (``.item()``, ``bool(t)``) is allowed once per step: the NaN/Inf
decision (as ``torch.amp.GradScaler`` makes).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.compress.ternary import TernaryCompressor  # noqa: E402
from hvd_commopt.memory.error_feedback import ErrorFeedback  # noqa: E402
from hvd_commopt.reduce import DenseAllreduce, GTopK, ReduceContext  # noqa: E402
from hvd_commopt.reduce.gtopk import gtopk_exchange, gtopk_simulate, merge  # noqa: E402
from hvd_commopt.select import kernels as K  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402
from hvd_commopt.reduce.base import RoundInfo  # noqa: E402
from tests.reducers import bucket, start as start_bucket  # noqa: E402
from tests.torch.thread_comms import run_comms, run_links, same_bits, tied_leaves  # noqa: E402

aten = torch.ops.aten
ops = TorchOps()

# ops whose output size depends on the data, or that copy a value to the host
FORBIDDEN = {
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default,
    aten._unique.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor,  # isin may run unique inside
    aten.argwhere.default, aten.repeat_interleave.Tensor, aten.bincount.default,
}
SCALAR = aten._local_scalar_dense.default  # .item(), bool(t), int(t), float(t)


class Recorder(TorchDispatchMode):
    """Every aten op of this thread; ``bad``: the forbidden ones (with why)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []
        self.bad: list[str] = []
        self.scalars = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen.append(func)
        if func in FORBIDDEN:
            self.bad.append(str(func))
        elif func == SCALAR:
            self.scalars += 1
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
                self.bad.append(f"{func} with a bool index")
        elif func in (aten._to_copy.default, aten.copy_.default) and _to_host(func, args, kwargs):
            self.bad.append(f"{func} to the host")
        return func(*args, **kwargs)


def _to_host(func, args, kwargs) -> bool:
    src = args[1] if func == aten.copy_.default else args[0]
    dst = args[0].device if func == aten.copy_.default else kwargs.get("device", src.device)
    return src.device.type != "cpu" and torch.device(dst).type == "cpu"


_ACTIVE = threading.local()


@pytest.fixture
def device_route(monkeypatch):
    """The device route on CPU tensors, and ``tolist``/``numpy`` recorded in recording threads."""
    monkeypatch.setattr(K, "HOST_KERNELS", False)
    for name in ("tolist", "numpy"):
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **kw):
            rec = getattr(_ACTIVE, "rec", None)
            if rec is not None:
                rec.bad.append(f"Tensor.{_name}")
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, wrapped)


def recorded(fn, *args):
    """``fn(*args)`` under a Recorder in this thread: (result, recorder)."""
    rec = Recorder()
    _ACTIVE.rec = rec
    try:
        with rec:
            out = fn(*args)
    finally:
        _ACTIVE.rec = None
    return out, rec


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_gtopk_rounds_are_sync_free_and_equal_the_host_route(device_route, P, dtype, nonfinite):
    n, k = 40, 9
    leaves = tied_leaves(P, n, k, dtype, seed=P * 7 + int(nonfinite), nonfinite=nonfinite)

    def host(link):
        return gtopk_exchange(link, ops, *leaves[link.rank], k, "int32")

    def device(link):
        return recorded(gtopk_exchange, link, ops, *leaves[link.rank], k, "int32", n)

    want, got = run_links(P, host), run_links(P, device)
    for r in range(P):
        (I, V, alive), rec = got[r]
        assert rec.bad == [] and rec.scalars == 0, (r, rec.bad, rec.scalars)
        assert I.equal(want[r][0]) and same_bits(V, want[r][1]), r
        assert alive.dtype == torch.bool and alive.nonzero().reshape(-1).equal(want[r][2]), r
    # and the allgather oracle's simulation of the same tree, on the device route
    (I, V, alive), rec = recorded(gtopk_simulate, ops, leaves, k, n)
    hI, hV, halive = gtopk_simulate(ops, leaves, k)
    assert rec.bad == [] and rec.scalars == 0, rec.bad
    assert I.equal(hI) and same_bits(V, hV)
    assert all(a.nonzero().reshape(-1).equal(h) for a, h in zip(alive, halive))


def test_the_fixed_merge_equals_the_host_merge_on_random_ties():
    rng = np.random.default_rng(5)
    for trial in range(400):
        n = int(rng.integers(2, 50))
        k = int(rng.integers(1, n // 2 + 1))
        dtype = (torch.float32, torch.float64, torch.float16, torch.bfloat16)[trial % 4]
        a, b = [(torch.from_numpy(np.sort(rng.choice(n, k, replace=False)).astype(np.int64)),
                 torch.from_numpy(rng.integers(-2, 3, k).astype(np.float32)).to(dtype)) for _ in range(2)]
        (hI, hV), (dI, dV) = merge(ops, a, b, k), merge(ops, a, b, k, n)
        assert hI.equal(dI) and same_bits(hV, dV), (trial, a, b)


def _finish_and_settle(red, b, rnd, pend, ctx):
    """What the engine does at the step: finish the round, then settle it (where the device route's
    one NaN/Inf decision is read and a non-finite round rolls the memory back)."""
    out = red.finish(pend, ctx)
    red.settle(b, rnd, out, ctx, pend)
    return out


def _rounds(P: int, factory, rows, steps: int, one_round):
    """Each rank: ``steps`` rounds of one bucket through a fresh ``factory()`` reducer; per step
    what ``one_round(red, b, rnd, flat, ctx)`` returns."""
    def body(comm):
        red, res = factory(), []
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / P)
        for s in range(steps):
            flat = rows[s][comm.rank].clone()
            res.append(one_round(red, bucket("b", ops, flat), RoundInfo(s, None), flat, ctx))
        return res
    return run_ranks(P, body)


def _recorded_round(red, b, rnd, flat, ctx):
    """The result, the residual, and the recorder of finish + settle (the selection in ``start``
    is the selection's own route)."""
    pend = red.start(b, rnd, flat, ctx)
    out, rec = recorded(_finish_and_settle, red, b, rnd, pend, ctx)
    r = red.residual(ops, "b", out)
    return out.clone(), None if r is None else r.clone(), rec


def _reduce_ranks(P: int, factory, rows, steps: int = 3):
    """Each rank: ``steps`` rounds of one bucket; per step :func:`_recorded_round`."""
    return _rounds(P, factory, rows, steps, _recorded_round)


def _assert_device_route_equals_host_route(monkeypatch, P: int, factory, rows, steps: int) -> None:
    """Every rank's result and residual at every step, bit for bit, on both routes; on the device
    route no forbidden op and at most one host decision (the NaN/Inf flag) per bucket and step."""
    host = _reduce_ranks(P, factory, rows, steps)
    monkeypatch.setattr(K, "HOST_KERNELS", False)
    dev = _reduce_ranks(P, factory, rows, steps)
    for r in range(P):
        for s in range(steps):
            (ho, hr, _), (do, dr, rec) = host[r][s], dev[r][s]
            assert same_bits(ho, do) and same_bits(hr, dr), (r, s)
            assert rec.bad == [] and rec.scalars <= 1, (r, s, rec.bad, rec.scalars)


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.filterwarnings("ignore:rank .* holds NaN or Inf")
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "allgather"])
def test_gtopk_reducer_device_route_equals_host_route(monkeypatch, P, algorithm):
    n, k, steps = 64, 6, 3
    rng = np.random.default_rng(P)
    rows = [[torch.from_numpy(rng.integers(-4, 5, n).astype(np.float32)) for _ in range(P)] for _ in range(steps)]
    rows[1][P - 1][3] = float("nan")  # a non-finite step: the marker travels, the memory rolls back

    def factory():
        return GTopK(k / n + 1e-9, algorithm=algorithm, min_k=1)
    _assert_device_route_equals_host_route(monkeypatch, P, factory, rows, steps)


@pytest.mark.parametrize("make", [lambda P: DenseAllreduce(Compression.fp16),
                                  lambda P: DenseAllreduce(Compression.bf16),
                                  lambda P: DenseAllreduce()], ids=["fp16", "bf16", "none"])
def test_dense_casts_are_sync_free(device_route, make):
    """fp16/bf16/none: compress, allreduce, decompress: no host decision at all in the rank's thread
    (the reduction itself is the backend's)."""
    P, n = 2, 33
    rows = [torch.linspace(-3, 3, n) * (r + 1) for r in range(P)]

    def body(comm):
        red, ctx = make(P), ReduceContext(comm, ops, 1.0, 1.0 / P)
        pend, rec1 = recorded(start_bucket, red, "b", rows[comm.rank].clone(), ctx)
        out, rec2 = recorded(red.finish, pend, ctx)
        return out, rec1.bad + rec2.bad, rec1.scalars + rec2.scalars
    for out, bad, scalars in run_comms(P, body):
        assert bad == [] and scalars == 0, (bad, scalars)


def test_ternary_with_error_feedback_decides_once_per_step(device_route):
    """CD-SGD's reducer: the signs, theta*s and the residual update stay tensors; the one host
    decision of ``start`` is the NaN/Inf check of the rank's own contribution (the memory must not
    see a non-finite gradient, docs/wrapper.md#nonfinite)."""
    P, n = 2, 33
    rows = [torch.linspace(-3, 3, n) * (r + 1) for r in range(P)]

    def body(comm):
        red = DenseAllreduce(TernaryCompressor(0.5, P), ErrorFeedback())
        ctx = ReduceContext(comm, ops, 1.0, 1.0 / P)
        pend, rec1 = recorded(start_bucket, red, "b", rows[comm.rank].clone(), ctx)
        out, rec2 = recorded(red.finish, pend, ctx)
        ok, rec3 = recorded(red.settle, bucket("b", ops, rows[0]), RoundInfo(0), out, ctx, pend)
        assert ok
        return rec1.bad + rec2.bad + rec3.bad, rec1.scalars + rec2.scalars + rec3.scalars
    for bad, scalars in run_comms(P, body):
        assert bad == [] and scalars <= 1, (bad, scalars)


# -- Ok-Topk (docs/oktopk.md#device-route) ---------------------------------------------------------
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_oktopk_exchange_is_sync_free_and_equals_the_host_route(device_route, P, dtype):
    """The fixed-capacity exchange (an equal-size allgather), the sums and the global top-k: no
    host read at all; the same pairs and region cuts as the host route's exchange, bit for bit,
    with tied magnitudes, -0.0 and +Inf."""
    from hvd_commopt.reduce.oktopk import oktopk_exchange
    from hvd_commopt.reduce.oktopk_device import oktopk_exchange_device
    n, k = 90, 12
    leaves = tied_leaves(P, n, k, dtype, seed=P + 11)
    leaves[0][1][1] = float("inf")

    class HostLink:  # the host route's arrays over the same double
        host = True

        def __init__(self, link):
            self.link, self.rank, self.size = link, link.rank, link.size

        def sendrecv(self, a, dest, source):
            got = self.link.sendrecv(torch.from_numpy(np.ascontiguousarray(a)), dest, source)
            return None if got is None else got.numpy()

        def allreduce_(self, a, op="sum"):
            return self.link.allreduce_(torch.from_numpy(a), op).numpy()

        def allgather(self, a):
            parts = [None] * self.size
            for s in range(1, self.size):
                dest, src = (self.rank + s) % self.size, (self.rank - s) % self.size
                parts[src] = self.sendrecv(a, dest, src)
            parts[self.rank] = a
            return np.concatenate(parts), [int(p.size) for p in parts]

    def host(link):
        i, v = leaves[link.rank]
        # bfloat16 has no host view, so it always takes the device route (the host route's arrays
        # carry its bits as uint16, which its unique_sum adds as integers): its oracle is the host
        # route in float32, exact for these small integers
        v = v.float() if dtype == torch.bfloat16 else v
        I, V, cuts, info = oktopk_exchange(HostLink(link), i.numpy(), ops.to_numpy(v), n, k, None)
        if dtype == torch.bfloat16:
            V = ops.to_numpy(torch.from_numpy(V).to(torch.bfloat16))
        return I, V, cuts, info

    def device(link):
        return recorded(oktopk_exchange_device, link, ops, *leaves[link.rank], n, k, None)

    want, got = run_links(P, host), run_links(P, device)
    for r in range(P):
        (I, V, cuts, _), rec = got[r]
        assert rec.bad == [] and rec.scalars == 0, (r, rec.bad, rec.scalars)
        assert I.numpy().tolist() == want[r][0].tolist(), r
        assert ops.to_numpy(V).tobytes() == np.asarray(want[r][1]).tobytes(), r
        assert cuts.numpy().tolist() == want[r][2].tolist(), r  # the same balanced regions


@pytest.mark.filterwarnings("ignore:rank .* holds NaN or Inf")
@pytest.mark.parametrize("P", [2, 3, 4])
def test_oktopk_reducer_device_route_equals_host_route(monkeypatch, P):
    from hvd_commopt.reduce.oktopk import OkTopK
    n, k, steps = 120, 10, 4
    rng = np.random.default_rng(P + 30)
    rows = [[torch.from_numpy(rng.integers(-4, 5, n).astype(np.float32)) for _ in range(P)] for _ in range(steps)]
    rows[2][0][5] = float("inf")  # a non-finite step

    def factory():
        return OkTopK(k / n + 1e-9, min_k=1, rebalance=2)
    _assert_device_route_equals_host_route(monkeypatch, P, factory, rows, steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("P", [2, 3])
def test_on_cuda_the_rounds_and_oktopk_are_sync_free_and_equal_the_cpu_host_route(P):
    """The same proof on CUDA tensors (the device route is taken by itself there)."""
    from hvd_commopt.reduce.oktopk_device import oktopk_exchange_device
    n, k = 40, 9
    leaves = tied_leaves(P, n, k, torch.float32, seed=P)
    dev = [(i.cuda(), v.cuda()) for i, v in leaves]
    want = run_links(P, lambda link: gtopk_exchange(link, ops, *leaves[link.rank], k, "int32"))
    got = run_links(P, lambda link: recorded(gtopk_exchange, link, ops, *dev[link.rank], k, "int32", n))
    for r in range(P):
        (I, V, _), rec = got[r]
        assert rec.bad == [] and rec.scalars == 0, rec.bad
        assert I.cpu().equal(want[r][0]) and same_bits(V.cpu(), want[r][1])
    got = run_links(P, lambda link: recorded(oktopk_exchange_device, link, ops, *dev[link.rank], n, k, None))
    for r in range(P):
        rec = got[r][1]
        assert rec.bad == [] and rec.scalars == 0, rec.bad  # no host read: the split is a fixed-capacity allgather


@pytest.mark.filterwarnings("ignore:rank .* holds NaN or Inf")
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("reducer", ["gtopk", "oktopk"])
def test_masking_delivered_momentum_device_route_equals_host_route(monkeypatch, P, reducer):
    """With momentum correction, the dropped entries' momentum comes back the same on both routes
    (the device route passes a bool mask, docs/gtopk.md#masking-delivered), a non-finite step included."""
    from hvd_commopt.memory.dgc import DGCMemory
    from hvd_commopt.reduce.oktopk import OkTopK
    n, k, steps = 96, 8, 4
    rng = np.random.default_rng(P + 60)
    rows = [[torch.from_numpy(rng.integers(-4, 5, n).astype(np.float32)) for _ in range(P)] for _ in range(steps)]
    rows[2][0][5] = float("nan")

    def factory():
        mem = DGCMemory(0.9)
        return GTopK(k / n + 1e-9, min_k=1, memory=mem) if reducer == "gtopk" else OkTopK(k / n + 1e-9, min_k=1, memory=mem)

    def momentum_round(red, b, rnd, flat, ctx):
        _finish_and_settle(red, b, rnd, red.start(b, rnd, flat, ctx), ctx)
        return red.memory.state_dict()["momentums"]["b"].clone()

    def momenta():
        return _rounds(P, factory, rows, steps, momentum_round)
    host = momenta()
    monkeypatch.setattr(K, "HOST_KERNELS", False)
    forms = []
    restore = DGCMemory.restore_momentum

    def spy(self, ops_, name, step, dropped):
        forms.append(ops_.dtype_name(dropped))
        return restore(self, ops_, name, step, dropped)
    monkeypatch.setattr(DGCMemory, "restore_momentum", spy)
    dev = momenta()
    assert forms and set(forms) == {"bool"}  # the device route's form was the one exercised
    for r in range(P):
        for s in range(steps):
            assert same_bits(host[r][s], dev[r][s]), (r, s)
