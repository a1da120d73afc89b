"""The convergence matrix's one table (benchmarks/convergence.py: table) from CONV lines: the gap of
the means to S-SGD (points for accuracy, % for validation loss) and the per-seed gap's spread."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

from benchmarks import convergence as C  # noqa: E402


def _line(**r) -> str:
    return "CONV " + json.dumps(r) + "\n"


def test_one_table_with_gap_and_seed_spread(tmp_path) -> None:
    p = tmp_path / "conv.txt"
    lines = [_line(task="digits", ranks=2, epochs=8, variant="ssgd", seed=s, acc=a) for s, a in ((0, 97.0), (1, 98.0))]
    lines += [_line(task="digits", ranks=2, epochs=8, variant="topk", seed=s, acc=a) for s, a in ((0, 96.0), (1, 98.5))]
    lines += [_line(task="transformer", ranks=2, steps=300, optimizer="adamw", variant=v, seed=0, val_loss=x)
              for v, x in (("ssgd", 2.0), ("topk", 2.2))]
    p.write_text("".join(lines) + "not a CONV line\n")
    md = C.table([str(p)])
    assert md.count("| task |") == 1  # one table
    # digits (old lines have no optimizer: SGD): topk mean 97.25 vs 97.5 -> -0.25 pt; per seed -1.0 and +0.5
    assert "| digits | sgd | 2 | 8 epochs | topk | 2 | acc % 97.25 ± 1.77 | -0.25 pt | -1.00 to +0.50 pt |" in md
    assert "| transformer | adamw | 2 | 300 steps | topk | 1 | val loss 2.2000 ± 0.0000 | +10.00% | +10.00 to +10.00% |" in md


def test_optimizers_and_tasks_are_known() -> None:
    assert set(C.OPTIMIZERS) == {"sgd", "adamw"} and "transformer" in C.TASKS
    import torch
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert isinstance(C.make_optimizer("adamw", p, 1e-3), torch.optim.AdamW)
    assert C.make_optimizer("sgd", p, 0.1).param_groups[0]["momentum"] == 0.9
