"""The suite's DDP baselines: PyTorch DDP at its defaults, with PowerSGD, and with the fp16/bf16
compression hooks, each a :class:`~benchmarks.suite.variants.Runner` (not ours: no library
accounting, analytic bytes instead).

Why the compression hooks: published evaluations of gradient compression (Agarwal et al., "On the
utility of gradient compression in distributed training systems", MLSys 2022) hold it against
DDP with ``bf16_compress_hook``, which halves DDP's bytes at the cost of one cast each way; a
compressor that does not beat that has not earned its complexity (docs/benchmarking.md#fair-baselines).
"""
# no `from __future__ import annotations`: DDP checks the hooks' annotations as objects
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["ddp_bytes_per_step", "b_ddp", "DDP_HOOKS", "bf16_hook", "fp16_hook"]



def bf16_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook``, called through this wrapper: DDP refuses the hook by its
    name on builds without CUDA + NCCL (``_check_comm_hook``), though Gloo reduces bfloat16 on
    CPU as it does float16 (torch 2.13, checked at 2 ranks); the computation is torch's own."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks.bf16_compress_hook(state, bucket)


def fp16_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``fp16_compress_hook`` (no name check to avoid; wrapped as bf16's, for symmetry)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks.fp16_compress_hook(state, bucket)


def ddp_bytes_per_step(model: nn.Module, size: int, rank_r: int | None = None, min_rate: float = 2.0,
                       elem_bytes: int = 4) -> int:
    """Analytic bytes each rank sends per step: ring allreduce 2(P-1)/P of what DDP reduces.

    Plain DDP reduces every gradient (fp32; ``elem_bytes=2`` with the fp16/bf16 hooks). PowerSGD
    (``rank_r``) reduces, per 2-D view (n x m) of a >= 2-D gradient, P (n x r) and Q (m x r) when
    that compresses at least ``min_rate``-fold (torch's ``min_compression_rate``), and the rest
    uncompressed.
    """
    elems = 0
    for p in model.parameters():
        if rank_r is None or p.dim() <= 1:
            elems += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(rank_r, n, m)
        elems += (n + m) * r if n * m >= min_rate * (n + m) * r else n * m
    return int(2 * (size - 1) / size * elem_bytes * elems)


def b_ddp(model: nn.Module, ctx: Any, powersgd_rank: int | None = None, first_bucket: bool = True,
          hook: str | None = None, make_opt: Callable[[nn.Module, Any], Any] | None = None) -> Any:
    """DDP on a Gloo group of its own; ``powersgd_rank`` adds the PowerSGD hook, ``hook`` ("fp16",
    "bf16") the compression hook (gradients cast for the allreduce, the average cast back)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .variants import Runner, _sgd
    make_opt = make_opt or _sgd
    # one Gloo group per DDP instance: with three DDPs on one group, ResNet jobs intermittently
    # died of a Gloo message-size mismatch inside backward (docs/benchmarking.md#powersgd-buckets)
    group = ctx.new_ddp_group() if ctx.new_ddp_group is not None else ctx.ddp_group
    # bucket_cap_mb=None is DDP's default: 25 MiB buckets after a 1 MiB first one. An explicit 25
    # is not the same: torch makes the first bucket only when bucket_cap_mb is None
    # (BucketCapacityConfig), so the explicit cap means no first bucket (`ddp_nofirst`). PowerSGD
    # keeps the explicit cap: its hook chains further collectives from each bucket's callbacks,
    # and with several buckets in flight Gloo receives them in a different order on each rank (a
    # message-size mismatch; docs/benchmarking.md#powersgd-buckets). The fp16/bf16 hooks run one
    # allreduce per bucket, as DDP itself, so they keep DDP's default buckets.
    first_bucket = first_bucket and powersgd_rank is None
    ddp = DDP(model, bucket_cap_mb=None if first_bucket else 25, process_group=group)
    name = "ddp" if first_bucket else "ddp_nofirst"
    elem_bytes = 4
    if powersgd_rank is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=powersgd_rank,
                                   start_powerSGD_iter=max(2, ctx.powersgd_start))
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        name = f"ddp_powersgd{powersgd_rank}"
    elif hook is not None:
        ddp.register_comm_hook(group, DDP_HOOKS[hook])
        name, elem_bytes = f"ddp_{hook}", 2
    return Runner(name, ddp, make_opt(ddp, ctx), model,
                  analytic_bytes=ddp_bytes_per_step(model, ctx.size, powersgd_rank, elem_bytes=elem_bytes))


# hook name -> the torch compression hook (each sends 2 bytes per gradient element)
DDP_HOOKS: dict[str, Callable[[Any, Any], torch.futures.Future[torch.Tensor]]] = {"fp16": fp16_hook, "bf16": bf16_hook}
