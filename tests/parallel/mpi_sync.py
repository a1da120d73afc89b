"""Rank-side checks of the synchronous path; run by test_parallel_sync.py under ``mpirun -np P``.

Every rank runs these tests; a failure on any rank fails the job. Skipped at size 1.
"""
import numpy as np
import pytest
import torch

import torch_plugin as hco
from tests.parallel.ranks import require_mpirun

hco.init()
torch.set_num_threads(1)
P, R = hco.size(), hco.rank()
require_mpirun("tests/parallel/test_parallel_sync.py")


def make_model(hidden=16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


def batch(rank, step, n=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 10, generator=g), torch.randint(0, 4, (n,), generator=g)


def same_on_all_ranks(tensors):
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).reshape(1, -1)
    everyone = hco.allgather(flat)
    return all(torch.equal(everyone[0], everyone[r]) for r in range(P))


@pytest.mark.parametrize("threshold", [0, 256, None])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_weights_identical_and_equal_to_single_process(threshold, opt_name):
    make_opt = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}[opt_name]
    model = make_model()
    if R != 0:  # broadcast_parameters must repair a different start
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = hco.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                   fusion_threshold=threshold)
    hco.broadcast_parameters(model.state_dict(), root_rank=0)
    hco.broadcast_optimizer_state(opt, root_rank=0)
    ref = make_model()
    ref_opt = make_opt(ref.parameters())
    for step in range(6):
        x, y = batch(R, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        xs, ys = zip(*[batch(r, step) for r in range(P)])
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        assert same_on_all_ranks(list(model.parameters()))
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-4, atol=1e-5)
    stats = opt.comm_stats
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    # the step's bytes are its buckets' (each an int: 2(P-1)/P of its size, rounded down)
    assert stats["bytes_sent"] == sum(b["bytes_sent"] for b in stats["per_bucket"].values())
    assert abs(stats["bytes_sent"] - 2 * (P - 1) / P * nbytes) <= len(stats["per_bucket"])


def test_backward_passes_per_step_closed_form():
    w = torch.nn.Parameter(torch.zeros(5))
    opt = hco.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], backward_passes_per_step=3)
    c = torch.arange(1.0, 6.0)
    for _ in range(3):
        opt.zero_grad()
        for n in range(3):
            (w * c * (R + 1) * (n + 1)).sum().backward()
        opt.step()
    # each step: w -= (1/P) sum_r sum_n c (r+1)(n+1) = c * 6 * P(P+1)/2 / P
    expect = -3 * c * 6 * (P + 1) / 2
    assert torch.equal(w.detach(), expect)


def test_clipping_between_synchronize_and_step():
    model = make_model()
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters())
    x, y = batch(R, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    total = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert total <= 0.05 + 1e-6
    with opt.skip_synchronize():
        opt.step()
    assert same_on_all_ranks(list(model.parameters()))


def test_unused_parameters_still_take_part():
    model = make_model()
    extra = torch.nn.Linear(10, 4)
    params = list(model.named_parameters()) + [("extra." + n, p) for n, p in extra.named_parameters()]
    hco.broadcast_parameters(dict(params), root_rank=0)
    opt = hco.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1), named_parameters=params)
    for step in range(3):
        x, y = batch(R, step)
        out = model(x) + (extra(x) if R == 0 else 0)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()
    assert same_on_all_ranks([p for _, p in params])


def test_fp16_compression_trains_identically_on_all_ranks():
    model = make_model()
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=hco.Compression.fp16)
    for step in range(3):
        x, y = batch(R, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert same_on_all_ranks(list(model.parameters()))
    assert opt.comm_stats["bytes_sent"] == pytest.approx(2 * (P - 1) / P * sum(p.numel() * 2 for p in model.parameters()), abs=8)


def test_tensor_collectives():
    t = torch.full((3,), float(R + 1))
    assert torch.equal(hco.allreduce(t), torch.full((3,), (P + 1) / 2))
    assert torch.equal(hco.allreduce(t, op=hco.Sum), torch.full((3,), P * (P + 1) / 2))
    g = hco.allgather(torch.full((R + 1, 2), float(R)))
    assert g.shape == (P * (P + 1) // 2, 2)
    assert torch.equal(hco.broadcast(t, root_rank=P - 1), torch.full((3,), float(P)))
    assert hco.broadcast_object({"rank": R, "t": torch.ones(2) * R}, root_rank=1)["rank"] == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 7, 100_003])
def test_half_precision_allreduce_is_close_and_bit_identical(dtype, n):
    # on MPI: the half-precision ring of comm/mpi.py; on Gloo: its native fp16/bf16 sum
    from hvd_commopt import NumpyOps, runtime
    comm = runtime.communicator()
    ops = NumpyOps() if comm.buffer_kind == "numpy" else hco.TorchOps()
    x = np.random.default_rng(R).standard_normal(n).astype(np.float32)
    h = ops.cast(ops.from_numpy(x.copy(), like=None) if comm.buffer_kind != "numpy" else x.copy(), dtype)
    h = comm.wait(comm.allreduce_tensor_async(ops, h, "sum", "half"))
    exact = np.sum(comm.allgather_object(x), axis=0)
    got = np.asarray(ops.to_numpy(ops.cast(h, "float32")))
    tol = 3e-2 if dtype == "bfloat16" else 3e-3
    np.testing.assert_allclose(got, exact, rtol=tol, atol=tol * P)
    assert len(set(comm.allgather_object(np.asarray(ops.to_numpy(h)).tobytes()))) == 1


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int64"])
def test_equal_size_allgather_matches_the_general_one(dtype):
    # the promise "every rank sends n elements" skips the size round (docs/topk.md#equal-sizes):
    # MPI's Allgather, one Gloo all_gather; the result must be the general allgather's, bit for bit
    from hvd_commopt import NumpyOps, runtime
    comm = runtime.communicator()
    ops = NumpyOps() if comm.buffer_kind == "numpy" else hco.TorchOps()
    x = (np.arange(37) * (R + 3)).astype(dtype)
    t = x if comm.buffer_kind == "numpy" else torch.from_numpy(x)
    h = comm.allgather_tensor_async(ops, t, "eq", equal=True)
    from hvd_commopt.comm.base import Backend
    if type(comm.backend).start_allgather_equal is not Backend.start_allgather_equal:  # docs/backends.md#direct-start
        from hvd_commopt.comm.direct import DirectHandle
        assert isinstance(h, DirectHandle)
    fast, fast_counts = comm.wait(h)
    slow, slow_counts = comm.wait(comm.allgather_tensor_async(ops, t, "gen"))
    assert fast_counts == slow_counts == [37] * P
    fast, slow = np.asarray(ops.to_numpy(fast)), np.asarray(ops.to_numpy(slow))
    assert fast.dtype == slow.dtype == x.dtype and fast.tobytes() == slow.tobytes()
    assert fast.tobytes() == np.concatenate([(np.arange(37) * (r + 3)).astype(dtype) for r in range(P)]).tobytes()


def test_direct_allreduce_waiter_polls_the_backend_until_it_completes():
    # docs/backends.md#direct-start: a lone allreduce starts on the calling thread; its waiter
    # polls it every 50-200 us (docs/backends.md#direct-wait)
    import time

    from hvd_commopt import runtime
    from hvd_commopt.comm.direct import DirectHandle
    from hvd_commopt.comm.base import Backend
    comm = runtime.communicator()
    if type(comm.backend).start_allreduce is Backend.start_allreduce:
        pytest.skip("this backend starts no collective on the calling thread (MPI)")
    comm.barrier()
    if R == P - 1:
        time.sleep(0.3)  # the others wait ~0.3 s for the last rank
    t = torch.full((1000,), float(R + 1))
    h = comm.allreduce_tensor_async(hco.TorchOps(), t, "sum", "direct-poll")
    assert isinstance(h, DirectHandle)
    calls = [0]
    is_completed = h._is_completed

    def counted():
        calls[0] += 1
        return is_completed()
    h._is_completed = counted
    out = comm.wait(h)
    assert torch.equal(out, torch.full((1000,), float(P * (P + 1) // 2)))
    waited = comm.allgather_object(calls[0])
    assert max(waited[:-1]) > 100, waited


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("n", [1000, 20000])  # 4 KB: exchanged by allgather at 2 ranks; 80 KB: allreduce
def test_small_sums_on_two_gloo_ranks_equal_the_allreduce_bit_for_bit(direct, n, monkeypatch):
    # docs/backends.md#pair-sum: one allgather and a local a + b, the same bits as Gloo's allreduce
    import torch.distributed as dist

    from hvd_commopt import runtime
    comm = runtime.communicator()
    from torch_plugin.comm import TorchDistBackend
    if not isinstance(comm.backend, TorchDistBackend):
        pytest.skip("not the torch.distributed backend")
    from hvd_commopt.comm import direct as direct_start
    from torch_plugin import pair_sum
    gathers = []
    real = pair_sum.gather_single
    monkeypatch.setattr(pair_sum, "gather_single", lambda *a, **k: gathers.append(1) or real(*a, **k))
    x = torch.from_numpy(np.random.default_rng(R).standard_normal(n).astype(np.float32) * 1e3)
    monkeypatch.setattr(direct_start, "START_ON_CALLER", direct)
    got = comm.wait(comm.allreduce_tensor_async(hco.TorchOps(), x.clone(), "sum", f"pair-{direct}-{n}"))
    monkeypatch.undo()
    assert len(gathers) == (1 if P == 2 and n * 4 <= pair_sum.MAX_BYTES else 0)
    ref = x.clone()
    dist.all_reduce(ref, group=comm.backend._pg)
    assert got.numpy().tobytes() == ref.numpy().tobytes()
    if P == 2:
        a, b = comm.allgather_object(x.numpy())
        assert got.numpy().tobytes() == (a + b).tobytes()
