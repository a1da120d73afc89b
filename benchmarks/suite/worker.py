"""One rank of a throughput job: every variant on one model, interleaved block by block.

    (started by benchmarks/run.py through netemu's run_mpi; not meant to be run by hand)
    python -m benchmarks.suite.worker --model resnet18 --variants compute,ddp,ssgd --out r.json

Why interleaved blocks: the machine is shared and noisy; running variant A's block, then B's,
then A's again lets the noise of any minute hit every variant alike, and the median over blocks
drops the outliers. Every other block runs the variants in reverse (``block_order``), so no
variant always follows the same one. The compute-only bound is a variant like the others, measured in the same
job. A block's time includes draining rounds a delayed schedule keeps in flight, so no variant's
communication spills into the next one's block. Per variant and rank the worker also reads the
emulated link's tx byte counter around each block (bytes that really crossed the shaped link)
and, for our variants, the library's own accounting (``comm_stats['bytes_sent']``).

After timing, each variant runs one traced step (``--traced-steps N``: N in a row) with the
Chrome-trace timeline on (``--timeline-dir``): forward/backward/step spans and gradient-ready
instants from here, each collective from the communicator's progress thread.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from hvd_commopt import timeline
from hvd_commopt.comm import direct, half_sum
from hvd_commopt.compress import quant_native
from hvd_commopt.select import host_native
from torch_plugin import pair_sum

from ..common import ROOT, block_order

from . import variants as V
from .rankenv import RankEnv, setup
from .workloads import MODELS, TRANSFORMER_SHAPES, Workload, rank_device, workload

__all__ = ["main", "timed_step", "apply_ab_switches", "add_ready_instants"]

_PAIR_SUM_BYTES = pair_sum.MAX_BYTES  # the library's bound, restored after a topk_ar step
_LONG_WAIT = (direct.PAUSE_MAX_S, direct.LATE_FRACTION)  # the library's, restored after an ssgd_poll200 step
_QUANT_KERNELS = quant_native._native  # the built kernels, hidden during a *_composed step


def add_ready_instants(model: torch.nn.Module) -> None:
    """Gradient-ready instants on the timeline's backward lane (cheap no-ops when it is off)."""
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, n=n: timeline.instant(f"grad {n}", "backward"))


def engine_traces() -> bool:
    """Whether the engine records gradient-ready instants, waits and updates itself (then the
    harness records only what the library cannot know: the step, forward and backward spans)."""
    from hvd_commopt.engine import engine
    return hasattr(engine, "_timeline")


def apply_ab_switches(r: V.Runner) -> None:
    """The library's module switches as the variant ``r`` wants them for its step (the A/B variants;
    every other variant gets the library's defaults back)."""
    host_native.USE_NATIVE = bool(r.native_kernels)  # the _np variants: the NumPy host kernels
    half_sum.USE_NATIVE = bool(r.native_half_sum)  # the _nphalf variants: MPI's bf16 ring sums through NumPy
    # the _composed variants: the quantisers' host kernels hidden, so the composed torch ops encode
    quant_native._native = _QUANT_KERNELS if r.native_quant else None
    # topk_ar / lags_queued: the library's module defaults for small sums and direct starts,
    # switched for this variant's step (docs/backends.md#pair-sum, docs/backends.md#direct-start); *_nolane
    # runs on a backend built without the MPI lane (variants.py)
    pair_sum.MAX_BYTES = _PAIR_SUM_BYTES if r.pair_sum else 0
    direct.START_ON_CALLER = r.direct
    direct.PAUSE_MAX_S, direct.LATE_FRACTION = _LONG_WAIT if r.long_wait_pauses else (direct.PAUSE_SHORT_S, 0.0)


def timed_step(r: V.Runner, x: torch.Tensor, y: torch.Tensor) -> None:
    """One training step, with timeline spans when a timeline is recording."""
    apply_ab_switches(r)
    with timeline.span("step", "step"):
        r.opt.zero_grad()
        with timeline.span("forward", "forward"):
            loss = Workload.loss(r.module(x), y)
        with timeline.span("backward", "backward"):
            loss.backward()
        if r.ours and engine_traces():
            r.opt.step()  # the engine records its waits and the update
        else:
            with timeline.span("optimizer.step (wait + update)", "update"):
                r.opt.step()


def _build_all(names: list[str], base: torch.nn.Module, ctx: V.Ctx, env: RankEnv) -> tuple[dict, dict]:
    runners: dict[str, V.Runner] = {}
    status: dict[str, str] = {}
    for name in names:
        try:
            runners[name] = V.build(name, copy.deepcopy(base), ctx)
            if not (runners[name].ours and engine_traces()):
                add_ready_instants(runners[name].params)
            status[name] = "ok"
        except V.Skip as e:
            status[name] = f"skipped: {e}"
        env.barrier()
    return runners, status


def run(args: argparse.Namespace) -> dict:
    env = setup(args.progress)
    wl = workload(args.model, args.quick, rank_device(args.device, env.rank), args.transformer_shape)
    batch = wl.batch_per_rank
    torch.manual_seed(0)
    base = wl.build()
    x, y = wl.batch()
    ctx = V.Ctx(mode="throughput", rank=env.rank, size=env.size, density=args.density, period=args.steps,
                optimizer=args.optimizer, lr=1e-3 if args.optimizer == "adamw" else 0.01,
                ddp_group=env.ddp_group, new_ddp_group=env.new_gloo_group, gloo_comm=env.gloo_comm,
                fresh_comm=env.fresh_comm if env.backend == "gloo" else None,
                backend_comm=env.backend_comm)
    tx_start = env.tx_bytes()
    runners, status = _build_all(args.variants.split(","), base, ctx, env)
    env.progress(phase="built", model=args.model, total=len(runners) * (args.blocks + 1))

    def run_steps(r: V.Runner, n: int, untimed: int = 0) -> tuple[list[float], int, int, int]:
        """Time ``n`` steps after ``untimed`` ones (drained, not counted); bytes: the communicator's
        counter (every collective the variant ran, model averages included), and the link's tx counter.

        Why untimed steps at each block's start: the variants take turns, so each block starts
        from idle. DDP + PowerSGD's first step after an idle second took 1.7-2.1x its other steps
        in jobs of 13 variants (docs/benchmarking.md#block-warmup), every other variant's 0.8-1.2x."""
        env.barrier()
        if untimed:
            for _ in range(untimed):
                timed_step(r, x, y)
            r.drain()
            env.barrier()
        traffic = r.opt.comm_engine.comm.traffic if r.ours else None
        sent0 = traffic.snapshot()["bytes_sent"] if traffic else 0
        tx0 = env.tx_bytes()
        times = []
        t_block = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            timed_step(r, x, y)
            times.append(time.perf_counter() - t0)
        r.drain()  # in-flight rounds belong to this block
        total = time.perf_counter() - t_block
        sent = traffic.snapshot()["bytes_sent"] - sent0 if traffic else 0
        return times, sent, env.tx_bytes() - tx0, int(total * 1e9)

    samples: dict[str, dict[str, list]] = {k: {"block_s": [], "step_s": [], "acct": [], "link": []} for k in runners}
    failed: dict[str, str] = {}
    for name, r in runners.items():  # warm-up: allocation, first touch, PowerSGD's plain iterations
        try:
            run_steps(r, max(2, args.warmup))  # >= 2: PowerSGD compresses from its 3rd step
            for _ in range(60):  # planned fusion: time only the final plan (phases agree across ranks)
                if not any(env.gather(r.tuning())):
                    break
                run_steps(r, 1)
        except Exception as e:  # noqa: BLE001 - symmetric failures are reported, not fatal
            failed[name] = f"error: {type(e).__name__}: {e}"
            print(f"rank {env.rank}: variant {name} failed in warm-up:\n{traceback.format_exc()}", file=sys.stderr)
        env.progress(phase="warmup", variant=name, advance=1)
    for name in failed:
        runners.pop(name)
    for b in range(args.blocks):
        for name in block_order(list(runners), b):
            if name not in runners:
                continue
            r = runners[name]
            try:
                times, acct, link, total_ns = run_steps(r, args.steps, args.block_warmup)
            except Exception as e:  # noqa: BLE001
                failed[name] = f"error: {type(e).__name__}: {e}"
                print(f"rank {env.rank}: variant {name} failed in block {b}:\n{traceback.format_exc()}", file=sys.stderr)
                runners.pop(name)
                continue
            s = samples[name]
            s["block_s"].append(total_ns / 1e9 / args.steps)
            s["step_s"].extend(times)
            s["acct"].append(acct / args.steps)
            s["link"].append(link / args.steps)
            env.progress(phase="block", block=b, variant=name, advance=1)
    status.update(failed)

    traces: dict[str, str] = {}
    if args.timeline_dir:
        for name, r in runners.items():
            env.barrier()
            timeline.start(f"{args.timeline_dir}/{name}.json", env.rank)
            timeline.instant("traced step", "step")
            for _ in range(max(1, args.traced_steps)):
                timed_step(r, x, y)
            r.drain()
            path = timeline.stop() or ""
            # stored relative to the repository, so a report does not carry this machine's paths
            # is_relative_to, not a string prefix: --out /tmp/x1 from a tree at /tmp/x is not inside it
            resolved = Path(path).resolve()
            traces[name] = str(resolved.relative_to(ROOT)) if path and resolved.is_relative_to(ROOT) else path
    env.barrier()
    job_tx = env.gather(env.tx_bytes() - tx_start)
    lo_shared = env.iface == "lo"  # one counter for every rank (and any other local traffic)

    out: dict[str, Any] = {}
    for name in runners:
        s = samples[name]
        med_block = statistics.median(s["block_s"])
        # the job runs at its slowest rank's pace: take the slowest rank's median
        step_s = env.max_over_ranks(med_block)
        link_per_rank = env.gather(statistics.median(s["link"]) / (env.size if lo_shared else 1))
        acct_per_rank = env.gather(statistics.median(s["acct"]) if runners[name].ours else None)
        out[name] = {
            "step_s": step_s, "samples_per_s": batch * env.size / step_s,
            "block_step_s_rank0": s["block_s"], "step_s_rank0": s["step_s"], "median_single_step_s_rank0": statistics.median(s["step_s"]),
            "bytes_sent_per_step_accounted": acct_per_rank,
            "bytes_per_step_analytic": runners[name].analytic_bytes,
            "link_tx_bytes_per_step": link_per_rank,
            "timeline": traces.get(name),
        }
        rep = getattr(runners[name].opt, "fusion_report", None) if runners[name].ours else None
        if rep:
            out[name]["fusion_report"] = json.loads(json.dumps(rep, default=str))
        auto = runners[name].opt.compression_report if runners[name].ours else None
        if auto:  # what compression="auto" chose per bucket, and its predicted and measured step
            out[name]["compression_report"] = json.loads(json.dumps(auto, default=str))
    nparams = sum(p.numel() for p in base.parameters())
    return {"mode": "throughput", "model": args.model, "params": nparams, "batch_per_rank": batch,
            "device": str(wl.device), "tokens_per_sample": wl.tokens_per_sample,
            "ranks": env.size, "blocks": args.blocks, "steps_per_block": args.steps, "warmup_steps": args.warmup,
            "block_warmup_steps": args.block_warmup,
            "density": args.density, "optimizer": args.optimizer, "period": args.steps, "backend": env.backend,
            "mpi_library": env.mpi_library,
            "link_iface": env.iface, "link_shared_by_ranks": lo_shared, "job_link_tx_bytes_per_rank": job_tx,
            "torch": torch.__version__, "status": status, "results": out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one rank of a benchmarks.run throughput job")
    ap.add_argument("--model", required=True, choices=MODELS)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    ap.add_argument("--transformer-shape", default="auto", choices=TRANSFORMER_SHAPES)
    ap.add_argument("--variants", required=True)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block-warmup", type=int, default=1)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"],
                    help="the wrapped optimizer (SGD with momentum 0.9, or AdamW as transformers are trained)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", default=None)
    ap.add_argument("--timeline-dir", default=None)
    ap.add_argument("--traced-steps", type=int, default=1)
    args = ap.parse_args(argv)
    result = run(args)
    import torch_plugin as hco
    if hco.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    hco.shutdown()


if __name__ == "__main__":
    main()
