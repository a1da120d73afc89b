"""Fusion strategies measured against the DAG simulator's predictions, 2 ranks, one run.

    python benchmarks/fusion_bench.py            # re-launches itself on 2 local ranks
    python benchmarks/fusion_bench.py --quick    # fewer blocks and steps

For ResNet-18 (few large tensors) and a 48-layer MLP (many small ones), on the same data:

  compute     no communication (the lower bound; predicted = forward + backward of the profile)
  none        one tensor per bucket (WFBP)
  threshold   the default 25 MiB fusion threshold
  mgwfbp      MG-WFBP's greedy plan (docs/mgwfbp.md#greedy)
  optimal     the exact DP of the same model (docs/mgwfbp.md#exact-dp)
  auto        the candidate the simulator predicts fastest

The network is calibrated once (``hvd_commopt.calibrate``, fitted on rank 0 and broadcast) and
the cost model is given to the three planned optimizers, which each profile their own first
steps and plan on rank 0. Predictions for *every* variant come from one profile (rank 0's, taken
by the ``auto`` optimizer while it ran the threshold plan) and the calibrated allreduce model:
``simulate(plan, sizes, tb, allreduce, forward_time=F).iteration_time``, the predicted time from
the end of one step to the end of the next. Measurements: the variants run interleaved, block by
block (so machine noise hits them alike); each block's median step time, then the median over
blocks, then the slowest rank's value. Prints a table per model, whether each prediction is
within 25 % of the measurement, and writes ``benchmarks/results/fusion_bench.json``.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_info, relaunch_under_mpirun, table, time_blocks, train_step, write_json  # noqa: E402

VARIANTS = ("none", "threshold", "mgwfbp", "optimal", "auto")
TOLERANCE = 0.25


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--blocks", type=int, default=5, help="interleaved repetitions")
    p.add_argument("--steps", type=int, default=4, help="timed steps per block")
    p.add_argument("--models", default="resnet18,deep_mlp")
    p.add_argument("--warmup-steps", type=int, default=2, help="tuner warm-up steps")
    p.add_argument("--profile-steps", type=int, default=10, help="tuner profiled steps")
    p.add_argument("--statistic", default="min", choices=("min", "median", "mean"),
                   help="calibration statistic over repeats (see hvd_commopt.calibrate)")
    p.add_argument("--cost-model", default=None, help="JSON from python -m hvd_commopt.calibrate --out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="fusion_bench", help="results file name (benchmarks/results/<out>.json)")
    args = p.parse_args()
    if args.quick:
        args.blocks, args.steps, args.profile_steps = 2, 2, 4
    relaunch_under_mpirun(args.ranks, sys.argv)

    import torch

    import torch_plugin as hco
    from benchmarks.models import deep_mlp, resnet18
    from hvd_commopt import runtime
    from hvd_commopt.calibrate import calibrate
    from hvd_commopt.fusion import CostModel, simulate

    hco.init()
    torch.set_num_threads(1)
    comm = runtime.communicator()
    rank, size = comm.rank, comm.size
    if args.cost_model:
        import json
        cm = CostModel.from_dict(json.loads(Path(args.cost_model).read_text()))
    else:
        cm = calibrate(comm, statistic=args.statistic)
    if rank == 0:
        ar = cm.allreduce
        print(f"allreduce on {size} ranks: alpha = {ar.alpha * 1e6:.1f} us, beta = {ar.beta * 1e9:.3f} ns/B "
              f"({1 / ar.beta / 1e9 if ar.beta else float('inf'):.2f} GB/s)", flush=True)
    builders = {"resnet18": (resnet18, lambda: torch.randn(8, 3, 32, 32)),
                "deep_mlp": (deep_mlp, lambda: torch.randn(32, 64))}
    results = {}
    for model_name in args.models.split(","):
        build, make_x = builders[model_name]
        torch.manual_seed(0)
        base = build()
        x = make_x()
        y = torch.randint(0, 10, (x.shape[0],))
        opts = {"warmup_steps": args.warmup_steps, "profile_steps": args.profile_steps, "measure_steps": 0,
                "cost_model": cm}
        variants = {}
        m = copy.deepcopy(base)
        variants["compute"] = (m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
        for v in VARIANTS:
            m = copy.deepcopy(base)
            kw = {"fusion_options": opts} if v in ("mgwfbp", "optimal", "auto") else {}
            variants[v] = (m, hco.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                                                       named_parameters=m.named_parameters(), fusion=v, **kw))

        steps = {k: train_step(*v, x, y) for k, v in variants.items()}
        for k in ("mgwfbp", "optimal", "auto"):  # profile and plan, one variant at a time
            engine = variants[k][1].comm_engine
            while engine.tuner.phase in ("warmup", "profile"):
                steps[k]()
        samples = time_blocks(steps, args.blocks, args.steps, barrier=comm.barrier)  # warm-up first: new fusion buffers
        med = {k: max(comm.allgather_object(statistics.median(v))) for k, v in samples.items()}
        engines = {k: variants[k][1].comm_engine for k in VARIANTS}
        prof = engines["auto"].tuner.profile  # rank 0's (None elsewhere)
        payload = None
        if rank == 0:
            sizes, tb, fwd = list(prof.sizes_bytes), list(prof.backward_times), prof.forward_s
            pred, info = {}, {}
            for k, eng in engines.items():
                sim = simulate(eng.plan, sizes, tb, cm.allreduce, forward_time=fwd)
                pred[k] = sim.iteration_time
                info[k] = {"buckets": len(eng.plan), "non_overlapped_comm_s": sim.non_overlapped_comm,
                           "bucket_bytes": [sum(sizes[i] for i in g) for g in eng.plan]}
            pred["compute"] = fwd + sum(tb)
            info["compute"] = {"buckets": 0}
            payload = {"pred": pred, "info": info,
                       "own_reports": {k: engines[k].fusion_report for k in ("mgwfbp", "optimal", "auto")},
                       "profile": prof.to_json()}
        payload = comm.broadcast_object(payload)
        pred, info = payload["pred"], payload["info"]
        rows, res = [], {}
        for k in ("compute",) + VARIANTS:
            err = pred[k] / med[k] - 1
            ok = abs(err) <= TOLERANCE
            name = k if k != "auto" else f"auto ({payload['own_reports']['auto']['chosen']})"
            rows.append([name, info[k]["buckets"], med[k] * 1e3, pred[k] * 1e3, f"{err:+.0%}", "yes" if ok else "no"])
            res[k] = {"measured_s": med[k], "predicted_s": pred[k], "error": err, "within_25pct": ok,
                      "block_medians_s_rank_local": samples[k], **info[k]}
        nparams = sum(q.numel() for q in base.parameters())
        results[model_name] = {"params": nparams, "tensors": len(payload["profile"]["tensors"]),
                               "variants": res, "own_reports": payload["own_reports"],
                               "profile": payload["profile"]}
        if rank == 0:
            pr = payload["profile"]
            print(f"\n{model_name}: {nparams / 1e6:.2f}M params in {len(pr['tensors'])} tensors, {size} ranks; "
                  f"profile (rank 0, threshold plan): forward {pr['forward_s'] * 1e3:.1f} ms, backward "
                  f"{sum(t['backward_s'] for t in pr['tensors']) * 1e3:.1f} ms; median of {args.blocks} blocks "
                  f"x {args.steps} steps", flush=True)
            print(table(["variant", "buckets", "measured (ms)", "predicted (ms)", "pred/meas - 1", "within 25%"],
                        rows), flush=True)
            for k in ("mgwfbp", "optimal", "auto"):
                r = payload["own_reports"][k]
                print(f"  {k}: planned from its own profile -> {r['chosen']}, {r['buckets']} buckets, "
                      f"predicted {r['predicted_s'] * 1e3:.1f} ms", flush=True)
    if rank == 0:
        path = write_json(args.out, {"ranks": size, "blocks": args.blocks, "steps": args.steps,
                                     "network": "loopback (shared memory)", "tolerance": TOLERANCE,
                                     "cost_model": cm.to_dict(), "calibration_statistic": args.statistic,
                                     "machine": machine_info(), "results": results})
        print(f"\nwrote {path}", flush=True)
    comm.barrier()


if __name__ == "__main__":
    main()
