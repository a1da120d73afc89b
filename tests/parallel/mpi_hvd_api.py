"""Horovod API compatibility under mpirun (run on every rank by test_hvd_api_mpi.py): each test
asserts exact values on every rank. Our own tests, written from Horovod's documented behaviour."""
import pytest
import torch

import torch_plugin as hvd
from hvd_commopt.errors import RankMismatchError
from tests.parallel.ranks import require_mpirun

hvd.init()
torch.set_num_threads(1)
R, P = hvd.rank(), hvd.size()
require_mpirun("tests/parallel/test_hvd_api_mpi.py")


def test_mismatched_shapes_dtypes_roots_raise_on_every_rank():
    with pytest.raises(RankMismatchError, match=r"rank 0: allreduce float32\[3\].*rank 1: allreduce float32\[4\]"):
        hvd.allreduce(torch.ones(3 + R))
    with pytest.raises(RankMismatchError, match="int32.*float32|float32.*int32"):
        hvd.allreduce(torch.ones(3, dtype=torch.int32 if R == 0 else torch.float32))
    with pytest.raises(RankMismatchError, match="dimension but the first"):
        hvd.allgather(torch.ones(2, 3 + R))
    with pytest.raises(RankMismatchError):
        hvd.allgather(torch.ones(2, dtype=torch.int64 if R == 0 else torch.float32))
    with pytest.raises(RankMismatchError, match="root"):
        hvd.broadcast(torch.ones(2), root_rank=R)
    with pytest.raises(RankMismatchError):
        hvd.broadcast(torch.ones(2, dtype=torch.float64 if R == 0 else torch.float32), 0)
    with pytest.raises(RankMismatchError, match="different collectives"):
        hvd.allreduce(torch.ones(2)) if R == 0 else hvd.allgather(torch.ones(2))
    # the stream of collectives is intact afterwards
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [P, P]


def test_uint16_sums_as_integers_and_bfloat16_still_sums():
    t = torch.tensor([1000, 2, 40000 // P], dtype=torch.uint16)
    out = hvd.allreduce(t, op=hvd.Sum)
    assert out.dtype == torch.uint16 and out.to(torch.int64).tolist() == [1000 * P, 2 * P, (40000 // P) * P]
    b = hvd.allreduce(torch.full((5,), 1.5, dtype=torch.bfloat16), op=hvd.Sum)
    assert b.dtype == torch.bfloat16 and b.float().tolist() == [1.5 * P] * 5
    flags = torch.tensor([R == 0, True, False])
    assert hvd.allreduce(flags, op=hvd.Sum).tolist() == [True, True, False]
    assert hvd.allreduce(flags, op=hvd.Min).tolist() == [False, True, False]
    for dt in (torch.uint8, torch.int8, torch.int16):
        assert hvd.allreduce(torch.tensor([3, 5], dtype=dt), op=hvd.Average).tolist() == [3, 5]
        assert hvd.allgather(torch.full((1,), R, dtype=dt)).tolist() == list(range(P))
        assert hvd.broadcast(torch.full((2,), R + 1, dtype=dt), P - 1).tolist() == [P, P]
        assert hvd.alltoall(torch.full((P,), R, dtype=dt)).tolist() == list(range(P))


def test_min_max_product_and_scale_factors():
    x = torch.tensor([R + 1.0, -(R + 1.0), 2.0], dtype=torch.float16)
    assert hvd.allreduce(x, op=hvd.Min).tolist() == [1.0, -float(P), 2.0]
    assert hvd.allreduce(x, op=hvd.Max).tolist() == [float(P), -1.0, 2.0]
    assert hvd.allreduce(torch.tensor([R + 1], dtype=torch.int64), op=hvd.Product).item() == \
        torch.arange(1, P + 1).prod().item()
    i = torch.tensor([10, -7], dtype=torch.int32)
    # integers: scaled in float64 and truncated back, before (prescale) / after (postscale) the sum
    assert hvd.allreduce(i, op=hvd.Sum, prescale_factor=0.5).tolist() == [5 * P, -3 * P]
    assert hvd.allreduce(i, op=hvd.Sum, postscale_factor=0.5).tolist() == [int(10 * P * 0.5), int(-7 * P * 0.5)]
    f = hvd.allreduce(torch.ones(3, dtype=torch.float64), op=hvd.Sum, prescale_factor=0.25, postscale_factor=2.0)
    assert f.tolist() == [0.5 * P] * 3


def test_gradients_through_collectives():
    x = torch.full((2, 3), float(R + 1), requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    assert x.grad.eq(P).all()
    x.grad = None
    g = hvd.allgather(x)
    assert g.shape == (2 * P, 3)
    (g * torch.arange(2 * P).view(-1, 1)).sum().backward()  # row j of the gather has weight j
    assert x.grad[:, 0].tolist() == [2.0 * R, 2.0 * R + 1]  # averaged over ranks, own rows
    x.grad = None
    hvd.broadcast(x, 0).sum().backward()
    assert x.grad.eq(1.0 if R == 0 else 0.0).all()
    y = torch.arange(2.0 * P, requires_grad=True)
    out = hvd.alltoall(y)
    (out * (R + 1)).sum().backward()
    assert y.grad.tolist() == [float(j // 2 + 1) for j in range(2 * P)]  # rows went to rank j // 2
    z = torch.ones(2 * P, 2, requires_grad=True)
    part = hvd.reducescatter(z, op=hvd.Sum)
    assert part.shape == (2, 2) and part.eq(P).all()
    part.sum().backward()
    assert z.grad.eq(P).all()


def test_alltoall_with_splits_and_uneven_reducescatter():
    splits = [R + 1] * P  # rank R sends R + 1 rows to everyone
    t = torch.full((sum(splits), 2), float(R))
    out, recv = hvd.alltoall(t, splits=splits)
    assert recv.tolist() == [r + 1 for r in range(P)]
    assert out[:, 0].tolist() == [float(r) for r in range(P) for _ in range(r + 1)]
    rs = hvd.reducescatter(torch.arange(2 * P + 1, dtype=torch.float32), op=hvd.Sum)
    rows = [2 + (1 if r < 1 else 0) for r in range(P)]
    start = sum(rows[:R])
    assert rs.tolist() == [P * float(v) for v in range(start, start + rows[R])]
    ints = hvd.reducescatter(torch.full((P, 2), -3 * (R + 1), dtype=torch.int64))  # Average rounds toward 0
    assert ints.tolist() == [[int(-3 * sum(range(1, P + 1)) / P)] * 2]
    mx = hvd.reducescatter(torch.full((P,), float(R), dtype=torch.float64), op=hvd.Max, postscale_factor=2.0)
    assert mx.tolist() == [2.0 * (P - 1)]


def test_grouped_async_and_duplicate_names():
    outs = hvd.grouped_allreduce([torch.ones(2), torch.full((3,), 2, dtype=torch.int32)], op=hvd.Sum)
    assert outs[0].tolist() == [P] * 2 and outs[1].tolist() == [2 * P] * 3
    ga = hvd.grouped_allgather([torch.full((1,), R), torch.full((2, 2), float(R))])
    assert ga[0].tolist() == list(range(P)) and ga[1].shape == (2 * P, 2)
    h1 = hvd.allreduce_async(torch.ones(4), name="a", op=hvd.Sum)
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce_async(torch.ones(4), name="a")
    h2 = hvd.broadcast_async(torch.full((2,), float(R)), 0)
    t = torch.zeros(2)
    h3 = hvd.allreduce_async_(t.add_(1), op=hvd.Sum)
    assert hvd.synchronize(h1).tolist() == [P] * 4
    assert hvd.synchronize(h2).tolist() == [0.0, 0.0]
    hvd.synchronize(h3)
    assert t.tolist() == [P, P]
    hvd.barrier()
    assert hvd.allgather_object({"r": R}) == [{"r": r} for r in range(P)]


def test_join_takes_part_with_zeros_and_returns_last_rank():
    if R == 0:
        last = hvd.join()
    else:
        avg = hvd.allreduce(torch.full((3,), 4.0))
        assert avg.tolist() == [4.0 * (P - 1) / P] * 3
        last = hvd.join()
    assert last != 0 and hvd.allgather_object(last) == [last] * P
    if R == 0:
        hvd.join()
    else:
        with pytest.raises(RuntimeError, match="join"):
            hvd.allgather(torch.ones(1))
        hvd.join()


def test_process_sets():
    even = hvd.add_process_set([r for r in range(P) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(P) if r % 2 == 1])
    mine = even if R % 2 == 0 else odd
    members = mine.ranks
    s = hvd.allreduce(torch.full((2,), float(R)), op=hvd.Sum, process_set=mine)
    assert s.tolist() == [float(sum(members))] * 2
    g = hvd.allgather(torch.full((1,), R), process_set=mine)
    assert g.tolist() == members
    b = hvd.broadcast(torch.full((2,), float(R)), members[-1], process_set=mine)
    assert b.tolist() == [float(members[-1])] * 2
    with pytest.raises(Exception, match="not in process set"):
        hvd.allreduce(torch.ones(1), process_set=odd if mine is even else even)
    assert hvd.remove_process_set(odd) and hvd.remove_process_set(even)
    assert not hvd.remove_process_set(even)


def test_broadcast_optimizer_state_initialises_empty_state():
    torch.manual_seed(R)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (R + 1))
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # parameters untouched
    assert len(opt.state) == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.1)
