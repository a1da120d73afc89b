"""Rank-side checks of the one-GPU-per-rank check's wiring and of the host-staged Gloo allreduce,
allgathers and point-to-point exchanges (docs/backends.md#one-gpu-per-rank, docs/backends.md#cuda-on-gloo); run by test_devices_mpi.py
under ``mpirun -np 2`` with HVD_COMMOPT_BACKEND=gloo. Without a GPU the device ids are the
test's own (check_one_gpu_per_rank takes this rank's id as an argument) and the staging runs on
CPU tensors (its logic is the same; only the streams and the pinning are CUDA's)."""
import pytest
import torch
import torch.distributed as dist

import torch_plugin as hco
from hvd_commopt.comm.device_owners import DeviceId
from hvd_commopt.errors import ConfigError
from tests.parallel.ranks import require_mpirun
from torch_plugin import cuda_staging
from torch_plugin.devices import check_one_gpu_per_rank, exchange_device_ids

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
require_mpirun("tests/parallel/test_devices_mpi.py")
GROUP = dist.group.WORLD


def test_ids_are_exchanged_in_rank_order():
    ids = exchange_device_ids(GROUP, DeviceId(f"host{R}", f"GPU-{R}", R))
    assert ids == [DeviceId(f"host{r}", f"GPU-{r}", r) for r in range(P)]
    assert exchange_device_ids(GROUP, None if R else DeviceId("h", "GPU-0", 0)) == [DeviceId("h", "GPU-0", 0)] + [None] * (P - 1)


def test_one_gpu_per_rank_passes_on_every_rank():
    check_one_gpu_per_rank(GROUP, DeviceId("h", f"GPU-{R}", R))


def test_ranks_sharing_a_gpu_get_one_error_naming_the_fix_on_every_rank():
    with pytest.raises(ConfigError) as e:
        check_one_gpu_per_rank(GROUP, DeviceId("h", "GPU-0", 0))
    assert f"{P} ranks would share one GPU" in str(e.value) and "CUDA_VISIBLE_DEVICES" in str(e.value)
    dist.barrier(group=GROUP)  # both ranks got here: nothing hangs after the error


def _row(n, dtype, seed):
    g = torch.Generator().manual_seed(seed * 100 + R)
    return (torch.randn(n, generator=g) * 1e3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("n", [1, 1000, 4099])
def test_staged_allreduce_equals_glooss_bit_for_bit(monkeypatch, dtype, op, n):
    monkeypatch.setattr(cuda_staging, "CHUNK_BYTES", 1024)  # several chunks in flight
    if dtype is torch.bfloat16 and op != "sum":
        pytest.skip("the half-precision pair sum is what this dtype is here for")
    staging = cuda_staging.HostStaging()
    for seed in range(2):  # the second round reuses the host buffers
        x = _row(n, dtype, seed)
        want = x.float().clone() if dtype is torch.bfloat16 else x.clone()
        # Gloo's own result (bf16: the sum of two bf16 in float32, rounded once, is what Gloo gives)
        dist.all_reduce(want, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=GROUP)
        want = want.to(dtype)
        got = staging.allreduce_(x, op, GROUP, P, lambda w: w.wait())
        assert got is x
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32)), (dtype, op, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 1000])
def test_staged_equal_allgather_equals_glooss(dtype, n):
    """The sparse paths' equal-size allgather through host memory: every rank's part, in rank
    order, bit for bit, the host buffers reused on the second round."""
    staging = cuda_staging.HostStaging()
    for seed in range(2):
        x = _row(n, torch.float32, seed).to(dtype)
        want = torch.empty(P * n, dtype=dtype)
        dist.all_gather_into_tensor(want, x, group=GROUP)
        gather, done = staging.gather_equal(x, P, GROUP, lambda out: out)
        gather().wait()
        got = done()
        assert got.dtype == dtype and torch.equal(got, want), (dtype, n)
    assert len(staging.host_buffers()) == 2  # this rank's part and the gathered one, kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sizes", [(5, 5), (3, 1000), (0, 7), (0, 0)])
def test_staged_varying_allgather_equals_glooss(dtype, sizes):
    """The variable-size allgather through host memory: every rank's part, in rank order, bit for
    bit, with the counts; the host buffers reused on the second round."""
    staging = cuda_staging.HostStaging()
    for seed in range(2):
        x = _row(sizes[R % 2], torch.float32, seed).to(dtype)
        counts = [sizes[r % 2] for r in range(P)]
        parts = [torch.empty(c, dtype=dtype) for c in counts]
        dist.all_gather(parts, x, group=GROUP) if len(set(counts)) == 1 else _gather_varying(parts, x, counts)
        got = staging.allgather_(x, counts, GROUP, lambda w: w.wait())
        assert got.dtype == dtype and torch.equal(got, torch.cat(parts)), (dtype, sizes)


def _gather_varying(parts, x, counts):
    """Gloo's all_gather needs equal sizes: each rank broadcasts its part (the reference)."""
    for r, c in enumerate(counts):
        buf = x.clone() if r == R else parts[r]
        if c:
            dist.broadcast(buf, src=r, group=GROUP)
        parts[r] = buf


@pytest.fixture
def staged_backend(monkeypatch):
    """The job's torch backend with its Gloo staging taking CPU tensors (as it takes CUDA ones)."""
    import time

    from hvd_commopt import runtime
    from torch_plugin import comm as torch_comm
    from torch_plugin import sendrecv_sized
    backend = runtime.communicator().backend
    for mod in (sendrecv_sized, torch_comm):  # where the backend asks staged_collectives.takes
        monkeypatch.setattr(mod, "staged", lambda name, t: name == "gloo")
    return backend, time.monotonic() + 120


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_backend_staged_allgather_and_sendrecv_equal_the_unstaged(staged_backend, dtype, monkeypatch):
    """Through the backend: the staged variable-size allgather (sizes as host integers), sendrecv
    around the ring (the size sent first) and sendrecv_sized give what the unstaged calls give."""
    backend, deadline = staged_backend
    assert backend.name == "gloo"
    x = _row(3 + 4 * R, torch.float32, 1).to(dtype)
    got, counts = backend.allgather(x, "t.ag", deadline)
    nxt, prv = (R + 1) % P, (R - 1) % P
    ring = backend.sendrecv(x, nxt, prv, "t.sr", deadline)
    sized = backend.sendrecv_sized(x, nxt, prv, 3 + 4 * prv, "t.srs", deadline)
    only_send = backend.sendrecv(x, nxt if R == 0 else -1, prv if R == 1 else -1, "t.half", deadline)
    assert len(backend._staging.host_buffers()) >= 4  # the staging ran
    monkeypatch.undo()
    want, want_counts = backend.allgather(x, "t.ag2", deadline)
    assert counts == want_counts == [3 + 4 * r for r in range(P)] and torch.equal(got, want)
    want_ring = backend.sendrecv(x, nxt, prv, "t.sr2", deadline)
    assert torch.equal(ring, want_ring) and torch.equal(sized, want_ring) and ring.dtype == dtype
    assert (only_send is None) == (R != 1) and (R != 1 or torch.equal(only_send, want_ring))
