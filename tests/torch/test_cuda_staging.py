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
