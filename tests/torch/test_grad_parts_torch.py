"""Gradients read where they are (docs/selection.md#grad-parts) with torch: TorchOps' native top-k on
unpacked parts equals it on the packed bucket, and training with the DistributedOptimizer gives the
same weights whether the engine hands over unpacked gradients or packs them."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.select import host_native  # noqa: E402
from hvd_commopt.select.addend import MomentumAddend  # noqa: E402
from hvd_commopt.select.exact_topk import ExactTopK  # noqa: E402
from hvd_commopt.select.grad_parts import GradParts  # noqa: E402
from hvd_commopt.engine import engine as engine_module  # noqa: E402
from torch_plugin.ops import TorchOps  # noqa: E402

pytestmark = pytest.mark.skipif(not host_native.native_sweep(), reason="the native kernels were not built")


def _bits(t):
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


@pytest.mark.parametrize("layout", ["contiguous", "a_transposed_part"])
def test_torch_parts_equal_the_packed_bucket(layout):
    gen = torch.Generator().manual_seed(4)
    n = 90_000
    x, g, u = (torch.randn(n, generator=gen) for _ in range(3))
    cuts = [0, 7, 30_000, 30_000 + 300 * 70, n]
    parts = [(a, g[a:b].clone()) for a, b in zip(cuts, cuts[1:])]
    if layout == "a_transposed_part":  # not contiguous: TorchOps declines, the steps pack it
        parts[2] = (cuts[2], g[cuts[2]:cuts[3]].clone().view(70, 300).t().contiguous().t())
    ops = TorchOps()

    def run(gg):
        xx, uu = x.clone(), u.clone()
        out, uo = torch.full_like(x, 7.0), torch.full_like(u, 5.0)
        add = MomentumAddend(uu, 0.9, gg, uo)
        r = ExactTopK().select(ops, xx, 900, addend=add, out=out)
        return r, out, add.made
    ra, oa, ma = run(g.clone())
    gp = GradParts(ops, torch.empty_like(g), parts)
    rb, ob, mb = run(gp)
    assert gp.is_packed == (layout == "a_transposed_part")
    assert torch.equal(ra.indices, rb.indices) and torch.equal(_bits(ra.values), _bits(rb.values))
    assert torch.equal(_bits(oa), _bits(ob)) and torch.equal(_bits(ma), _bits(mb)) and ra.threshold == rb.threshold


def _train(packed: bool, compression, steps: int = 4):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 200),
                               torch.nn.ReLU(), torch.nn.Linear(200, 10))
    init = copy.deepcopy(base.state_dict())

    def body(comm):
        torch.set_num_threads(1)
        m = copy.deepcopy(base)
        m.load_state_dict(init)
        opt = hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=m.named_parameters(), compression=compression(),
                                       communicator=comm)
        if packed:
            opt.comm_engine.reducer.reads_parts = lambda bucket, ops: False
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in m.state_dict().items()}
    return run_ranks(2, body)


@pytest.mark.parametrize("compression", [lambda: Compression.topk(0.02),
                                         lambda: Compression.dgc(0.02, selection="exact"),
                                         lambda: Compression.dgc(0.02)])
def test_training_with_unpacked_gradients_gives_the_same_weights(compression, monkeypatch):
    copies, made = [], []
    orig = GradParts.pack

    class Counted(GradParts):
        __slots__ = ()

        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)
    monkeypatch.setattr(GradParts, "pack", lambda self: copies.append(bool(self.parts)) or orig(self))
    monkeypatch.setattr(engine_module, "GradParts", Counted)
    a = _train(False, compression)
    # the weight bucket, read in place on each rank and step (DGC's sampled selection samples g
    # itself at its first step: docs/dgc.md#sample-from-sums)
    sampled = compression().compressor.selection.mode == "sampled"
    assert len(made) == 2 * 4 and copies.count(True) == (2 if sampled else 0)
    b = _train(True, compression)
    assert len(made) == 2 * 4
    for wa, wb in zip(a, b):
        for k in wa:
            assert torch.equal(_bits(wa[k]), _bits(wb[k])), k
    assert np.isfinite(sum(float(v.sum()) for v in a[0].values()))
