"""Where a step's time goes, per rank: our variants against DDP's, on the suite's workloads.

    python -m benchmarks.suite.step_profile --model transformer --variants ssgd,auto_dense,ddp,ddp_bf16
    (re-launches itself on 2 local ranks; ``--cprofile``/``--torch-profile`` add the profiles)

Per variant and rank it records, over ``--steps`` steps after ``--warmup`` (variants interleaved
block by block, as the suite times them):

* the phases' wall time: zero_grad + forward, backward, ``opt.step()`` (for DDP the allreduce
  waits are inside backward: its reducer finishes in the autograd engine's final callback);
* the CPU seconds the whole process used per step (``getrusage``: every thread, the progress
  thread's collectives included) and the main thread's (``time.thread_time``). CPU seconds do
  not depend on the machine's load the way wall time does, so a variant that does more work per
  step shows it here even in a loaded window (docs/benchmarking.md#step-profile);
* with ``--cprofile``: the main thread's Python functions by own time (the gradient hooks,
  packing, the finish passes), as shares of the step;
* with ``--torch-profile``: torch's operators by self CPU time, as shares (copies, casts, the
  scale and finite passes), all threads.

It is a profile, not a benchmark: no figure of it is a throughput claim (the suite's
interleaved blocks are, benchmarks/run.py).
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pstats
import random
import resource
import statistics
import sys
import time
from typing import Any

__all__ = ["main", "cpu_seconds"]


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _launch(argv: list[str], ranks: int, net: str, ranks_per_host: int = 1) -> None:
    """Re-run this module on ``ranks`` ranks (with a Gloo rendezvous for DDP) and exit: local
    ranks on loopback, or one emulated host per rank on the link ``net`` ("10gbit", ...), as
    ``benchmarks.run`` places them (``ranks_per_host`` on each: 4 ranks, 2 per host, are the 2 x 2
    hosts row), so the profile sees the trust row's transport (Gloo across hosts for our
    variants, docs/backends.md#choice) and link."""
    from benchmarks.common import relaunch_under_mpirun, under_launcher
    if net == "loopback" or under_launcher():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(random.randint(20000, 40000)))
        relaunch_under_mpirun(ranks, ["-m", "benchmarks.suite.step_profile"] + argv)
        return
    from benchmarks.common import ROOT
    from benchmarks.netemu import EmulatedCluster
    if ranks_per_host < 1 or ranks % ranks_per_host:
        raise SystemExit(f"--ranks {ranks} is not a multiple of --ranks-per-host {ranks_per_host}")
    with EmulatedCluster(n=ranks // ranks_per_host, rate=net, ranks_per_host=ranks_per_host) as cl:
        env = {"PYTHONPATH": str(ROOT), "MASTER_ADDR": cl.hosts[0], "MASTER_PORT": str(random.randint(20000, 40000)),
               "GLOO_SOCKET_IFNAME": "veth0" if cl.netns else "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        res = cl.run_mpi([sys.executable, "-m", "benchmarks.suite.step_profile"] + argv, env=env, timeout=1800)
        print(res.stdout + res.stderr, end="")
        print(f"(network: {cl.network})")
    sys.exit(res.returncode)


def _pstats_top(prof: cProfile.Profile, total_s: float, n: int) -> list[dict[str, Any]]:
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (fn, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"fn": f"{os.path.basename(fn)}:{line}:{name}", "calls": nc, "own_s": tt, "cum_s": ct,
                     "own_share": tt / total_s if total_s else 0.0})
    rows.sort(key=lambda r: -r["own_s"])
    return rows[:n]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from benchmarks.suite import variants as V
    from benchmarks.suite.rankenv import setup
    from benchmarks.suite.workloads import Workload, rank_device, workload

    env = setup(None)
    wl = workload(args.model, False, rank_device("cpu", env.rank), args.shape)
    torch.manual_seed(0)
    base = wl.build()
    x, y = wl.batch()
    optimizer = args.optimizer or ("adamw" if args.model == "transformer" else "sgd")
    ctx = V.Ctx(mode="throughput", rank=env.rank, size=env.size, optimizer=optimizer,
                lr=1e-3 if optimizer == "adamw" else 0.01, ddp_group=env.ddp_group,
                new_ddp_group=env.new_gloo_group, gloo_comm=env.gloo_comm,
                fresh_comm=env.fresh_comm if env.backend == "gloo" else None, backend_comm=env.backend_comm)
    runners: dict[str, V.Runner] = {}
    for name in args.variants.split(","):
        runners[name] = V.build(name, copy.deepcopy(base), ctx)
        env.barrier()

    from benchmarks.suite.worker import apply_ab_switches

    def step(r: V.Runner, rec: dict[str, list[float]] | None, prof: cProfile.Profile | None = None) -> None:
        apply_ab_switches(r)  # the A/B variants' module switches, as the suite's timed step sets them
        t0, c0, m0 = time.perf_counter(), cpu_seconds(), time.thread_time()
        if prof is not None:
            prof.enable()
        r.opt.zero_grad()
        loss = Workload.loss(r.module(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        r.opt.step()
        t3 = time.perf_counter()
        if prof is not None:
            prof.disable()
        if rec is not None:
            for k, v in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt_step", t3 - t2), ("wall", t3 - t0),
                         ("cpu_process", cpu_seconds() - c0), ("cpu_main", time.thread_time() - m0)):
                rec.setdefault(k, []).append(v)

    for name, r in runners.items():  # warm-up, and until a planned fusion / auto's policy settles
        for _ in range(args.warmup):
            step(r, None)
        for _ in range(80):
            if not any(env.gather(r.tuning())):
                break
            step(r, None)
        r.drain()
    recs: dict[str, dict[str, list[float]]] = {n: {} for n in runners}
    profs = {n: cProfile.Profile() for n in runners} if args.cprofile else {}
    from benchmarks.common import block_order
    for b in range(args.blocks):
        for name in block_order(list(runners), b):
            env.barrier()
            step(runners[name], None)  # untimed: the block starts from idle
            for _ in range(args.steps):
                step(runners[name], recs[name], profs.get(name))
            runners[name].drain()
    out: dict[str, Any] = {}
    for name, rec in recs.items():
        row: dict[str, Any] = {k: statistics.median(v) for k, v in rec.items()}
        row["mean"] = {k: statistics.fmean(v) for k, v in rec.items()}
        if name in profs:
            row["cprofile_top"] = _pstats_top(profs[name], sum(rec["wall"]), args.top)
        if runners[name].ours:
            row["buckets"] = [(b.name, b.numel) for b in runners[name].opt.comm_engine.engine.buckets]
            rep = runners[name].opt.compression_report
            if rep:
                row["methods"] = {k: v.get("method") for k, v in (rep.get("buckets") or {}).items()} \
                    if isinstance(rep.get("buckets"), dict) else rep.get("buckets")
        out[name] = row
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile
        for name, r in runners.items():
            env.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(args.steps):
                    step(r, None)
                r.drain()
            rows = []
            evs = p.key_averages()
            total = sum(e.self_cpu_time_total for e in evs)
            for e in sorted(evs, key=lambda e: -e.self_cpu_time_total)[:args.top]:
                rows.append({"op": e.key, "calls": e.count, "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps,
                             "share": e.self_cpu_time_total / total if total else 0.0})
            out[name]["torch_top"] = rows
            out[name]["torch_self_ms_per_step"] = total / 1e3 / args.steps
    return {"model": args.model, "rank": env.rank, "size": env.size, "backend": env.backend,
            "optimizer": optimizer, "loadavg": os.getloadavg(), "steps": args.steps, "blocks": args.blocks,
            "results": out}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--shape", default="auto")
    ap.add_argument("--optimizer", default=None, choices=["sgd", "adamw"])
    ap.add_argument("--variants", default="ssgd,auto_dense,bf16,ddp,ddp_bf16")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--net", default="loopback", help="loopback (local ranks) or a tc rate (10gbit, 1gbit, ...): "
                    "one emulated host per rank, as benchmarks.run runs the trust rows")
    ap.add_argument("--ranks-per-host", type=int, default=1, help="with --net: ranks on each emulated host")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="benchmarks/results/step_profile")
    args = ap.parse_args(argv)
    _launch(argv, args.ranks, args.net, args.ranks_per_host)
    try:
        res = run(args)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        raise
    from benchmarks.common import ROOT
    out = os.path.join(ROOT, args.out)  # the emulated hosts' ranks run in the cluster's work folder
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/{args.model}.rank{res['rank']}.json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    if res["rank"] == 0:
        print(f"{args.model} rank 0, load {res['loadavg'][0]:.2f}; medians in ms per step")
        print(f"{'variant':<14}{'wall':>8}{'fwd':>8}{'bwd':>8}{'step':>8}{'cpu(all)':>10}{'cpu(main)':>10}")
        for name, r in res["results"].items():
            print(f"{name:<14}" + "".join(f"{1e3 * r[k]:>8.1f}" for k in ("wall", "fwd", "bwd", "opt_step"))
                  + f"{1e3 * r['cpu_process']:>10.1f}{1e3 * r['cpu_main']:>10.1f}")
    import torch_plugin as hco
    hco.shutdown()


if __name__ == "__main__":
    main()
