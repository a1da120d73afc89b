"""CUDA streams (docs/backends.md#cuda-streams): on a GPU a bucket is started and finished on the
side stream, a step makes no host synchronisation, allocates no event or stream after the first
step, and gives what the CPU gives. On the CPU: no stream object at all, and a step's results are
unchanged bit for bit with the seam exercised by a host implementation."""
from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import run_ranks  # noqa: E402
from torch_plugin.streams import collective_stream, on_collective_stream, side_stream, streams_for  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine: the side streams are not exercised here")
COMPRESSIONS = {"none": lambda: None, "fp16": lambda: hco.Compression.fp16,
                "topk": lambda: hco.Compression.topk(0.25)}
_INIT: dict = {}


def _model(device):
    if "m" not in _INIT:
        torch.manual_seed(0)
        _INIT["m"] = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return copy.deepcopy(_INIT["m"]).to(device)


def _batch(step, rank, device):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(8, 6, generator=g).to(device), torch.randint(0, 3, (8,), generator=g).to(device)


def _wrap(model, comm, compression):
    kw = {"communicator": comm, "fusion_threshold": 256}  # several buckets
    if compression is not None:
        kw["compression"] = compression
    return hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), **kw)


def _steps(opt, model, rank, device, steps, around_step=None):
    for s in range(steps):
        x, y = _batch(s, rank, device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if around_step is None:
            opt.step()
        else:
            with around_step(s):
                opt.step()


# -- the CPU path -------------------------------------------------------------------------------
class _HostBucketStream:
    """The seam exercised on the host: every call counted, nothing reordered."""

    def __init__(self, calls):
        self.calls = calls

    @contextmanager
    def launch(self, tensors):
        self.calls["launch"] += 1
        yield

    @contextmanager
    def finish(self):
        self.calls["finish"] += 1
        yield

    def hand_over(self, tensors):
        self.calls["hand_over"] += 1


class _HostStreams:
    def __init__(self):
        self.calls = {"launch": 0, "finish": 0, "hand_over": 0}

    def for_bucket(self, bucket):
        return _HostBucketStream(self.calls)


def _train_cpu(compression, with_seam, steps=3):
    _model("cpu")

    def body(comm):
        model = _model("cpu")
        opt = _wrap(model, comm, compression)
        trainer = opt.comm_engine
        assert trainer.engine.streams is None  # host tensors: no stream calls at all
        seam = None
        if with_seam:
            seam = trainer.engine.streams = _HostStreams()
            trainer.set_plan(trainer.plan)  # its buckets' streams, as for a CUDA model
        _steps(opt, model, comm.rank, "cpu", steps)
        return [p.detach().clone() for p in model.parameters()], (dict(seam.calls) if seam else None)
    return run_ranks(2, body)


def test_cpu_parameters_get_no_streams():
    assert streams_for([torch.zeros(2), torch.zeros(3)]) is None
    assert streams_for([]) is None


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_cpu_step_with_the_seam_exercised_is_unchanged_bit_for_bit(name):
    plain = _train_cpu(COMPRESSIONS[name](), False)
    seamed = _train_cpu(COMPRESSIONS[name](), True)
    for (a, _), (b, calls) in zip(plain, seamed):
        assert calls["launch"] == calls["finish"] == calls["hand_over"] > 3  # several buckets, 3 steps
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_on_collective_stream_leaves_host_tensors_alone():
    class Backend:
        @on_collective_stream
        def allreduce_(self, buf, op, name, deadline):
            return buf.add_(1), op, name, deadline
    t = torch.zeros(3)
    out = Backend().allreduce_(t, "sum", "x", deadline=1.0)
    assert out[0] is t and torch.equal(t, torch.ones(3)) and out[1:] == ("sum", "x", 1.0)


# -- the GPU path -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nccl_comm():
    from hvd_commopt.comm import Communicator
    from torch_plugin.comm import TorchDistBackend
    comm = Communicator(TorchDistBackend("nccl", timeout_s=60), timeout_s=60)
    yield comm
    comm.shutdown()


@needs_cuda
@pytest.mark.parametrize("name", ["none", "fp16"])
def test_a_step_makes_no_host_synchronisation(nccl_comm, name):
    model = _model("cuda")
    opt = _wrap(model, nccl_comm, COMPRESSIONS[name]())
    assert opt.comm_engine.engine.streams is not None

    @contextmanager
    def sync_is_an_error(step):
        if step < 2:  # NCCL's communicator is made by the first collectives
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _steps(opt, model, 0, "cuda", 4, sync_is_an_error)
    torch.cuda.synchronize()


@needs_cuda
def test_buckets_run_on_the_side_stream_collectives_on_the_collective_stream(nccl_comm, monkeypatch):
    import torch_plugin.comm as tcomm
    model = _model("cuda")
    opt = _wrap(model, nccl_comm, None)
    seen, issued = [], []
    r = opt.comm_engine.reducer
    start, finish = r.start, r.finish
    r.start = lambda *a: (seen.append(("start", torch.cuda.current_stream())), start(*a))[1]
    r.finish = lambda *a: (seen.append(("finish", torch.cuda.current_stream())), finish(*a))[1]
    all_reduce = tcomm.dist.all_reduce
    monkeypatch.setattr(tcomm.dist, "all_reduce",
                        lambda t, *a, **k: (issued.append((t.is_cuda, torch.cuda.current_stream())),
                                            all_reduce(t, *a, **k))[1])
    compute = torch.cuda.current_stream()
    _steps(opt, model, 0, "cuda", 2)
    device = torch.device("cuda", torch.cuda.current_device())
    side, coll = side_stream(device), collective_stream(device)
    assert len({side, coll, compute}) == 3 and len(seen) >= 4
    assert all(s == side for _, s in seen), seen
    assert issued and all(s == coll for cuda, s in issued if cuda), issued
    assert torch.cuda.current_stream() == compute


@needs_cuda
def test_no_event_or_stream_is_made_after_the_first_step(nccl_comm, monkeypatch):
    model = _model("cuda")
    opt = _wrap(model, nccl_comm, COMPRESSIONS["topk"]())
    _steps(opt, model, 0, "cuda", 2)
    made = []
    event_cls, stream_cls = torch.cuda.Event, torch.cuda.Stream

    class CountingEvent(event_cls):
        def __new__(cls, *a, **k):
            made.append("event")
            return event_cls.__new__(event_cls, *a, **k)

    class CountingStream(stream_cls):
        def __new__(cls, *a, **k):
            made.append("stream")
            return stream_cls.__new__(stream_cls, *a, **k)
    monkeypatch.setattr(torch.cuda, "Event", CountingEvent)
    monkeypatch.setattr(torch.cuda, "Stream", CountingStream)
    _steps(opt, model, 0, "cuda", 3)
    assert made == []


@needs_cuda
@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_gpu_steps_give_what_the_cpu_gives(nccl_comm, name):
    def cpu_body(comm):
        model = _model("cpu")
        opt = _wrap(model, comm, COMPRESSIONS[name]())
        _steps(opt, model, 0, "cpu", 4)
        return [p.detach().clone() for p in model.parameters()]
    _model("cpu")
    cpu = run_ranks(1, cpu_body)[0]
    model = _model("cuda")
    opt = _wrap(model, nccl_comm, COMPRESSIONS[name]())
    _steps(opt, model, 0, "cuda", 4)
    tol = 5e-3 if name == "fp16" else 1e-5  # kernels differ in rounding, nothing else
    for x, y in zip(cpu, model.parameters()):
        torch.testing.assert_close(y.detach().cpu(), x, rtol=tol, atol=tol)
