"""Rank-side checks of the Gloo backend's MPI lane (docs/backends.md#small-on-mpi); run by
test_mpi_lane.py under ``mpirun -np P`` with HVD_COMMOPT_BACKEND=gloo and
HVD_COMMOPT_MPI_SMALL_BYTES=4096. Every rank runs these tests; a failure on any rank fails the job."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_plugin as hco
from hvd_commopt import runtime
from hvd_commopt.comm.direct import DirectHandle
from tests.parallel.ranks import require_mpirun

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
require_mpirun("tests/parallel/test_mpi_lane.py")
COMM = runtime.communicator()
BE = COMM.backend
LANE = BE.lane
SMALL = 4096
OPS = hco.TorchOps()


def lane_calls():
    return LANE.calls


def rows(n, dtype=torch.float32, seed=0):
    """Rank r's row: n values that differ per rank."""
    g = torch.Generator().manual_seed(seed * 100 + R)
    return (torch.randn(n, generator=g) * 1e3).to(dtype)


def test_the_lane_is_open_with_the_asked_size():
    assert runtime.backend_name() == "gloo"
    assert BE.mpi_small_bytes == SMALL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("n_bytes", [4, SMALL, SMALL + 8])
def test_a_sum_takes_the_lane_up_to_the_size_and_equals_gloos_allreduce(dtype, n_bytes):
    x = rows(n_bytes // torch.tensor([], dtype=dtype).element_size(), dtype)
    before = lane_calls()
    h = COMM.allreduce_tensor_async(OPS, x.clone(), "sum", f"sum-{dtype}-{n_bytes}")
    small = n_bytes <= SMALL
    # a lane collective is queued for the progress thread, never started on the calling thread
    assert isinstance(h, DirectHandle) != small
    got = COMM.wait(h)
    assert lane_calls() - before == (1 if small else 0)
    ref = x.clone()
    dist.all_reduce(ref, group=BE._pg)
    if P == 2 or not dtype.is_floating_point:  # a + b is one rounding whichever transport adds
        assert torch.equal(got, ref)
    else:
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-3)  # three addends: the order may differ
    assert torch.equal(got, hco.broadcast(got, 0, name=f"same-{dtype}-{n_bytes}"))  # the same on every rank


def test_min_and_max_take_the_lane_and_halves_stay_on_gloo():
    x = rows(16)
    for op, ref_op in (("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
        before = lane_calls()
        got = COMM.wait(COMM.allreduce_tensor_async(OPS, x.clone(), op, f"op-{op}"))
        assert lane_calls() - before == 1
        ref = x.clone()
        dist.all_reduce(ref, op=ref_op, group=BE._pg)
        assert torch.equal(got, ref)
    before = lane_calls()
    half = x.to(torch.float16)
    got = COMM.wait(COMM.allreduce_tensor_async(OPS, half.clone(), "sum", "half"))
    assert lane_calls() == before  # no MPI sum for halves
    ref = half.clone()
    dist.all_reduce(ref, group=BE._pg)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.uint8])
@pytest.mark.parametrize("n", [3, 700, 5000])
def test_an_equal_allgather_takes_the_lane_by_its_bytes(dtype, n):
    x = rows(n, torch.float32, seed=n).to(dtype)
    before = lane_calls()
    h = COMM.allgather_tensor_async(OPS, x, f"ag-{dtype}-{n}", equal=True)
    small = n * x.element_size() <= SMALL
    assert isinstance(h, DirectHandle) != small
    out, counts = COMM.wait(h)
    assert lane_calls() - before == (1 if small else 0)
    assert counts == [n] * P and out.dtype == dtype
    assert torch.equal(out[R * n:(R + 1) * n], x)
    everyone = hco.allgather_object(x.float().numpy())
    assert np.array_equal(out.float().numpy(), np.concatenate(everyone))


@pytest.mark.parametrize("base", [5, 900])
def test_a_general_allgather_exchanges_sizes_over_mpi_and_the_largest_decides(base):
    # rank r sends base + 37 r floats: at base 900 rank 0's 3600 bytes fit the lane but the
    # largest part does not, so every rank sends the data over Gloo
    n = base + 37 * R
    x = rows(n, seed=base)
    before = lane_calls()
    out, counts = COMM.wait(COMM.allgather_tensor_async(OPS, x, f"agv-{base}"))
    sizes = [base + 37 * r for r in range(P)]
    assert counts == sizes
    small = max(sizes) * 4 <= SMALL
    assert lane_calls() - before == (2 if small else 1)  # sizes (always), then the data if small
    everyone = hco.allgather_object(x.numpy())
    assert np.array_equal(out.numpy(), np.concatenate(everyone))


def test_interleaved_small_and_large_collectives_keep_their_order_on_both_transports():
    # small ones queued on the progress thread (MPI), large ones started at once (Gloo), in an
    # order that mixes them; every result must be the sum of the same collective on every rank
    sizes = [8, 20000, 16, 30000, 4, 4, 50000, 12, 25000, 1000] * 3
    xs = [rows(n, seed=i) for i, n in enumerate(sizes)]
    handles = [COMM.allreduce_tensor_async(OPS, x.clone(), "sum", f"mix-{i}") for i, x in enumerate(xs)]
    for i, (x, h) in enumerate(zip(xs, handles)):
        got = COMM.wait(h)
        everyone = hco.allgather_object(x.numpy())
        assert np.allclose(got.numpy(), np.sum(everyone, axis=0), rtol=1e-5, atol=1e-3), i


def test_topk_training_is_bit_for_bit_the_same_with_and_without_the_lane(monkeypatch):
    # the exact top-k's per-layer allgathers take the lane; the result must not change
    def train(lane_on):
        monkeypatch.setattr(BE, "_lane", LANE if lane_on else None)  # without: as a process set's backend
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 4))
        opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       compression=hco.Compression.topk(0.05), fusion_threshold=0)
        before = lane_calls()
        for step in range(4):
            g = torch.Generator().manual_seed(1000 * step + R)
            x, y = torch.randn(16, 20, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), lane_calls() - before
    on, carried = train(True)
    off, none = train(False)
    monkeypatch.undo()
    assert carried > 0 and none == 0
    if P == 2:
        assert torch.equal(on, off)
    else:
        assert torch.allclose(on, off, rtol=1e-5, atol=1e-7)
