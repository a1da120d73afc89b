"""CUDA buckets on Gloo through pinned host memory, and the device id the NCCL backend exchanges
(docs/backends.md#cuda-on-gloo, docs/backends.md#one-gpu-per-rank), on a real GPU. The staging's
logic is also checked on CPU tensors against Gloo's allreduce by tests/parallel/mpi_devices.py;
what only a GPU shows (pinned buffers, the copy stream's ordering) is here."""
import datetime

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch_plugin import cuda_staging  # noqa: E402
from torch_plugin.devices import cuda_device_id, rank_cuda_index  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_each_rank_takes_cuda_local_rank():
    assert [rank_cuda_index(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert rank_cuda_index(1, 1) == 0  # one CUDA_VISIBLE_DEVICES entry per rank


@cuda
def test_the_device_id_names_the_gpu():
    d = cuda_device_id(0)
    assert d.index == 0 and d.host and d.device
    assert cuda_device_id(0) == d


@pytest.fixture(scope="module")
def group():
    """A one-rank Gloo group (the staging needs a group; one rank sums to itself)."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
    yield dist.new_group(backend="gloo")
    if own:
        dist.destroy_process_group()


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_staged_allreduce_of_a_cuda_bucket_leaves_it_on_the_device_exactly(monkeypatch, group, dtype):
    monkeypatch.setattr(cuda_staging, "CHUNK_BYTES", 4096)
    st = cuda_staging.HostStaging()
    for step in range(3):  # reuses the pinned buffers
        x = (torch.randn(10_000, device="cuda") * (step + 1)).to(dtype)
        want = x.clone()
        got = st.allreduce_(x, "sum", group, 1, lambda w: w.wait())
        assert got is x and got.is_cuda
        assert torch.equal(got, want)
    (host,) = st.host_buffers()
    assert host.is_pinned() and host.device.type == "cpu" and host.dtype == dtype


@cuda
def test_the_copy_reads_the_bucket_after_the_producing_stream_wrote_it(group):
    st = cuda_staging.HostStaging()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.zeros(1 << 22, device="cuda")
        torch.cuda._sleep(50_000_000)  # the producer is slow ...
        x.add_(1.0)  # ... and writes last
        got = st.allreduce_(x, "sum", group, 1, lambda w: w.wait())
        torch.cuda.current_stream().synchronize()
    assert bool((got == 1.0).all())


def _loopback(log: list):
    """A point-to-point exchange with this process itself: what is sent is what is received (the
    staging's logic without a peer; tests/parallel/mpi_devices.py runs it over Gloo)."""
    sent: list = []

    def p2p(out, into):
        log.append((None if out is None else (out.dtype, out.numel(), out.device.type),
                    None if into is None else (into.dtype, into.numel(), into.device.type)))
        if out is not None:
            sent.append(out.clone())
        if into is not None:
            into.copy_(sent.pop(0))
    return p2p


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("count", [None, 300])
def test_staged_sendrecv_crosses_host_memory_only(device, count):
    """The size first as a host int64 when the receiver does not know it, then the data; Gloo
    (here a loopback) sees host tensors only; the result lands on the sender's device, the host
    buffers reused."""
    st = cuda_staging.HostStaging()
    for step in range(2):
        log: list = []
        x = torch.arange(300, device=device, dtype=torch.float16) * (step + 1)
        got = st.sendrecv(x, True, True, count, _loopback(log))
        assert got.device.type == device and got.dtype == x.dtype and torch.equal(got, x)
        size_msg = [((torch.int64, 1, "cpu"), (torch.int64, 1, "cpu"))] if count is None else []
        assert log == size_msg + [((torch.float16, 300, "cpu"), (torch.float16, 300, "cpu"))]
    assert len(st.host_buffers()) == 2
    log = []
    assert st.sendrecv(x, True, False, None, _loopback(log)) is None  # only sending
    assert log == [((torch.int64, 1, "cpu"), None), ((torch.float16, 300, "cpu"), None)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_staged_varying_allgather_on_one_rank(group, device):
    st = cuda_staging.HostStaging()
    for n in (0, 5, 70_000, 5):
        x = torch.randn(n, device=device)
        got = st.allgather_(x, [n], group, lambda w: w.wait())
        assert got.device.type == device and torch.equal(got, x)
    if device == "cuda":
        assert all(h.is_pinned() for h in st.host_buffers())
