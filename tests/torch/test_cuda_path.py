"""The GPU path: every compressor, reducer and schedule on CUDA tensors gives what it gives on CPU
tensors, its state stays on the device, and the default path (NCCL) never copies a CUDA tensor to
the host. Runs when CUDA is present; otherwise every test is skipped with the reason shown."""
import copy

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine: the GPU path is not exercised here")

COMPRESSIONS = {
    "none": lambda: None,
    "fp16": lambda: hco.Compression.fp16,
    "bf16": lambda: hco.Compression.bf16,
    "topk": lambda: hco.Compression.topk(0.25),
    "randomk": lambda: hco.Compression.randomk(0.25),
    "dgc": lambda: hco.Compression.dgc(0.25, momentum=0.9),
    "gtopk": lambda: hco.Compression.gtopk(0.25),
}
SCHEDULES = {
    "sync": lambda: None,
    "od": lambda: hco.Schedule.od(warmup_steps=1),
    "ssd": lambda: hco.Schedule.ssd(delay=2, warmup_steps=1),
    "cd": lambda: hco.Schedule.cd(warmup_steps=1),
    "cocod": lambda: hco.Schedule.cocod(period=2),
    "local_sgd": lambda: hco.Schedule.local_sgd(period=2),
}
_INIT = {}


def _model(device):
    if "m" not in _INIT:
        torch.manual_seed(0)
        _INIT["m"] = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return copy.deepcopy(_INIT["m"]).to(device)


def _train(device, compression=None, schedule=None, steps=4):
    """Two in-process ranks, each its own batch; returns rank 0's parameters on the CPU."""
    _model("cpu")  # built once, before the threads

    def body(comm):
        model = _model(device)
        kw = {"communicator": comm}
        if compression is not None:
            kw["compression"] = compression
        if schedule is not None:
            kw["schedule"] = schedule
        momentum = 0.0 if compression is not None and "DGC" in type(compression).__name__ else 0.9
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                       named_parameters=model.named_parameters(), **kw)
        for s in range(steps):
            g = torch.Generator().manual_seed(10 * s + comm.rank)
            x, y = torch.randn(8, 6, generator=g).to(device), torch.randint(0, 3, (8,), generator=g).to(device)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        opt.drain() if hasattr(opt, "drain") else None
        assert all(p.device.type == device for p in model.parameters())
        return [p.detach().cpu() for p in model.parameters()], None
    return run_ranks(2, body)


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_every_compressor_and_reducer_on_cuda_matches_cpu(name):
    cpu = _train("cpu", COMPRESSIONS[name]())
    gpu = _train("cuda", COMPRESSIONS[name]())
    tol = 5e-3 if name in ("fp16", "bf16") else 1e-5  # kernels differ in rounding, nothing else
    for (a, _), (b, _) in zip(cpu, gpu):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_on_cuda_matches_cpu(name):
    cpu = _train("cpu", schedule=SCHEDULES[name]())
    gpu = _train("cuda", schedule=SCHEDULES[name]())
    for (a, _), (b, _) in zip(cpu, gpu):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_default_path_on_nccl_never_copies_a_cuda_tensor_to_host(monkeypatch):
    """One process, the backend init() picks with CUDA (nccl: cpu:gloo,cuda:nccl): the dense
    allreduce and its fp16 form hand the CUDA buffer to NCCL as it is."""
    from hvd_commopt.comm import Communicator
    from torch_plugin.comm import TorchDistBackend, native_backend
    assert native_backend() == "nccl"
    comm = Communicator(TorchDistBackend("nccl", timeout_s=60), timeout_s=60)
    try:
        def refuse(*_a, **_k):
            raise AssertionError("a CUDA tensor was copied to host")
        monkeypatch.setattr(hco.TorchOps, "to_numpy", refuse)
        ops = hco.TorchOps()
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            t = torch.arange(10, device="cuda", dtype=dtype)
            out = comm.wait(comm.allreduce_tensor_async(ops, t, "sum", f"t{dtype}"))
            assert out.device.type == "cuda" and torch.equal(out, t)
    finally:
        comm.shutdown()
