"""The GPU benchmark: step times against the compute-only step, and selection in memory passes.

    python -m benchmarks.gpu_bench                       # CUDA: ResNet-50 and GPT-2 small, one process
    python -m benchmarks.gpu_bench --device cpu --tiny   # the same code on tiny sizes (the test's run)
    HVD_COMMOPT_BACKEND=gloo torchrun --nproc-per-node 2 -m benchmarks.gpu_bench --models resnet50 --no-selection
                                                         # 2 ranks sharing one GPU over Gloo

Per model, in one job, every variant built in the same process and timed interleaved block by
block (benchmarks/common.py's ``time_blocks``; docs/benchmarking.md#interleaving), each step
ending with a device synchronisation:

* ``compute``: the plain optimizer, no communication (the baseline of every ratio);
* ``ddp``, ``ddp_bf16``: DistributedDataParallel, and DDP with ``bf16_compress_hook``;
* ``none``, ``fp16``, ``bf16``, ``topk``, ``dgc``, ``topk_thr``: our DistributedOptimizer with no
  compression, Compression.fp16/bf16, Top-k 1 % (exact), DGC 1 %, Top-k 1 % with threshold reuse.

Models: ``resnet50`` (torchvision's, batch 64 of 3x224x224, 1000 classes; SGD momentum 0.9) and
``gpt2`` (benchmarks/gpt_model.py, 124M parameters, batch 8 x 1024 tokens, bf16 autocast). With
``--tiny``: a small CNN (batch 2 of 3x16x16) and a 2-layer GPT (batch 2 x 16).

Selection (``--sizes``, default 25M and 100M float32; tiny: 64K): time / time of one
``torch.abs(t, out=buf)`` pass of ``torch.topk(t.abs(), k)``, our exact selection, threshold
reuse in steady state, and the exact selection fused with the error-feedback add (``ef_exact``: the
sum into the residual; ``ef_exact_snap``: after a snapshot, into its spare buffer, as a step with
rollback does) and threshold reuse with it (``ef_reuse``), k = 1 %; beside them the passes counted
from the kernels (docs/selection.md#triton-passes). On
CUDA with Triton installed these run the Triton select (torch_plugin/triton_select.py,
docs/selection.md#triton-select; column ``triton``; threshold reuse's reused step then reads the data
once, docs/selection.md#triton-reuse), and ``triton_topk`` and ``triton_reuse`` (the kernels alone:
the exact select, and a reused step accepted in the band) and the ``*_torch`` columns (the same
three on the torch-op route) are measured beside them.

With one process (no launcher) DDP runs on a process group of size 1 (NCCL on CUDA, Gloo on
CPU) and ours on the local backend: the compressors run, nothing is sent. Under a launcher every
rank runs the same variants on the runtime's backend.

Writes ``benchmarks/results/gpu_bench.json`` (several ranks: ``gpu_bench_<N>r_<backend>.json``;
``--out`` for another folder), read by ``python -m benchmarks.report``'s GPU section
(benchmarks/gpu_report.py).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, block_order, machine_info, table  # noqa: E402

# the Triton routes' full-size reads and writes in abs passes (a read of n float32 is half a pass;
# work in k and launches not counted): docs/selection.md#triton-passes
TRITON_PASSES = {"exact": 1.0, "ef_exact": 2.0, "ef_exact_snap": 2.0, "reuse (accepted)": 0.5,
                 "ef_reuse (accepted)": 1.5, "reuse (recomputed)": 1.5, "ef_reuse (recomputed)": 2.5}
VARIANTS = ("compute", "ddp", "ddp_bf16", "none", "fp16", "bf16", "topk", "dgc", "topk_thr")
MODELS = ("resnet50", "gpt2")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu; default cuda when available")
    p.add_argument("--tiny", action="store_true", help="tiny models and sizes (CPU tests)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {','.join(VARIANTS)}")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps per block")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--sizes", default=None, help="selection sizes in millions of elements (default 25,100)")
    p.add_argument("--reps", type=int, default=10, help="repetitions per selection measure")
    p.add_argument("--no-selection", action="store_true")
    p.add_argument("--out", default=str(RESULTS), help="folder for gpu_bench.json")
    a = p.parse_args(argv)
    for name, allowed, given in (("variants", VARIANTS, a.variants), ("models", MODELS, a.models)):
        bad = sorted(set(given.split(",")) - set(allowed))
        if bad:
            p.error(f"unknown {name} {bad}; choose from {','.join(allowed)}")
    return a


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(name: str, tiny: bool, device):
    """(model, inputs, targets, loss(model, x, y), autocast dtype or None, note)."""
    import torch
    import torch.nn.functional as F
    from benchmarks.gpt_model import GPT, GPT2_SMALL, GPT_TINY, lm_loss
    torch.manual_seed(0)
    if name == "gpt2":
        s = GPT_TINY if tiny else GPT2_SMALL
        b = 2 if tiny else 8
        x = torch.randint(0, s.vocab, (b, s.context), device=device)
        y = torch.randint(0, s.vocab, (b, s.context), device=device)
        return GPT(s).to(device), x, y, lambda m, x, y: lm_loss(m(x), y), torch.bfloat16, f"batch {b} x {s.context}, bf16 autocast"
    if tiny:
        from benchmarks.models import resnet18
        m, x = resnet18(width=4), torch.randn(2, 3, 16, 16, device=device)
        note = "tiny ResNet-18-shaped CNN, batch 2 of 3x16x16"
    else:
        import torchvision  # the GPU machine has it; the tiny run does not need it
        m, x = torchvision.models.resnet50(), torch.randn(64, 3, 224, 224, device=device)
        note = "torchvision ResNet-50, batch 64 of 3x224x224"
    y = torch.randint(0, 10, (x.shape[0],), device=device)
    return m.to(device), x, y, lambda m, x, y: F.cross_entropy(m(x), y), None, note


def make_steps(names, model, x, y, loss, amp, device, density, ddp_group) -> dict[str, Callable[[], None]]:
    """One step closure per variant, each on its own copy of ``model``."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_plugin as hco
    comps = {"none": None, "fp16": hco.Compression.fp16, "bf16": hco.Compression.bf16,
             "topk": hco.Compression.topk(density), "dgc": hco.Compression.dgc(density),
             "topk_thr": hco.Compression.topk(density, selection="threshold")}
    steps = {}
    for name in names:
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.0 if name == "dgc" else 0.9)
        net = m
        if name in ("ddp", "ddp_bf16"):
            net = DDP(m, device_ids=[device.index] if device.type == "cuda" else None, process_group=ddp_group)
            if name == "ddp_bf16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
                net.register_comm_hook(ddp_group, default_hooks.bf16_compress_hook)
        elif name != "compute":
            kw = {} if comps[name] is None else {"compression": comps[name]}
            opt = hco.DistributedOptimizer(opt, named_parameters=m.named_parameters(), **kw)
        steps[name] = _step(net, opt, x, y, loss, amp, device)
    return steps


def _step(net, opt, x, y, loss, amp, device) -> Callable[[], None]:
    import torch

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            value = loss(net, x, y)
        value.backward()
        opt.step()
        _sync(device)
    return step


def time_interleaved(steps, blocks: int, n: int, barrier) -> dict[str, float]:
    """Median ms per step over ``blocks`` interleaved blocks of ``n`` steps, after 2 warm steps each."""
    for s in steps.values():
        s()
        s()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for b in range(blocks):
        for k in block_order(list(steps), b):
            barrier()
            for _ in range(n):
                t0 = time.perf_counter()
                steps[k]()
                samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}


def measure_selection(n: int, density: float, reps: int, device) -> dict:
    """Each selection's time over one ``abs`` pass's, same buffer, back to back."""
    import torch

    from hvd_commopt.memory.error_feedback import ErrorFeedback
    from hvd_commopt.select.strategies import ExactTopK, ReuseTopK
    from torch_plugin import device_route_ops as device_route
    from torch_plugin import ops as torch_ops
    ops, triton_available = torch_ops.TorchOps(), device_route.TRITON_SELECT
    k = max(int(n * density), 1)
    gen = torch.Generator(device=device).manual_seed(n)
    g = torch.randn(n, generator=gen, device=device)
    t, buf = g.clone(), torch.empty_like(g)

    def med(fn) -> float:
        fn()
        _sync(device)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    one = med(lambda: torch.abs(t, out=buf))
    out = {"n": n, "density": density, "k": k, "pass_ms": one * 1e3}
    out["torch.topk"] = med(lambda: torch.topk(t.abs(), k, sorted=False)) / one
    out["triton"] = device_route._triton_takes(t, k)  # the Triton select runs the device route's top-k
    for suffix, triton_on in (("", out["triton"]), ("_torch", False)):  # "_torch": the torch-op route
        if suffix and not out["triton"]:
            continue
        device_route.TRITON_SELECT = triton_on
        try:
            ex = ExactTopK()
            out["exact" + suffix] = med(lambda: ex.select(ops, t, k)) / one
            reuse = ReuseTopK(tau=1 << 30, band=0.5)
            reuse.select(ops, t, k, key="b")  # the exact step sets the threshold; then every step reuses it
            out["reuse" + suffix] = med(lambda: reuse.select(ops, t, k, key="b")) / one
            ef, sel = ErrorFeedback(), ExactTopK()
            fn = lambda r, a, o=None: (lambda res: (res.values, res.indices, res.acc))(  # noqa: E731
                sel.select(ops, r, k, addend=a, out=o))
            out["ef_exact" + suffix] = med(lambda: ef.compensate_select(ops, "b", g, fn)) / one  # into the residual

            def snapshotted(memory, select):  # the engine's step: a snapshot, the sum into the spare buffer
                memory.snapshot(ops, "b", g, 0)
                return memory.compensate_select(ops, "b", g, select)
            ef_s = ErrorFeedback()
            out["ef_exact_snap" + suffix] = med(lambda: snapshotted(ef_s, fn)) / one
            ef_r, rs = ErrorFeedback(), ReuseTopK(tau=1 << 30, band=0.5)
            fr = lambda r, a, o=None: (lambda res: (res.values, res.indices, res.acc))(  # noqa: E731
                rs.select(ops, r, k, key="b", addend=a, out=o))
            out["ef_reuse" + suffix] = med(lambda: snapshotted(ef_r, fr)) / one  # exact once, then reused steps
        finally:
            device_route.TRITON_SELECT = triton_available
    if out["triton"]:  # the kernels alone: two reads of the data plus the fix-up
        from torch_plugin import triton_select
        out["triton_topk"] = med(lambda: triton_select.topk_abs_index(t, k)) / one
        prev = (ops.topk_abs_ranked(t, k)[1][k - 1:k].clone(), torch.zeros(1, dtype=torch.int64, device=device))
        lo_c, hi_c = k - k // 2, k + k // 2  # band 0.5, as the reuse column's
        out["triton_reuse"] = med(lambda: triton_select.threshold_reuse(t, k, lo_c, hi_c, 1 << 30, prev)) / one
    return out


def _ddp_group(device):
    """The process group DDP runs on: the default one (created here, size 1, when no launcher)."""
    import datetime

    import torch.distributed as dist
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    import torch_plugin as hco
    from hvd_commopt import runtime
    want = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device (use --device cpu --tiny)")
    hco.init()
    device = torch.device("cuda", torch.cuda.current_device()) if want == "cuda" else torch.device("cpu")
    ddp_group = _ddp_group(device)
    comm = runtime.communicator()
    rank = hco.rank()
    names = a.variants.split(",")
    if "compute" not in names:
        names.insert(0, "compute")
    skipped = {}
    if device.type != "cuda" and "ddp_bf16" in names:  # torch refuses the hook without NCCL
        names.remove("ddp_bf16")
        skipped["ddp_bf16"] = "bf16_compress_hook needs CUDA and NCCL"
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "tiny": a.tiny, "ranks": hco.size(), "backend": runtime.backend_name(), "density": a.density,
                    "blocks": a.blocks, "steps": a.steps, "models": {}, "selection": [], "skipped": skipped,
                    "torch": torch.__version__, "machine": machine_info()}

    def log(s: str) -> None:
        if rank == 0:
            print(s, flush=True)
    log(f"gpu_bench on {result['device']}, {hco.size()} rank(s), backend {result['backend']}, torch {torch.__version__}")
    for model_name in a.models.split(","):
        model, x, y, loss, amp, note = build_model(model_name, a.tiny, device)
        nparams = sum(p.numel() for p in model.parameters())
        steps = make_steps(names, model, x, y, loss, amp, device, a.density, ddp_group)
        med = time_interleaved(steps, a.blocks, a.steps, comm.barrier)
        med = {k: max(comm.allgather_object(v)) for k, v in med.items()}  # the slowest rank's
        rows = [[k, v, v / med["compute"]] for k, v in med.items()]
        log(f"\n{model_name}: {nparams / 1e6:.1f}M parameters, {note}; median of {a.blocks} blocks x {a.steps} steps")
        log(table(["variant", "median step (ms)", "vs compute-only"], rows))
        for k, why in skipped.items():
            log(f"{k}: not run ({why})")
        result["models"][model_name] = {"params": nparams, "note": note, "median_step_ms": med,
                                        "ratio_vs_compute": {k: v / med["compute"] for k, v in med.items()}}
        del steps, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not a.no_selection and rank == 0:
        sizes = [float(s) for s in (a.sizes or ("0.065536" if a.tiny else "25,100")).split(",")]
        for m in sizes:
            result["selection"].append(measure_selection(int(m * 1e6), a.density, a.reps, device))
        cols = ["torch.topk", "exact", "reuse", "ef_exact", "ef_exact_snap", "ef_reuse", "triton_topk", "triton_reuse",
                "exact_torch", "reuse_torch", "ef_exact_torch", "ef_exact_snap_torch", "ef_reuse_torch"]
        log("\nselection, time / one abs pass, k = {:g} % (targets: exact <= 3, reuse <= 1.5, "
            "ef_exact <= 4; *_torch: the torch-op route, where the Triton select runs the others)".format(a.density * 100))
        log(table(["elements", "pass (ms)", "triton"] + cols,
                  [[r["n"], r["pass_ms"], r["triton"]] + [r.get(c, "-") for c in cols] for r in result["selection"]]))
        log("the Triton routes' reads and writes of the n-element buffers, in abs passes (1 read + 1 write), "
            "counted from the kernels (docs/selection.md#triton-passes): " +
            ", ".join(f"{c} {v:g}" for c, v in TRITON_PASSES.items()))
        result["triton_passes_counted"] = TRITON_PASSES
    if rank == 0:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "gpu_bench.json" if hco.size() == 1 else f"gpu_bench_{hco.size()}r_{result['backend']}.json"
        (out / name).write_text(json.dumps(result, indent=2, sort_keys=True))
        log(f"\nwrote {out / name}")
    comm.barrier()
    return result


if __name__ == "__main__":
    main()
