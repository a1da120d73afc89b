"""Step times of S-SGD (DDP's allreduce) and the low-communication variants on an emulated link
(benchmarks/netemu.py: one network namespace per rank, tc-shaped veth links, Open MPI or MPICH
between them), for the time-to-loss comparison of docs/diloco.md#measured.

    python -m benchmarks.lowcomm_netemu --net 100mbit --steps 110 --out benchmarks/results/lowcomm/netemu

A variant is any of benchmarks/lowcomm_bench.py's names (its table or a recipe such as
``diloco_h50_olr1.0_om0.5``), built by lowcomm_bench's own code, so a step time here and a loss
curve there are the same configuration; ``compute`` is the same training step with the inner
optimizer alone (no communication), the step's compute on these hosts; ``torch_ddp`` and
``torch_ddp_bf16`` are PyTorch's DistributedDataParallel itself (its C++ reducer, default buckets,
Gloo over the emulated link) and DDP with torch's ``bf16_compress_hook``: the dense
baselines, whose loss curves are lowcomm_bench's ``ddp`` (S-SGD) and ``ddp_bf16`` (S-SGD on bf16-rounded
averaged gradients). Each variant trains lowcomm_bench's GPT
(``--layers/--width/--context/--batch``, inner AdamW) for ``--steps`` steps on ``--hosts`` emulated
hosts (2 by default); rank 0 reports the mean wall time per training step (the first ``--skip``
steps left out; keep ``steps - skip`` a multiple of the variants' periods so every period's sync is
counted once) and the bytes its link sent. ``--repeats R`` runs the variants R times in turn
(interleaved, so a load change hits them alike) and takes each variant's median. A run this short
measures the step's cost on the link, not the loss: the time to a loss is the loss curve's step
count (lowcomm_bench, in-process ranks, the same model and data; ``--curves``, which may name
several runs of different lengths, e.g. a longer DiLoCo run) times the step time measured here
(:func:`time_to_loss`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

VARIANTS = ("compute", "ddp", "diloco_h50")
# PyTorch DDP on Gloo (launched one process per host with env://), and with bf16_compress_hook;
# the lowcomm_bench variant whose loss curve stands for each
TORCH_DDP = {"torch_ddp": (None, "ddp"), "torch_ddp_bf16": ("bf16", "ddp_bf16")}


def _schedule_and_compression(name: str):
    """lowcomm_bench's (schedule factory, compression factory) for variant ``name``."""
    from benchmarks.lowcomm_bench import parse_variant, variants
    table = variants(20, 50, 100)
    return table[name] if name in table else parse_variant(name)


def worker(args: argparse.Namespace) -> None:
    import torch

    import torch_plugin as hco
    from benchmarks.gpt_model import GPT, GPTShape, lm_loss
    from benchmarks.suite.rankenv import link_counter
    from benchmarks.text_corpus import batches, load_text_corpus
    torch.set_num_threads(1)
    if args.variant in TORCH_DDP:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        rank, barrier = dist.get_rank(), dist.barrier

        def gather(obj):
            out = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out
    else:
        comm = hco.init()
        rank, barrier, gather = comm.rank, comm.barrier, comm.allgather_object
    shape = GPTShape(layers=args.layers, heads=4, width=args.width, context=args.context, vocab=256)
    torch.manual_seed(0)
    model = GPT(shape)
    inner = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    net = model
    if args.variant == "compute":  # the same step without communication
        opt = inner
    elif args.variant in TORCH_DDP:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from benchmarks.suite.baselines import DDP_HOOKS
        net, opt = DDP(model), inner  # DDP's defaults: 25 MiB buckets after a 1 MiB first one
        hook = TORCH_DDP[args.variant][0]
        if hook is not None:
            net.register_comm_hook(None, DDP_HOOKS[hook])
    else:
        schedule, compression = _schedule_and_compression(args.variant)
        opt = hco.DistributedOptimizer(inner, named_parameters=model.named_parameters(), schedule=schedule(),
                                       compression=compression())
    it = batches(load_text_corpus(shape.context, "train"), args.batch, shape.context,
                 torch.Generator().manual_seed(1000 + rank))
    _, tx = link_counter()
    times, b0 = [], 0
    for step in range(args.steps):
        if step == args.skip:
            barrier()
            b0 = int(tx.read_text()) if tx else 0
        x, y = next(it)
        t0 = time.perf_counter()
        opt.zero_grad()
        lm_loss(net(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    sent = (int(tx.read_text()) if tx else 0) - b0
    timed = times[args.skip:]
    stats = gather({"step_s": sum(timed) / len(timed), "link_bytes": sent})
    if rank == 0:
        Path(args.out).write_text(json.dumps({"variant": args.variant, "steps": len(timed), "ranks": stats}))


def steps_to_loss(curve: list[dict], target: float) -> int | None:
    """The step of the first evaluation at or below ``target`` (None when the curve never gets there)."""
    hit = next((p for p in curve if p["val_loss"] <= target), None)
    return None if hit is None else hit["step"]


def time_to_loss(curve: list[dict], target: float, step_s: float) -> float | None:
    """Seconds to the first evaluation at or below ``target``: its step count times the measured
    time per step (None when the curve never gets there)."""
    steps = steps_to_loss(curve, target)
    return None if steps is None else steps * step_s


def curves_from(paths: list[str]) -> tuple[float, dict[str, dict]]:
    """S-SGD's final validation loss (from the first run that has ``ddp``) and every variant's
    loss curve with its run's length, from lowcomm_bench JSONs: a later file's variant of the same
    name replaces an earlier one's only when the later run is longer (a longer run may reach the
    target where a run of DDP's length does not)."""
    target, curves = None, {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        for name, r in data["results"].items():
            if name == "ddp" and target is None:
                target = r["curve"][-1]["val_loss"]
            steps = data["args"]["steps"]
            if name not in curves or steps > curves[name]["steps"]:
                curves[name] = {"curve": r["curve"], "steps": steps, "file": str(p)}
    if target is None:
        raise SystemExit(f"--curves: none of {paths} has a ddp run (the target is its final loss)")
    return target, curves


def target_and_curves(paths: list[str], given: float | None = None) -> tuple[float, dict[str, dict], dict]:
    """:func:`curves_from`'s target and curves, the target replaced by ``given`` when set (``--target``:
    a loss every variant reaches, where a low-communication curve never gets down to S-SGD's final
    loss, docs/diloco.md#measured-4-hosts); the third item goes into the summary and says which."""
    final, curves = curves_from(paths)
    if given is None:
        return final, curves, {"target_from": "ddp_final"}
    return given, curves, {"target_from": "given", "ddp_final_loss": final}


def summarise(results: dict, target: float, curves: dict[str, dict]) -> dict:
    """Per variant: the median step time, the steps and seconds to S-SGD's final loss, the ratios
    against S-SGD and its loss curve (the result's ``curves``, for the report's plot); compute's
    step time gives the configuration's communication/compute ratio (S-SGD's step less compute,
    over compute). The ratios are against ``torch_ddp`` (PyTorch DDP) when it was measured, else
    against ``ddp`` (our S-SGD); the DDP variants take the curves of lowcomm_bench's ``ddp`` and
    ``ddp_bf16``."""
    out: dict = {"target": target, "curves": {}}
    for v, r in results.items():
        c = curves.get(TORCH_DDP[v][1] if v in TORCH_DDP else v)
        if c is not None:  # kept in the summary, for the report's plot (benchmarks/lowcomm_report.py)
            out["curves"][v] = [{k: p.get(k) for k in ("step", "tokens", "val_loss")} for p in c["curve"]]
        steps = None if c is None else steps_to_loss(c["curve"], target)
        r["steps_to_ddp_loss"] = steps
        r["run_steps"] = None if c is None else c["steps"]
        r["curve_file"] = None if c is None else c["file"]
        r["time_to_ddp_loss_s"] = None if steps is None else steps * r["step_s"]
    # the baseline of the ratios: PyTorch DDP itself when it was measured, else our S-SGD
    out["baseline"] = "torch_ddp" if "torch_ddp" in results else "ddp"
    ddp = results.get(out["baseline"])
    if ddp is not None:
        for r in results.values():
            r["step_speedup_vs_ddp"] = ddp["step_s"] / r["step_s"]
            t, t0 = r.get("time_to_ddp_loss_s"), ddp.get("time_to_ddp_loss_s")
            r["time_to_loss_speedup_vs_ddp"] = None if t is None or t0 is None else t0 / t
        if "compute" in results:
            comp = results["compute"]["step_s"]
            out["comm_over_compute_ddp"] = (ddp["step_s"] - comp) / comp
    return out


def write_summary(runs: dict[str, list[dict]], network: str, args: argparse.Namespace, out: Path,
                  final: bool = True) -> None:
    """OUT/netemu_summary.json from the runs so far: each variant's median step time over its repeats
    (variants not run yet left out) and, with ``--curves``, the times to the target; printed when
    ``final``. Written after every run, so a job stopped at a timing window's end keeps what ran."""
    results = {}
    for v, rs in runs.items():
        if not rs:
            continue
        mid = sorted(rs, key=lambda r: r["step_s"])[len(rs) // 2]
        results[v] = {**mid, "network": network, "step_s": statistics.median(r["step_s"] for r in rs),
                      "repeats": [{"step_s": r["step_s"], "ranks": r["ranks"], "at": r["at"]} for r in rs]}
    summary = {"net": args.net, "args": {k: v for k, v in vars(args).items() if k != "worker"}, "results": results}
    if args.curves:
        target, curves, which = target_and_curves(args.curves.split(","), args.target)
        summary.update({**summarise(results, target, curves), **which})
        for v, r in results.items():
            if final:
                print(f"NETEMU {v}: {r['step_s'] * 1e3:.1f} ms/step, steps to the target {r['steps_to_ddp_loss']} "
                      f"(of {r['run_steps']}), time {r['time_to_ddp_loss_s']}, x ddp {r.get('time_to_loss_speedup_vs_ddp')}")
    elif "ddp" in results and "compute" in results:
        summary.update({k: v for k, v in summarise(results, float("nan"), {}).items() if k not in ("target", "curves")})
    if final and "comm_over_compute_ddp" in summary:
        print(f"NETEMU communication/compute of a ddp step: {summary['comm_over_compute_ddp']:.1f}")
    (out / "netemu_summary.json").write_text(json.dumps(summary, indent=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="ddp")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--net", default="100mbit")
    ap.add_argument("--steps", type=int, default=110)
    ap.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the mean")
    ap.add_argument("--repeats", type=int, default=1, help="run the variants this many times in turn; medians")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--hosts", type=int, default=2, help="emulated hosts, one rank each")
    ap.add_argument("--curves", default=None,
                    help="comma-separated lowcomm_bench JSONs: time to the ddp run's final loss per variant "
                         "(a variant's longest run counts)")
    ap.add_argument("--target", type=float, default=None,
                    help="with --curves: the time to this validation loss instead of the ddp run's final one "
                         "(a loss every variant's curve reaches)")
    ap.add_argument("--out", default="benchmarks/results/lowcomm/netemu")
    ap.add_argument("--rescore", action="store_true",
                    help="measure nothing: apply --curves to the step times of OUT/netemu_summary.json")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.rescore:
        path = Path(args.out) / "netemu_summary.json"
        summary = json.loads(path.read_text())
        target, curves, which = target_and_curves(args.curves.split(","), args.target)
        summary.update({**summarise(summary["results"], target, curves), **which})
        path.write_text(json.dumps(summary, indent=1))
        return
    from benchmarks.netemu import EmulatedCluster
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parent.parent)
    names = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in names}
    with EmulatedCluster(n=args.hosts, rate=args.net) as cl:
        env = {"PYTHONPATH": root, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HVD_COMMOPT_BACKEND": "mpi"}
        for rep in range(args.repeats):
            for v in names:
                path = out / f"{v}.json"
                path.unlink(missing_ok=True)
                cmd = [sys.executable, "-m", "benchmarks.lowcomm_netemu", "--worker", "--variant", v, "--out", str(path)]
                cmd += [f"--{k}={getattr(args, k)}" for k in ("steps", "skip", "layers", "width", "context", "batch")]
                res = cl.run_torch(cmd, env=env, timeout=args.timeout) if v in TORCH_DDP else \
                    cl.run_mpi(cmd, env=env, timeout=args.timeout)
                if not path.exists():
                    raise SystemExit(f"{v}: no result on {cl.network}:\n{(res.stdout + res.stderr)[-3000:]}")
                run = json.loads(path.read_text())
                run["step_s"] = max(r["step_s"] for r in run["ranks"])
                run["at"] = time.strftime("%H:%M:%S", time.gmtime())
                runs[v].append(run)
                print(f"NETEMU {v} on {cl.network} (repeat {rep}): {run['step_s'] * 1e3:.1f} ms/step, link bytes/step "
                      f"{run['ranks'][0]['link_bytes'] / run['steps']:.0f}", flush=True)
                last = rep == args.repeats - 1 and v == names[-1]
                write_summary(runs, cl.network, args, out, last)  # after every run: a cut-off job keeps its runs


if __name__ == "__main__":
    main()
