"""Horovod's torch API on one rank: compressor interface, user compressors, gradients through
the collectives, build queries, broadcast_optimizer_state on a fresh optimizer."""
import torch

import torch_plugin as hvd


def setup_module():
    hvd.init()


def test_builtin_compressors_take_horovods_call_form():
    for dtype in (torch.float32, torch.float64, torch.int32):
        t = torch.ones(5, 3, dtype=dtype)
        c, ctx = hvd.Compression.fp16.compress(t)
        assert c.dtype == (torch.float16 if dtype.is_floating_point else dtype) and c.shape == t.shape
        d = hvd.Compression.fp16.decompress(c, ctx)
        assert d.dtype == dtype and torch.equal(d, t)
    c, ctx = hvd.Compression.none.compress(torch.ones(2))
    assert torch.equal(hvd.Compression.none.decompress(c, ctx), torch.ones(2))


class HalfCompressor:  # a user-written compressor, Horovod's interface (static methods)
    calls = 0

    @staticmethod
    def compress(tensor):
        HalfCompressor.calls += 1
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def test_user_compressor_in_allreduce_and_optimizer():
    assert hvd.allreduce(torch.full((4,), 0.5), compression=HalfCompressor).tolist() == [0.5] * 4
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=HalfCompressor)
    before = HalfCompressor.calls
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert HalfCompressor.calls > before


def test_gradients_flow_on_one_rank():
    x = torch.ones(2, 2, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * 3).sum().backward()
    assert x.grad.eq(3).all()
    x.grad = None
    hvd.grouped_allreduce([x, x * 2])[1].sum().backward()
    assert x.grad.eq(2).all()


def test_build_queries_and_ops():
    assert hvd.mpi_built() is True and hvd.nccl_built() == 0 and hvd.ccl_built() is False
    assert hvd.mpi_enabled() is False and hvd.Min == "min" and hvd.Adasum == "adasum"


def test_broadcast_optimizer_state_fills_a_fresh_optimizers_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    w = model.weight.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert torch.equal(model.weight, w) and all("momentum_buffer" in s for s in opt.state.values())


def test_initialised_adam_state_trains_like_a_fresh_adam():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    oa, ob = torch.optim.Adam(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(oa, root_rank=0)
    assert len(oa.state) == 2
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(torch.ones(4, 3)).pow(2).sum().backward()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
