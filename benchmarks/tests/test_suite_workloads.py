"""The suite's new pieces without launching ranks: the DDP compression-hook baselines (analytic
bytes, the hooks DDP accepts), the transformer workload's shapes, and the transformer's
time-to-validation-loss table."""
from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from benchmarks import gpt_model as G  # noqa: E402
from benchmarks.suite import baselines as B  # noqa: E402
from benchmarks.suite import report  # noqa: E402
from benchmarks.suite import variants as V  # noqa: E402
from benchmarks.suite import workloads as W  # noqa: E402


def test_hook_baselines_are_registered_as_baselines() -> None:
    for name in ("ddp_bf16", "ddp_fp16"):
        assert name in V.VARIANTS and name in V.DEFAULT and not V.is_ours(name)
        assert not V.known(f"{name}@mpi")  # DDP's, not ours: no backend variants
    assert "bf16" in V.VARIANTS and V.is_ours("bf16") and "ddp_bf16" in V.QUICK


def test_hook_bytes_are_half_of_ddp() -> None:
    m = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 2))
    n = sum(p.numel() for p in m.parameters())
    assert V.ddp_bytes_per_step(m, 2, elem_bytes=2) == 2 * n
    assert V.ddp_bytes_per_step(m, 4, elem_bytes=2) == int(1.5 * 2 * n)


def test_hooks_delegate_to_torchs_and_carry_ddps_annotations() -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    for name, torch_name in (("bf16", "bf16_compress_hook"), ("fp16", "fp16_compress_hook")):
        hook = B.DDP_HOOKS[name]
        # DDP's _check_comm_hook compares the annotations as objects, and refuses the bf16 hook by name on CPU
        sig = inspect.signature(hook)
        assert sig.parameters["bucket"].annotation is dist.GradBucket
        assert sig.return_annotation == torch.futures.Future[torch.Tensor]
        assert hook.__name__ != torch_name and torch_name in inspect.getsource(hook)
        assert callable(getattr(default_hooks, torch_name))


def test_transformer_shapes() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert W.transformer_shape("auto", cpu, quick=False) == G.GPT_CPU
    assert W.transformer_shape("auto", cuda, quick=False) == G.GPT2_SMALL
    assert W.transformer_shape("auto", cpu, quick=True).layers == 2
    assert W.transformer_shape("gpt2_small", cpu, quick=True) == G.GPT2_SMALL
    with pytest.raises(SystemExit, match="unknown transformer shape"):
        W.transformer_shape("huge", cpu, quick=False)


def test_transformer_workload_batch_and_loss() -> None:
    wl = W.workload("transformer", quick=True, device=torch.device("cpu"))
    x, y = wl.batch()
    assert x.shape == y.shape == (wl.batch_per_rank, wl.tokens_per_sample) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    loss = wl.loss(wl.build()(x), y)
    assert 5.0 < loss.item() < 6.0  # ~ln 256 at GPT-2's initialisation
    mlp = W.workload("deep_mlp", quick=True, device=torch.device("cpu"))
    xm, ym = mlp.batch()
    out = mlp.build()(xm)
    # the shared loss is the ordinary classification loss on (batch, classes) outputs
    assert torch.allclose(mlp.loss(out, ym), torch.nn.functional.cross_entropy(out, ym))
    with pytest.raises(SystemExit, match="unknown model"):
        W.workload("vgg", quick=True, device=torch.device("cpu"))


def _lm_job() -> dict:
    res = {name: {"curve": [{"step": 0, "wall_s": 0.0, "val_loss": 5.5}, {"step": 20, "wall_s": t or 9.0, "val_loss": v}],
                  "final_val_loss": v, "time_to_target_s": t, "steps_to_target": 20 if t else None, "step_s": s}
           for name, v, t, s in (("ddp", 2.9, 4.0, 0.2), ("ddp_bf16", 2.95, 3.5, 0.175), ("topk", 3.3, None, 0.15))}
    return {"mode": "tta", "task": "lm", "model": "transformer", "params": 6_416_896,
            "shape": {"layers": 8, "heads": 8, "width": 256, "context": 128, "vocab": 256}, "steps": 20,
            "eval_every": 20, "batch_per_rank": 8, "context": 128, "optimizer": "adamw", "lr": 1e-3,
            "lr_warmup_steps": 20, "target": 3.0, "eval_windows": 64, "initial_val_loss": 5.5, "density": 0.01,
            "period": 4, "schedule_warmup_steps": 20, "status": {}, "results": res}


def test_lm_time_to_target_table_and_missed() -> None:
    md = "\n".join(report._tta_table(_lm_job()))
    assert "6.42M parameters, 8 layers, width 256" in md and "target 3" in md
    assert "| ddp_bf16 | 3.5 | 20 | 2.9500 | +1.7% | 0.175 |" in md
    assert "| topk | not reached | – | 3.3000 | +13.8% | 0.150 |" in md
    assert md.index("ddp_bf16") < md.index("| ddp |")  # sorted by time to target
    run = {"jobs": [_lm_job()]}
    assert report.tta_missed(run, "transformer") == {"topk"}
    assert report.tta_missed(run, "deep_mlp") == set()  # the digits job stands for the other models
