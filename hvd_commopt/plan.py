"""Compare bucketing strategies for a profiled model, offline (no communicator, no framework).

Usage::

    python -m hvd_commopt.plan --model-profile profile.json --alpha 9.08e-4 --beta 7.4e-10
    python -m hvd_commopt.plan --model-profile profile.json --alpha 5e-5 --beta 1e-10 --ranks 16
    python -m hvd_commopt.plan --model-profile profile.json --cost-model cost_model.json

Cost model, one of:

* ``--alpha A --beta B``: the *allreduce* model ``t = A + B·bytes`` at your rank count, as fitted
  by ``python -m hvd_commopt.calibrate`` or MG-WFBP's tables (docs/cost-models.md#fitted-allreduce-model, docs/mgwfbp.md#hyperparameters);
* ``--alpha A --beta B --ranks P``: A and B describe one *link* (startup seconds, seconds per
  byte); the allreduce model is the ring formula ``2A(P-1) + 2(P-1)/P·n·B`` (docs/cost-models.md#closed-form-costs);
* ``--cost-model file.json``: the output of ``hvd_commopt.calibrate --out``.

``profile.json`` format (what ``DistributedOptimizer(fusion="auto").comm_engine.tuner.profile.to_json()``
writes on rank 0): a JSON list, in **backward order** (first entry = the first gradient to
become ready, normally the last layer), of ``{"name": str, "bytes": int, "backward_s": float}``,
where ``backward_s`` is the time from the previous gradient-ready event (or the start of
backward) to this tensor's (docs/mgwfbp.md#greedy ``tb``). Alternatively an object
``{"tensors": [...as above...], "forward_s": float, "update_s": float}`` to include forward and
optimizer time in the predicted iteration time.

Prints, for each strategy (per_tensor, single, threshold, mgwfbp, optimal), the predicted
iteration time, the non-overlapped communication, and its buckets as position ranges.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from . import env
from .errors import ConfigError
from .fusion.auto import candidate_plans, choose_plan
from .fusion.cost_model import AlphaBeta, CostModel

__all__ = ["load_profile", "main"]


def load_profile(path: str) -> tuple[list[str], list[int], list[float], float, float]:
    """Read ``profile.json`` (module docstring). Returns (names, bytes, backward_s, forward_s, update_s)."""
    with open(path) as f:
        data: Any = json.load(f)
    forward_s = update_s = 0.0
    if isinstance(data, dict):
        forward_s = float(data.get("forward_s", 0.0))
        update_s = float(data.get("update_s", 0.0))
        data = data.get("tensors")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of {{name, bytes, backward_s}} (or an object with "
                         f"'tensors'), in backward order")
    names, sizes, times = [], [], []
    for k, t in enumerate(data):
        try:
            names.append(str(t.get("name", f"t{k}")))
            sizes.append(int(t["bytes"]))
            times.append(float(t["backward_s"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(f"{path}: entry {k} must be an object with integer 'bytes' and number "
                             f"'backward_s' (and optionally 'name'); got {t!r}") from None
    return names, sizes, times, forward_s, update_s


def _ranges(plan: Sequence[Sequence[int]]) -> str:
    return " ".join(f"[{g[0]}]" if len(g) == 1 else f"[{g[0]}-{g[-1]}]" for g in plan)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hvd_commopt.plan",
                                 description="Predict iteration time of each bucketing strategy.")
    ap.add_argument("--model-profile", required=True, help="profile.json (see module docstring)")
    ap.add_argument("--alpha", type=float, help="allreduce (or, with --ranks, link) startup seconds")
    ap.add_argument("--beta", type=float, help="allreduce (or, with --ranks, link) seconds per byte")
    ap.add_argument("--ranks", type=int, default=None,
                    help="treat --alpha/--beta as a link model and apply the ring formula for P ranks")
    ap.add_argument("--cost-model", default=None, help="JSON from python -m hvd_commopt.calibrate --out")
    ap.add_argument("--threshold-bytes", type=int, default=None,
                    help="fusion threshold of the 'threshold' strategy (default: what the engine uses, "
                         "HVD_COMMOPT_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD, else "
                         f"{env.DEFAULT_FUSION_THRESHOLD} bytes)")
    ap.add_argument("--names", action="store_true", help="list the tensor names in each bucket")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    return ap.parse_args(argv)


def _allreduce_model(args: argparse.Namespace) -> tuple[AlphaBeta, str]:
    if args.cost_model is not None:
        if args.alpha is not None or args.beta is not None:
            raise ValueError("give either --cost-model or --alpha/--beta, not both")
        with open(args.cost_model) as f:
            cm = CostModel.from_dict(json.load(f))
        return cm.allreduce, f"allreduce fit from {args.cost_model} (P={cm.ranks})"
    if args.alpha is None or args.beta is None:
        raise ValueError("need --alpha and --beta (or --cost-model file.json)")
    if args.ranks is not None:
        link = AlphaBeta(args.alpha, args.beta)
        return CostModel.from_link(link, args.ranks).allreduce, f"ring allreduce over link {link} at P={args.ranks}"
    return AlphaBeta(args.alpha, args.beta), "allreduce model given directly"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    try:
        names, sizes, times, fwd, upd = load_profile(args.model_profile)
        cost, how = _allreduce_model(args)
        threshold = env.fusion_threshold_bytes(args.threshold_bytes)
        strategies = candidate_plans(sizes, times, cost, threshold_bytes=threshold)
        choice = choose_plan(strategies, sizes, times, cost, forward_time=fwd, update_time=upd)
    except (OSError, ValueError, ConfigError) as e:
        print(f"hvd_commopt.plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {"cost": {"alpha": cost.alpha, "beta": cost.beta, "source": how}, "best": choice.name,
               "strategies": {k: {"buckets": strategies[k], "iteration_s": r.iteration_time,
                                  "non_overlapped_comm_s": r.non_overlapped_comm}
                              for k, r in choice.results.items()}}
        print(json.dumps(out, indent=2))
        return 0
    print(f"{len(sizes)} tensors, {sum(sizes)} bytes; compute {choice.result.compute_time:.6g} s; "
          f"cost alpha={cost.alpha:.4g} s beta={cost.beta:.4g} s/B ({how})")
    print(f"{'strategy':<11} {'buckets':>7} {'iteration_s':>13} {'non_overlap_s':>13}")
    for k, r in choice.results.items():
        mark = "  <- best" if k == choice.name else ""
        print(f"{k:<11} {len(strategies[k]):>7} {r.iteration_time:>13.6g} {r.non_overlapped_comm:>13.6g}{mark}")
    for k, plan in strategies.items():
        print(f"{k}: {_ranges(plan)}")
        if args.names:
            for g in plan:
                print(f"    {', '.join(names[i] for i in g)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
