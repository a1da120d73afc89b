"""The benchmark suite on an emulated slow cluster, against PyTorch DDP and DDP + PowerSGD.

    python -m benchmarks.run --net 1gbit --ranks 2                  # full run at 1 Gbit/s
    python -m benchmarks.run --net 10gbit,1gbit,100mbit             # one report per setting + summary
    python -m benchmarks.run --net 1gbit --quick                    # a few minutes
    python -m benchmarks.run --net 1gbit --variants ddp,ssgd,topk --models deep_mlp --no-tta
    python -m benchmarks.run --net loopback --models transformer --variants ddp,ddp_bf16,ssgd,topk
    python -m benchmarks.run --device cuda --models transformer         # GPT-2 small shape on the GPUs
    python -m benchmarks.run --report-only                          # redo tables/plots from the JSON

Per network setting it brings up an :class:`EmulatedCluster` (one network namespace per rank,
links shaped with tc; loopback when namespaces are impossible, and the report says so), then runs
one MPI job per model (every variant interleaved, see benchmarks/suite/worker.py) and one
time-to-accuracy job on digits (benchmarks/suite/tta.py), and with ``--models transformer`` one on
the transformer to a validation-loss target (benchmarks/suite/tta_lm.py). Our variants use the default backend a
user gets (torch tensors: Gloo on our own group across hosts with MPI as control plane, MPI on
one host; docs/backends.md#choice);
``--backend mpi`` or ``gloo`` forces one, ``--backend both`` adds each of our variants again on
MPI and on Gloo (``ssgd@mpi``, ``ssgd@gloo``, ...) in the same job; DDP runs over Gloo in the same processes. Results go to ``--out`` (benchmarks/results/): ``bench_<net>.json`` and ``.md``,
plots in ``plots/<net>/``, timelines in ``timelines/<net>/<model>/``, and ``bench_summary.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_info  # noqa: E402
from benchmarks.netemu import EmulatedCluster, NetemuError, RunResult  # noqa: E402
from benchmarks.suite import report  # noqa: E402
from benchmarks.suite import variants as V  # noqa: E402
from benchmarks.suite.workloads import MODELS, TRANSFORMER_SHAPES  # noqa: E402

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    ap.add_argument("--net", default="1gbit", help="comma-separated tc rates (100mbit,1gbit,10gbit), 'none' "
                    "(unshaped veth) or 'loopback'")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each emulated host (--ranks 4 "
                    "--ranks-per-host 2: two hosts of two ranks, the ranks dealt to the hosts in turn)")
    ap.add_argument("--quick", action="store_true", help="small models, few steps: a few minutes in all")
    ap.add_argument("--variants", default=None, help=f"comma-separated; known: {','.join(V.VARIANTS)}")
    ap.add_argument("--backend", default="default", choices=["default", "mpi", "gloo", "both"],
                    help="our variants' backend: the default (Gloo across hosts, MPI on one host), one forced, or "
                         "both (each of our variants also as <name>@mpi and <name>@gloo)")
    ap.add_argument("--models", default=None, help="of resnet18,deep_mlp,transformer (default resnet18,deep_mlp; "
                    "--quick: deep_mlp); transformer also runs its own time-to-accuracy job (validation loss)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where each rank computes (cuda: one "
                    "GPU per rank; DDP's and our Gloo collectives then carry CUDA tensors)")
    ap.add_argument("--transformer-shape", default="auto", choices=TRANSFORMER_SHAPES,
                    help="auto: gpt2_small (124M) with --device cuda, else cpu (GPT_CPU, 6.4M; tiny with --quick)")
    ap.add_argument("--lm-steps", type=int, default=None, help="transformer time-to-accuracy steps (default 300; quick 20)")
    ap.add_argument("--lm-eval-every", type=int, default=None, help="steps between validations (default 25; quick 10)")
    ap.add_argument("--lm-target", type=float, default=2.5, help="validation loss target of the transformer (nats/byte)")
    ap.add_argument("--lm-optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--lm-seed", type=int, default=0,
                    help="the transformer job's seed (initial weights and training windows; the same for every variant)")
    ap.add_argument("--blocks", type=int, default=None, help="interleaved blocks per variant (default 3; quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per block = averaging period (default 4; quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per variant first (default 3; quick 2)")
    ap.add_argument("--block-warmup", type=int, default=None,
                    help="untimed steps at the start of each block, per variant (default 1, quick 0: each block "
                         "starts from idle, docs/benchmarking.md#block-warmup)")
    ap.add_argument("--traced-steps", type=int, default=1,
                    help="consecutive steps per variant in its timeline (after the timed blocks)")
    ap.add_argument("--density", type=float, default=0.001, help="sparse density for the throughput jobs")
    ap.add_argument("--no-tta", dest="tta", action="store_false", help="skip the time-to-accuracy job")
    ap.add_argument("--tta-only", action="store_true", help="only the time-to-accuracy job (no throughput jobs)")
    ap.add_argument("--tta-tasks", default=None, help="of digits,transformer (default digits, plus transformer "
                    "when --models has it)")
    ap.add_argument("--tta-epochs", type=int, default=None, help="default 12; quick 2")
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy for time-to-accuracy")
    ap.add_argument("--mpi", default="auto", choices=["auto", "openmpi", "mpich"],
                    help="auto = MPICH when installed (fills the link better), else Open MPI")
    ap.add_argument("--loopback", action="store_true", help="run on loopback even if namespaces work")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per job (default 2400; quick 300)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--no-plots", dest="plots", action="store_false")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    ap.add_argument("--report-only", action="store_true", help="rebuild markdown/plots from existing JSON")
    ap.add_argument("--merge", action="store_true", help="keep the jobs of an existing bench_<net>.json that this "
                    "run does not redo (e.g. rerun one model)")
    a = ap.parse_args(argv)
    q = a.quick
    a.variants = a.variants or ",".join(V.QUICK if q else V.DEFAULT)
    unknown = [v for v in a.variants.split(",") if not V.known(v)]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {', '.join(V.VARIANTS)} (ours also as <name>@mpi, <name>@gloo)")
    if a.backend == "both":
        names = a.variants.split(",")
        # both explicitly: the default is Gloo across hosts but MPI on loopback (one host)
        a.variants = ",".join(names + [f"{v}@{b}" for b in ("mpi", "gloo") for v in names if V.is_ours(v) and "@" not in v])
    a.models = a.models or ("deep_mlp" if q else "resnet18,deep_mlp")
    bad = [m for m in a.models.split(",") if m not in MODELS]
    if bad:
        ap.error(f"unknown model(s) {bad}; known: {', '.join(MODELS)}")
    a.tta_tasks = a.tta_tasks or ("digits,transformer" if "transformer" in a.models.split(",") else "digits")
    if set(a.tta_tasks.split(",")) - {"digits", "transformer"}:
        ap.error(f"--tta-tasks takes digits and/or transformer, not {a.tta_tasks!r}")
    a.lm_steps = a.lm_steps or (20 if q else 300)
    a.lm_eval_every = a.lm_eval_every or (10 if q else 25)
    a.blocks = a.blocks or (2 if q else 3)
    a.steps = a.steps or (2 if q else 4)
    a.warmup = a.warmup if a.warmup is not None else (2 if q else 3)
    a.block_warmup = a.block_warmup if a.block_warmup is not None else (0 if q else 1)
    a.tta_epochs = a.tta_epochs or (2 if q else 12)
    a.timeout = a.timeout or (300.0 if q else 2400.0)
    return a


class _Progress:
    """tqdm bar on the launcher's side, fed by the lines rank 0 appends to a progress file."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="block", dynamic_ncols=True, file=sys.stderr, mininterval=1.0)

    def follow(self, path: Path, estimate: int, desc: str, done: threading.Event) -> None:
        if self.bar is None:
            done.wait()
            return
        self.bar.set_description(desc)
        pos = 0
        advanced = 0
        while True:
            finished = done.wait(0.5)
            if path.exists():
                with path.open() as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                for line in chunk.splitlines():
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    if ev.get("phase") == "built":  # the real amount of work, once skips are known
                        self.bar.total += int(ev["total"]) - estimate
                        estimate = int(ev["total"])
                        self.bar.refresh()
                    if ev.get("advance"):
                        self.bar.update(1)
                        advanced += 1
                    if ev.get("variant"):
                        self.bar.set_postfix_str(str(ev["variant"]))
            if finished:
                if advanced < estimate:
                    self.bar.update(estimate - advanced)  # a failed job: keep the bar honest
                return

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _job_env(cl: EmulatedCluster, backend: str = "default") -> dict[str, str]:
    env = {"PYTHONPATH": str(ROOT), "MASTER_ADDR": cl.hosts[0], "MASTER_PORT": str(random.randint(20000, 40000)),
           "GLOO_SOCKET_IFNAME": "veth0" if cl.netns else "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("HVD_COMMOPT_BACKEND", "HVD_COMMOPT_TIMEOUT", "HVD_COMMOPT_FUSION_THRESHOLD"):
        if os.environ.get(k):
            env[k] = os.environ[k]
    if backend in ("mpi", "gloo"):
        env["HVD_COMMOPT_BACKEND"] = backend
    return env


def _run_job(cl: EmulatedCluster, args: argparse.Namespace, argv: list[str], workdir: Path, name: str,
             estimate: int, prog: _Progress, desc: str) -> dict[str, Any]:
    out = workdir / f"{name}.out.json"
    progress = workdir / f"{name}.progress"
    for p in (out, progress):
        p.unlink(missing_ok=True)
    cmd = [sys.executable, "-m"] + argv + ["--out", str(out), "--progress", str(progress)]
    holder: dict[str, Any] = {}
    done = threading.Event()
    load0 = os.getloadavg()  # the machine is shared: each figure goes out with its load

    def target() -> None:
        try:
            holder["res"] = cl.run_mpi(cmd, env=_job_env(cl, args.backend), timeout=args.timeout)
        except NetemuError as e:
            holder["err"] = str(e)
        finally:
            done.set()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    prog.follow(progress, estimate, desc, done)
    t.join()
    res: RunResult | None = holder.get("res")
    load = {"start": [round(v, 2) for v in load0], "end": [round(v, 2) for v in os.getloadavg()]}
    if res is not None:  # the ranks' whole output, for diagnosing a failed or odd job (one per attempt)
        log = workdir / f"{name}.log"
        if log.exists():
            log.rename(workdir / f"{name}.{int(log.stat().st_mtime)}.log")
        log.write_text(res.stdout + "\n--- stderr ---\n" + res.stderr)
    if res is None or not res.ok or not out.exists():
        tail = (res.stdout + res.stderr)[-3000:] if res is not None else holder.get("err", "")
        why = "timed out" if res is not None and res.timed_out else f"rc={res.returncode if res else '?'}"
        return {"mode": "tta" if argv[0].startswith("benchmarks.suite.tta") else "throughput", "model": name,
                "error": f"{why}: {tail.strip()[-1500:]}", "loadavg": load}
    job = json.loads(out.read_text())
    job["loadavg"] = load  # 1/5/15-minute load averages at the job's start and end
    job["launcher_version"] = res.launcher_version
    job["elapsed_s"] = res.elapsed_s
    job["link_bytes_tc"] = res.link_bytes
    if job.get("mode") == "throughput":
        tc = {h: c.get("shaped_tx_bytes") or c.get("tx_bytes", 0) for h, c in res.link_bytes.items()}
        job["link_check"] = {"source": "bytes through each host's tbf shaper (tc)" if cl.netns else
                             "lo counter (shared by the ranks and any other local traffic)",
                             "tc": {h: report.fmt_bytes(v) for h, v in tc.items()},
                             "worker": [report.fmt_bytes(v) for v in job.get("job_link_tx_bytes_per_rank", [])]}
    return job


def _run_job_retry(*a: Any) -> dict[str, Any]:
    """:func:`_run_job`, once more if it failed other than by timing out: a start-up failure on
    the shared machine (seen once: a Gloo pair mismatch while DDP was being built) should not cost
    a setting its model. The first error is kept in the result."""
    job = _run_job(*a)
    if job.get("error") and not job["error"].startswith("timed out"):
        print(f"\nbenchmarks.run: job {a[4]} failed, retrying once: {job['error'][-300:]}", file=sys.stderr)
        first = job["error"]
        job = _run_job(*a)
        job["retried_after_error"] = first[-1500:]
    return job


def run_net(net: str, args: argparse.Namespace, prog: _Progress) -> dict[str, Any]:
    out = Path(args.out)
    tag = net.replace("/", "_")
    rate = None if net in ("none", "loopback") else net
    run: dict[str, Any] = {"net": net, "ranks": args.ranks, "quick": args.quick, "variants": args.variants.split(","),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(), "jobs": []}
    rph = args.ranks_per_host
    if rph < 1 or args.ranks % rph:
        raise SystemExit(f"--ranks {args.ranks} is not a multiple of --ranks-per-host {rph}")
    run["ranks_per_host"] = rph
    with EmulatedCluster(n=args.ranks // rph, rate=rate, mpi=args.mpi, ranks_per_host=rph,
                         force_loopback=args.loopback or net == "loopback") as cl:
        run["cluster"] = {"network": cl.network, "rate": cl.rate if cl.netns else None,
                          "burst_bytes": cl.burst if cl.netns else None, "fallback_reason": cl.fallback_reason}
        work = out / "work"
        work.mkdir(parents=True, exist_ok=True)
        nvar = len(run["variants"])
        for model in ([] if args.tta_only else args.models.split(",")):
            tl_dir = out / "timelines" / tag / model
            argv = ["benchmarks.suite.worker", "--model", model, "--variants", args.variants, "--blocks",
                    str(args.blocks), "--steps", str(args.steps), "--warmup", str(args.warmup),
                    "--block-warmup", str(args.block_warmup), "--density",
                    str(args.density), "--timeline-dir", str(tl_dir),
                    "--traced-steps", str(args.traced_steps), "--device", args.device,
                    "--transformer-shape", args.transformer_shape] + (["--quick"] if args.quick else [])
            if model == "transformer":  # timed with the optimizer it is trained with (--lm-optimizer)
                argv += ["--optimizer", args.lm_optimizer]
            job = _run_job_retry(cl, args, argv, work, f"{tag}_{model}", nvar * (args.blocks + 1), prog, f"{net} {model}")
            job.setdefault("model", model)
            run["jobs"].append(job)
            if job.get("launcher_version"):
                run["cluster"]["launcher_version"] = job["launcher_version"]
        if args.tta and "digits" in args.tta_tasks.split(","):
            argv = ["benchmarks.suite.tta", "--variants", args.variants, "--epochs", str(args.tta_epochs),
                    "--target", str(args.target)] + (["--schedule-warmup", "5"] if args.quick else [])
            job = _run_job_retry(cl, args, argv, work, f"{tag}_tta", nvar * args.tta_epochs, prog, f"{net} digits")
            run["jobs"].append(job)
            if job.get("launcher_version"):
                run["cluster"]["launcher_version"] = job["launcher_version"]
        if args.tta and "transformer" in args.tta_tasks.split(","):
            argv = ["benchmarks.suite.tta_lm", "--variants", args.variants, "--steps", str(args.lm_steps),
                    "--eval-every", str(args.lm_eval_every), "--target", str(args.lm_target),
                    "--optimizer", args.lm_optimizer, "--device", args.device, "--shape", args.transformer_shape,
                    "--schedule-warmup", "5" if args.quick else "20", "--seed", str(args.lm_seed)] + \
                (["--quick"] if args.quick else [])
            job = _run_job_retry(cl, args, argv, work, f"{tag}_tta_lm", nvar * _intervals(args), prog,
                                 f"{net} transformer")
            job.setdefault("task", "lm")
            run["jobs"].append(job)
    return run


def _intervals(args: argparse.Namespace) -> int:
    return -(-args.lm_steps // args.lm_eval_every)


def _merge(run: dict[str, Any], old: dict[str, Any]) -> None:
    """Add the jobs of ``old`` (same setting, earlier run) that ``run`` did not redo; each job
    keeps its own timestamp (``started``), so the report can say which ran when."""
    key = lambda j: (j.get("mode"), j.get("model") if j.get("mode") != "tta" else j.get("task", "digits"))  # noqa: E731
    done = {key(j) for j in run["jobs"] if not j.get("error")}
    for j in run["jobs"]:
        j.setdefault("started", run["started"])
    kept = [dict(j, started=j.get("started", old.get("started"))) for j in old.get("jobs", [])
            if key(j) not in done and not j.get("error")]
    order = {"throughput": 0, "tta": 1}
    run["jobs"] = sorted([j for j in run["jobs"] if not (j.get("error") and key(j) in {key(k) for k in kept})] + kept,
                         key=lambda j: (order.get(j.get("mode"), 2), j.get("model") != "resnet18"))
    run["merged"] = True


def write_outputs(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[Path]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for run in runs:
        tag = run["net"].replace("/", "_")
        old = out / f"bench_{tag}.json"
        if getattr(args, "merge", False) and old.exists() and not run.get("merged"):
            _merge(run, json.loads(old.read_text()))
        (out / f"bench_{tag}.json").write_text(json.dumps(run, indent=1, default=str))
        md = report.net_markdown(run)
        if args.plots:
            from benchmarks.suite import plots
            pngs = plots.plot_run(run, out / "plots" / tag)
            md += "\n" + "\n".join(f"![{p.stem}](plots/{tag}/{p.name})" for p in pngs) + "\n"
        (out / f"bench_{tag}.md").write_text(md)
        written += [out / f"bench_{tag}.json", out / f"bench_{tag}.md"]
    every = report.load_runs(out)
    summary = ["# Benchmark results (latest run per network setting)", "", report.summary_markdown(every), ""]
    if args.plots:
        from benchmarks.suite import plots
        p = plots.plot_summary(every, out / "plots")
        if p:
            summary += [f"![speed-up vs DDP](plots/{p.name})", ""]
    summary += [report.net_markdown(r) for r in every]
    (out / "bench_summary.md").write_text("\n".join(summary))
    written.append(out / "bench_summary.md")
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        for p in write_outputs(report.load_runs(Path(args.out)), args):
            print(p)
        return 0
    nets = [n.strip() for n in args.net.split(",") if n.strip()]
    models = [] if args.tta_only else args.models.split(",")
    nvar = len(args.variants.split(","))
    tasks = args.tta_tasks.split(",") if args.tta else []
    total = len(nets) * (len(models) * nvar * (args.blocks + 1) + nvar * args.tta_epochs * ("digits" in tasks)
                         + nvar * _intervals(args) * ("transformer" in tasks))
    prog = _Progress(args.progress, total)
    runs = []
    try:
        for net in nets:
            runs.append(run_net(net, args, prog))
            write_outputs(runs[-1:], args)  # each setting's report as soon as it is done
    finally:
        prog.close()
    failed = [j for r in runs for j in r["jobs"] if j.get("error")]
    for r in runs:
        print(report.net_markdown(r))
    print(f"\nwrote {Path(args.out) / 'bench_summary.md'} and bench_<net>.json/.md, plots/, timelines/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
