"""Main-thread CPU per layer of LAGS (Top-k 1 %, one bucket per layer) against the compute-only step.

    python -m benchmarks.layer_overhead_bench                  # re-launches itself on 2 local ranks
    HVD_COMMOPT_BACKEND=gloo HVD_COMMOPT_MPI_SMALL_BYTES=65536 python -m benchmarks.layer_overhead_bench
    HVD_COMMOPT_BACKEND=gloo python -m benchmarks.layer_overhead_bench --variants ssgd,ddp   # dense, DDP
    python -m benchmarks.layer_overhead_bench --variants bf16,ddp_bf16    # bf16 against DDP's hook

The model is the suite's ``deep_mlp`` (48 weight layers of up to 65k elements, batch 32), one
thread per rank, on loopback. Two variants, interleaved block by block so machine noise hits both
alike: ``compute`` (plain SGD with momentum, no communication) and ``lags`` (the same SGD wrapped
with ``Compression.topk(0.01)`` and ``fusion_threshold=0``: one bucket per layer, momentum
correction on; docs/lags-omgs.md). The second command is what a multi-host job gets: the Gloo
backend with the small collectives on MPI.

Per step the main thread's CPU time (``time.thread_time()``; backward of CPU tensors runs on the
calling thread) is split into ``hooks``, the CPU spent inside the library's gradient hooks, and
``step()``, the CPU of ``optimizer.step()`` (the round's finish and the update). Nothing in the
library is wrapped: each parameter gets one post-accumulate-grad hook registered before the
optimizer is wrapped and one after, which run just before and just after the library's own hook,
and the thread-time deltas between the two are summed. ``compute`` gets the same pair of hooks, so
their cost is in both. The last line is ``(lags main CPU - compute main CPU) / layers``: the
library's main-thread work per layer, in µs. Printed figures are medians over blocks of the
per-block mean, on rank 0 (the ranks agree to a few %).

``--variants`` adds the dense path: ``ssgd`` (the same SGD wrapped with the library's defaults) and
``ddp`` (``DistributedDataParallel`` on a Gloo group of its own, its defaults), and the bf16 pair:
``bf16`` (the library's ``Compression.bf16``) and ``ddp_bf16`` (DDP with torch's
``bf16_compress_hook``, as the suite's baseline). DDP's reducer hooks
run inside autograd, not between the bracketing hooks, so its ``in hooks`` column is only the
brackets' own cost and its work shows in ``main CPU``. On loopback both ranks share the two cores,
so ``wall`` there is a rough parity check; ``main CPU`` is the per-rank work to compare.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import block_order, relaunch_under_mpirun, table  # noqa: E402

FIELDS = ("main", "hooks", "step", "wall")
VARIANTS = ("compute", "lags", "ssgd", "ddp", "bf16", "ddp_bf16")


def _hook_pair(params, acc: dict) -> tuple[list, list]:
    """Hooks that bracket whatever is registered between them: the first notes the thread time,
    the second adds the time since to ``acc["hooks"]``."""
    mark = [0.0]

    def before(_p):
        mark[0] = time.thread_time()

    def after(_p):
        acc["hooks"] += time.thread_time() - mark[0]
    return [before] * len(params), [after] * len(params)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--variants", default="compute,lags",
                   help="comma-separated, from compute (always run), lags, ssgd, ddp, bf16, ddp_bf16")
    args = p.parse_args()
    names = ["compute"] + [v for v in args.variants.split(",") if v and v != "compute"]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    relaunch_under_mpirun(args.ranks, sys.argv)

    import torch
    import torch.nn.functional as F

    import torch_plugin as hco
    from benchmarks.models import deep_mlp
    from hvd_commopt import runtime

    hco.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, x = deep_mlp(), torch.randn(32, 64)
    y = torch.randint(0, 10, (32,))
    layers = sum(1 for q in base.parameters() if q.dim() > 1)
    steps, accs = {}, {}
    for name in names:
        m = copy.deepcopy(base)
        params = list(m.parameters())
        fwd = m
        acc = accs[name] = {"hooks": 0.0}
        before, after = _hook_pair(params, acc)
        for q, h in zip(params, before):
            q.register_post_accumulate_grad_hook(h)
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        if name == "lags":
            opt = hco.DistributedOptimizer(opt, named_parameters=m.named_parameters(),
                                           compression=hco.Compression.topk(args.density), fusion_threshold=0)
        elif name == "ssgd":  # the library's defaults: dense, DDP's bucket rule
            opt = hco.DistributedOptimizer(opt, named_parameters=m.named_parameters())
        elif name == "bf16":
            opt = hco.DistributedOptimizer(opt, named_parameters=m.named_parameters(), compression=hco.Compression.bf16)
        elif name in ("ddp", "ddp_bf16"):  # its own Gloo group, DDP's defaults (1 MiB first bucket, then 25 MiB)
            import datetime

            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel

            from hvd_commopt import env
            from torch_plugin.rendezvous import init_default_group
            if not dist.is_initialized():  # the library ran on MPI: DDP needs a default group, whose
                # rendezvous goes over that MPI backend (the control plane init_default_group expects)
                init_default_group("gloo", env.detect_launch(), datetime.timedelta(minutes=2),
                                   runtime.communicator().backend)
            fwd = DistributedDataParallel(m, process_group=dist.new_group(backend="gloo"))
            if name == "ddp_bf16":
                from benchmarks.suite.baselines import bf16_hook
                fwd.register_comm_hook(None, bf16_hook)
        for q, h in zip(params, after):
            q.register_post_accumulate_grad_hook(h)

        def step(fwd=fwd, opt=opt, acc=acc):
            acc["hooks"] = 0.0
            w0, c0 = time.perf_counter(), time.thread_time()
            opt.zero_grad()
            F.cross_entropy(fwd(x), y).backward()
            c1 = time.thread_time()
            opt.step()
            c2 = time.thread_time()
            return {"main": c2 - c0, "hooks": acc["hooks"], "step": c2 - c1, "wall": time.perf_counter() - w0}
        steps[name] = step

    comm = runtime.communicator()
    for s in steps.values():  # first-touch, warm caches, the engine's first rounds
        for _ in range(3):
            s()
    per_block: dict[str, dict[str, list[float]]] = {k: {f: [] for f in FIELDS} for k in steps}
    for b in range(args.blocks):
        for k in block_order(list(steps), b):
            comm.barrier()
            rows = [steps[k]() for _ in range(args.steps)]
            for f in FIELDS:
                per_block[k][f].append(statistics.fmean(r[f] for r in rows))
    med = {k: {f: statistics.median(v[f]) for f in FIELDS} for k, v in per_block.items()}
    if hco.rank() == 0:
        backend = os.environ.get("HVD_COMMOPT_BACKEND", "default")
        print(f"\ndeep_mlp ({layers} weight layers), batch 32, {hco.size()} ranks, one thread each, loopback, "
              f"backend {backend}; median of {args.blocks} blocks x {args.steps} steps, rank 0, per step (ms)")
        print(table(["variant", "main CPU", "in hooks", "in step()", "wall"],
                    [[k] + [med[k][f] * 1e3 for f in FIELDS] for k in med]))
        for k in names[1:]:
            extra = (med[k]["main"] - med["compute"]["main"]) / layers * 1e6
            hooks = (med[k]["hooks"] - med["compute"]["hooks"]) / layers * 1e6
            print(f"({k} - compute) main CPU per layer: {extra:.0f} us (hooks {hooks:.0f} us, "
                  f"the rest {extra - hooks:.0f} us)", flush=True)
    comm.barrier()


if __name__ == "__main__":
    main()
