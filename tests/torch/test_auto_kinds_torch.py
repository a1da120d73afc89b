"""``compression="auto"`` reads the optimizer and model kinds from torch's optimizer and parameters,
and takes its default candidates from the table (docs/auto-compression.md#kinds): a conv net under
SGD and an MLP under SGD get int4 beside the every-task methods (rings, the convolutional task,
trained int8 and int4 but no sparse method below 10 %), a GPT-like model under AdamW does not;
above 2 ranks the cells the 4-rank runs back (docs/auto-compression.md#kinds-ranks); ``allow=`` stays."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch_plugin as hco  # noqa: E402
from hvd_commopt import Compression, run_ranks  # noqa: E402
from hvd_commopt.autocompress import DEFAULT_ALLOW  # noqa: E402
from hvd_commopt.autocompress.kinds import rule_for  # noqa: E402
from hvd_commopt.fusion import AlphaBeta, CostModel  # noqa: E402

# a given cost model: no calibration before step 0
FAST = CostModel(AlphaBeta(1e-5, 1e-10), AlphaBeta(1e-5, 1e-10), None, ranks=2)
INT4 = ("none", "bf16", "quant8", "quant4")


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))


class TinyGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.block = torch.nn.TransformerEncoderLayer(32, 2, 64, batch_first=True, norm_first=True)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, x):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.block(self.emb(x), src_mask=mask, is_causal=True))


MODELS = {
    "conv": (ConvNet, lambda: torch.randn(2, 3, 8, 8)),
    "mlp": (lambda: torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
            lambda: torch.randn(2, 8)),
    "gpt": (TinyGPT, lambda: torch.randint(0, 64, (2, 6))),
}


def _run(comm, model_name: str, adam: bool, cost=FAST, **auto):
    torch.manual_seed(0)
    make, data = MODELS[model_name]
    model = make()
    inner = (torch.optim.AdamW(model.parameters(), lr=1e-3) if adam
             else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt = hco.DistributedOptimizer(inner, named_parameters=model.named_parameters(), communicator=comm,
                                   compression=Compression.auto(cost_model=cost, **auto))
    model(data()).float().sum().backward()
    opt.step()
    red = opt.comm_engine.reducer
    rep = opt.compression_report
    return red.kinds.optimizer, red.kinds.model.kind, red.options.allow, rep["kinds"], len(opt.comm_engine.buckets)


@pytest.mark.parametrize("model_name,adam,kinds,allow", [
    ("conv", False, ("sgd", "convolutional"), INT4),  # rings: int4 within over ten seeds
    ("mlp", False, ("sgd", "other"), INT4),
    ("gpt", True, ("adaptive", "other"), ("none", "bf16", "quant8")),  # int4 missed the 6.4M GPT under AdamW
    ("conv", True, ("adaptive", "convolutional"), DEFAULT_ALLOW),  # no task measured: every task's rule
])
def test_auto_reads_the_kinds_and_takes_the_cells_candidates(model_name, adam, kinds, allow):
    r0, r1 = run_ranks(2, lambda comm: _run(comm, model_name, adam))
    assert r0 == r1
    assert r0[:2] == kinds and r0[2] == allow
    assert r0[3].startswith(f"model: {kinds[1]}, ") and "docs/auto-compression.md#kinds" in r0[3]
    assert ("optimizer: Adam-type" if adam else "optimizer: SGD") in r0[3]


def test_the_users_allow_stays_and_the_1d_tensors_follow_the_candidates():
    plain = run_ranks(2, lambda comm: _run(comm, "mlp", False))[0]  # int4, no sparse method: one bucket
    given = run_ranks(2, lambda comm: _run(comm, "mlp", False, allow=["bf16", "topk"], min_density=0.01))[0]
    assert given[2] == ("none", "bf16", "topk")
    assert "the user's allow= and min_density= in place of the rule's" in given[3]
    assert given[4] == plain[4] + 1  # the biases in a bucket of their own (a sparse method may be chosen)
    conv = run_ranks(2, lambda comm: _run(comm, "conv", False))[0]
    masked = run_ranks(2, lambda comm: _run(comm, "conv", False, allow=["dgc_masked"], min_density=0.03))[0]
    assert masked[2] == ("none", "dgc_masked") and masked[4] == conv[4] + 1  # a sparse method allowed: 1-D apart


@pytest.mark.parametrize("model_name,adam,cell", [
    ("mlp", False, ("sgd", "other")), ("gpt", True, ("adaptive", "other")), ("conv", False, ("sgd", "convolutional")),
])
def test_four_ranks_take_the_four_rank_cell(model_name, adam, cell):
    fast4 = CostModel(AlphaBeta(1e-5, 1e-10), AlphaBeta(1e-5, 1e-10), None, ranks=4)
    res = run_ranks(4, lambda comm: _run(comm, model_name, adam, cost=fast4))
    assert all(r == res[0] for r in res)
    assert res[0][:2] == cell and res[0][2] == rule_for(*cell, 4).methods
    assert "; ranks: 4, the 4-rank rule (measured at 4, used above 2); " in res[0][3]
    given = run_ranks(4, lambda comm: _run(comm, model_name, adam, cost=fast4, allow=["quant8", "quant4"]))[0]
    assert given[2] == ("none", "quant8", "quant4")  # the user's allow= over the 4-rank cell
