"""The device route makes no host synchronisation (docs/selection.md#device-route), proven on CPU.

The route is forced on CPU tensors (``select.kernels.HOST_KERNELS = False``) with TorchOps' host
shortcuts off (its ``host_view`` and the native index/copy kernels, which only CPU tensors take),
so the step runs the ATen ops a CUDA tensor would. A TorchDispatchMode records every aten op of
real compressed optimizer steps (backward and ``step()``); none of the ops below may appear,
except one ``_local_scalar_dense`` per bucket and step: the NaN/Inf decision that
``torch.amp.GradScaler`` also makes. Host copies do not dispatch, so ``Tensor.tolist/numpy``
and ``torch.from_numpy`` are wrapped too. Then the same steps on the host route must give the
same reduced gradients, weights and residuals bit for bit, on data with ties, -0.0, NaN and Inf.
"""
from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import torch_plugin as hvd  # noqa: E402
import torch_plugin.ops as torch_ops  # noqa: E402
from torch_plugin import sparse_update  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.comm import communicator  # noqa: E402
from hvd_commopt.select import kernels as K  # noqa: E402

aten = torch.ops.aten

# ops whose output shape depends on the data, or that hand a value to the host
FORBIDDEN = {
    aten.nonzero.default, aten.nonzero.out, aten.argwhere.default,
    aten.masked_select.default, aten.masked_select.out, aten.masked_scatter.default, aten.masked_scatter_.default,
    aten.unique_dim.default, aten._unique.default, aten._unique2.default, aten.unique_consecutive.default,
    aten.unique_dim_consecutive.default, aten.repeat_interleave.Tensor,
    aten.is_nonzero.default, aten.equal.default, aten.allclose.default, aten.item.default,
}
SCALAR_READ = aten._local_scalar_dense.default  # .item(), int(t), float(t), bool(t)
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
COPIES = {aten._to_copy.default, aten.copy_.default}


def _is_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class Recorder(TorchDispatchMode):
    """Every aten op dispatched on this thread, and the forbidden ones with the reason."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.bad: list[str] = []
        self.scalar_reads = 0
        self.where: list[str] = []  # the Python frames of each forbidden op or scalar read (a failure names them)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_STATE, "transport", False):
            return func(*args, **kwargs)
        self.ops.append(func)
        if func in FORBIDDEN:
            self.bad.append(str(func))
        elif func is SCALAR_READ:
            self.scalar_reads += 1
            self.where.append(_caller())
        elif func in INDEXING and _is_bool_index(args):
            self.bad.append(f"{func} with a bool index")
        elif func in COPIES:
            src = args[1] if func is aten.copy_.default else args[0]
            dst_dev = kwargs.get("device") if func is aten._to_copy.default else args[0].device
            if dst_dev is not None and torch.device(dst_dev).type == "cpu" and src.device.type != "cpu":
                self.bad.append(f"{func} to the host")
        if self.bad and len(self.where) < len(self.bad) + self.scalar_reads:
            self.where.append(_caller())
        return func(*args, **kwargs)


def _caller() -> str:
    import traceback
    frames = [f for f in traceback.extract_stack()[:-3] if "hvd_commopt" in f.filename or "_plugin" in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                       for f in reversed(frames[-4:]))


# per thread: recording the host copies; inside the transport (a host backend stages through
# host memory by design: to_wire/from_wire, hvd_commopt/comm/traffic.py; NCCL takes the tensor)
_STATE = threading.local()


@pytest.fixture
def host_copies(monkeypatch):
    """Calls of the host copies that do not dispatch (tolist, numpy, from_numpy) on a recording
    thread, outside the transport; and the transport's conversions marked as such."""
    return record_host_copies(monkeypatch)


def record_host_copies(monkeypatch) -> list[str]:
    """:func:`host_copies`' body (other test modules make the fixture from it)."""
    calls: list[str] = []

    def wrap(owner, name, transport=False):
        orig = getattr(owner, name)

        def wrapped(*a, **kw):
            if transport:
                _STATE.transport = True
                try:
                    return orig(*a, **kw)
                finally:
                    _STATE.transport = False
            if getattr(_STATE, "recording", False) and not getattr(_STATE, "transport", False):
                calls.append(name)
            return orig(*a, **kw)
        monkeypatch.setattr(owner, name, wrapped)

    for owner, name in ((torch.Tensor, "tolist"), (torch.Tensor, "numpy"), (torch, "from_numpy")):
        wrap(owner, name)
    for name in ("to_wire", "from_wire"):
        wrap(communicator, name, transport=True)
    return calls


def _route(monkeypatch, device: bool) -> None:
    """The device route on CPU tensors: the selection kernels and the CPU-only shortcuts of the
    torch adapter (host views, native index kernels, the native sparse SGD step) off."""
    monkeypatch.setattr(K, "HOST_KERNELS", not device)
    if device:
        monkeypatch.setattr(torch_ops.TorchOps, "host_view", lambda self, t: None)
        monkeypatch.setattr(torch_ops, "index_host", lambda t, idx: False)
        monkeypatch.setattr(torch_ops, "host_ok", lambda t: False)
        monkeypatch.setattr(sparse_update, "ENABLED", False)  # the native SGD step of CPU parameters


class Direct(torch.nn.Module):
    """loss = sum(W * X): each weight's gradient is exactly its X, so the test writes the data."""

    def __init__(self, shapes):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, xs):
        return sum((w * x).sum() for w, x in zip(self.ws, xs))


SHAPES = [(256, 256), (48, 40)]  # one bucket larger than the exact selection's small_n (the sampled host path)


def _data(step: int, rng, last: int) -> list:
    xs = []
    for s in SHAPES:
        n = int(np.prod(s))
        if step % 2 == 0:
            x = rng.standard_normal(n).astype(np.float32)
        else:  # few distinct magnitudes: ties at the k-th value
            x = rng.integers(-4, 5, n).astype(np.float32) * 0.25
        x[rng.integers(0, n, n // 50)] = -0.0
        if step == last:  # NaN and Inf in the last step (it is skipped and the memory rolled back)
            x[7], x[n // 2], x[n - 3] = np.nan, np.inf, -np.inf
        xs.append(torch.from_numpy(x.reshape(s)))
    return xs


def _bits(t):
    return t.detach().reshape(-1).view(torch.int32).clone()


def _train(comp, momentum: float, steps: int = 5, comm=None, seed: int = 5):
    """Steps of DistributedOptimizer(SGD) on the Direct model (``comm``: a rank of run_ranks);
    per step the reduced gradients, the weights and the residuals (as int bit patterns), and the
    recorders."""
    rng = np.random.default_rng(seed + (comm.rank if comm is not None else 0))
    torch.manual_seed(0)
    model = Direct(SHAPES)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                   model.named_parameters(), compression=comp, fusion_threshold=64 << 20,
                                   communicator=comm)
    return recorded_steps(model, opt, comp, [_data(step, rng, steps - 1) for step in range(steps)])


def host_then_device(monkeypatch, calls: list, run, warns: bool = False) -> tuple:
    """``run()`` on the host route, then on the device route: (the host's result, the device's);
    ``calls`` then holds the device run's host copies only. ``warns``: each run must warn of the
    NaN/Inf step its data holds."""
    def once():
        if not warns:
            return run()
        with pytest.warns(RuntimeWarning, match="NaN or Inf"):
            return run()
    host = once()
    calls.clear()  # the host route may copy
    _route(monkeypatch, device=True)
    return host, once()


def recorded_steps(model, opt, comp, data: list, memory=None, extra=lambda: []) -> tuple[list, list]:
    """One recorded step per inputs in ``data``: per step the reduced gradients, the weights (and
    ``extra()``'s tensors) and the residuals of ``memory`` (default ``comp.memory``), as int bit
    patterns, and the step's :class:`Recorder`."""
    memory = comp.memory if memory is None else memory
    out, recs = [], []
    for xs in data:
        opt.zero_grad()
        rec = Recorder()
        _STATE.recording = True
        try:
            with rec:
                model(xs).backward()
                opt.step()
        finally:
            _STATE.recording = False
        recs.append(rec)
        res = {k: _bits(v) for k, v in memory.residuals().items()}
        out.append(([_bits(p.grad) for p in model.ws], [_bits(p) for p in model.ws] + extra(), res))
    return out, recs


COMPRESSIONS = {
    "topk": (lambda: Compression.topk(0.01, dense_1d=False), 0.0),
    "topk_momentum_correction": (lambda: Compression.topk(0.01, momentum_correction=True, dense_1d=False), 0.9),
    "topk_no_ef": (lambda: Compression.topk(0.01, error_feedback=False, dense_1d=False), 0.0),
    "topk_layerwise": (lambda: Compression.topk(0.01, layerwise=True, dense_1d=False), 0.0),
    "topk_layerwise_momentum_correction": (
        lambda: Compression.topk(0.01, layerwise=True, momentum_correction=True, dense_1d=False), 0.9),
    "topk_threshold_reuse": (lambda: Compression.topk(0.01, selection="threshold", tau=3, dense_1d=False), 0.0),
    "topk_threshold_reuse_momentum_correction": (
        lambda: Compression.topk(0.01, selection="threshold", tau=3, momentum_correction=True, dense_1d=False), 0.9),
    "dgc_sampled": (lambda: Compression.dgc(0.01, dense_1d=False), 0.9),
    "dgc_sampled_no_resample": (lambda: _dgc_no_resample(), 0.9),
    "dgc_uniform_samples": (lambda: _dgc_uniform(), 0.9),
    "topk_sampled": (lambda: Compression.topk(0.01, selection="sampled", dense_1d=False), 0.0),
    "dgc_exact": (lambda: Compression.dgc(0.01, selection="exact", dense_1d=False), 0.0),
    "randomk": (lambda: Compression.randomk(0.3, dense_1d=False), 0.0),
    "randomk_no_ef_unbiased": (lambda: Compression.randomk(0.3, error_feedback=False, unbiased=True,
                                                           dense_1d=False), 0.0),
}
def _dgc_no_resample():
    comp = Compression.dgc(0.01, dense_1d=False)
    comp.compressor.resample = False
    return comp


def _dgc_uniform():
    """DGC with uniform random samples (``strided_sample=False``): drawn by the counter hash on
    the device as on the host (docs/dgc.md#uniform-samples), no upload."""
    comp = Compression.dgc(0.01, dense_1d=False)
    comp.compressor.strided_sample = False
    return comp


STEPS = {"dgc_sampled": 9, "dgc_sampled_no_resample": 9, "dgc_uniform_samples": 9, "topk_threshold_reuse": 9, "topk_threshold_reuse_momentum_correction": 9}  # reused and recomputed steps
# random-k's indices depend on (seed, bucket, step) only: drawn on the host and copied to the
# device (one torch.from_numpy per bucket and step), never read back (docs/selection.md#device-route)
HOST_TO_DEVICE = {"randomk": 1, "randomk_no_ef_unbiased": 1}


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_device_route_step_makes_no_host_sync_and_equals_the_host_route(name, monkeypatch, host_copies):
    make, momentum = COMPRESSIONS[name]
    (host, _), (dev, recs) = host_then_device(monkeypatch, host_copies,
                                              lambda: _train(make(), momentum, STEPS.get(name, 5)), warns=True)
    _check(recs, host_copies, uploads=HOST_TO_DEVICE.get(name, 0))
    if not name.startswith("randomk"):  # the device selection ran
        assert all(aten.topk.default in rec.ops for rec in recs)
    _same(host, dev)


def _check(recs, calls, buckets: int = 1, uploads: int = 0) -> None:
    """No forbidden op, at most one scalar read per bucket and step (one fused bucket: the
    fusion threshold is above the model), no host copy (``uploads``: data-independent
    ``from_numpy`` calls allowed per step)."""
    for step, rec in enumerate(recs):
        assert not rec.bad, (step, rec.bad, rec.where)
        assert rec.scalar_reads <= buckets, (step, rec.scalar_reads, rec.where)
    assert [c for c in calls if c != "from_numpy"] == [], calls
    assert calls.count("from_numpy") <= uploads * len(recs), calls


def _same(host, dev) -> None:
    """Reduced gradients, weights and residuals equal bit for bit, step by step."""
    for step, (h, d) in enumerate(zip(host, dev)):
        for a, b in zip(h[0], d[0]):
            assert torch.equal(a, b), ("reduced gradient", step)
        for a, b in zip(h[1], d[1]):
            assert torch.equal(a, b), ("weights", step)
        assert h[2].keys() == d[2].keys()
        for key in h[2]:
            assert torch.equal(h[2][key], d[2][key]), ("residual", step, key)


@pytest.mark.parametrize("name", ["topk", "topk_momentum_correction", "dgc_uniform_samples"])
def test_device_route_two_ranks_allgather(name, monkeypatch, host_copies):
    """Two in-process ranks: the equal-size allgather of each rank's k pairs, the scatter of both
    ranks' selections, on both ranks equal to the host route (the transport's staging excluded)."""
    make, momentum = COMPRESSIONS[name]

    def body(comm):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return _train(make(), momentum, comm=comm)

    host, dev = host_then_device(monkeypatch, host_copies, lambda: run_ranks(2, body))
    for r in range(2):
        _check(dev[r][1], host_copies)
        _same(host[r][0], dev[r][0])
    for (g0, w0, _), (g1, w1, _) in zip(dev[0][0], dev[1][0]):  # the ranks agree
        assert all(torch.equal(a, b) for a, b in zip(g0 + w0, g1 + w1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_topk_abs_index_equals_the_host_selection_with_ties_and_nan(dtype):
    from hvd_commopt.numpy_ops import NumpyOps
    from hvd_commopt.select.exact_topk import ExactTopK
    ops, rng = torch_ops.TorchOps(), np.random.default_rng(1)
    for n in (40, 5000, 70000):
        x = torch.from_numpy(rng.integers(-6, 7, n).astype(np.float32) * 0.5).to(dtype)
        x[::97], x[3::101], x[5::7] = float("nan"), -float("inf"), -0.0
        for k in (1, 9, n // 10, n - 1, n):
            rec = Recorder()
            with rec:
                idx = ops.topk_abs_index(x, k)
            assert not rec.bad and rec.scalar_reads == 0
            a = x.float().numpy() if dtype == torch.bfloat16 else x.numpy()
            ref = ExactTopK().select(NumpyOps(), a.copy(), k).indices
            assert np.array_equal(idx.numpy(), ref), (n, k)


@pytest.mark.parametrize("strided", [True, False])
@pytest.mark.parametrize("resample", [True, False])
def test_sampled_threshold_on_the_device_equals_the_host_route(resample, strided, monkeypatch, host_copies):
    """DGC's sampled threshold and its adaptation loop (raising and lowering the threshold,
    resampling) select the host route's entries and values, without a host sync or an upload
    (strided samples, or uniform ones drawn by the counter hash); the unused slots of the
    capacity k repeat the first index with +0."""
    from hvd_commopt.compress.dgc import DGCSelector
    from hvd_commopt.select.sampled import sampled_select
    ops, rng = torch_ops.TorchOps(), np.random.default_rng(2)
    for trial in range(6):
        n = int(rng.integers(5000, 120000))
        x = [rng.standard_normal(n), rng.standard_cauchy(n), rng.standard_normal(n) * np.where(
            np.arange(n) < n // 3, 100.0, 1.0)][trial % 3].astype(np.float32)
        c = DGCSelector(0.01, resample=resample, strided_sample=strided)
        hv, hi, _ = sampled_select(c, ops, torch.from_numpy(x.copy()), None, trial)
        with monkeypatch.context() as m:
            _route(m, device=True)
            rec = Recorder()
            t = torch.from_numpy(x.copy())
            _STATE.recording = True
            try:
                with rec:
                    dv, di, _ = sampled_select(c, ops, t, None, trial)
            finally:
                _STATE.recording = False
        assert not rec.bad and rec.scalar_reads == 0 and host_copies == [], (rec.bad, rec.where, host_copies)
        assert di.numel() == c.k_for(n)
        used = torch.cat([torch.tensor([True]), di[1:] != di[0]])
        assert torch.equal(di[used], hi) and torch.equal(dv[used].view(torch.int32), hv.view(torch.int32))
        assert not dv[~used].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("name", ["topk", "topk_momentum_correction", "topk_threshold_reuse", "dgc_sampled"])
def test_cuda_selection_equals_the_host_route(name):
    """On a CUDA tensor (the device route without forcing it) the selection is the host route's."""
    from hvd_commopt.reduce.base import ReduceContext  # noqa: F401 - the reducer's own path is exercised above
    make, _ = COMPRESSIONS[name]
    rng = np.random.default_rng(3)
    ops = torch_ops.TorchOps()
    for step in range(4):
        x = np.concatenate([_data(step, rng, 99)[0].reshape(-1).numpy()])
        host, dev = make(), make()
        hv, hi = host.compressor.select(ops, torch.from_numpy(x.copy()), None, step)
        dv, di = dev.compressor.select(ops, torch.from_numpy(x.copy()).cuda(), None, step)
        di, dv = di.cpu(), dv.cpu()
        used = torch.cat([torch.tensor([True]), di[1:] != di[0]])
        assert torch.equal(di[used], hi) and torch.equal(dv[used].view(torch.int32), hv.view(torch.int32))


@pytest.mark.parametrize("n", [7, 100_003, 3_000_000_007])
def test_uniform_positions_equal_numpys(n):
    """The counter hash's integers on torch (no forbidden op, no scalar read) equal NumPy's."""
    from hvd_commopt.compress.sampling import uniform_positions
    from hvd_commopt.numpy_ops import NumpyOps
    keys = [int(k) for k in np.random.default_rng(n).integers(0, 2 ** 31 - 1, 10)]
    rec = Recorder()
    with rec:
        got = uniform_positions(torch_ops.TorchOps(), n, 5_000, keys, torch.zeros(1))
    assert not rec.bad and rec.scalar_reads == 0
    assert np.array_equal(got.numpy(), uniform_positions(NumpyOps(), n, 5_000, keys, None))
