"""Step time with sparse compression against the compute-only step, same job, loopback.

    python -m benchmarks.compress_step_bench            # re-launches itself on 2 local ranks
    python -m benchmarks.compress_step_bench --profile topk   # + cProfile of one variant (rank 0)

The model is the 25-layer 512-wide MLP (6.6M parameters, batch 32), one thread per rank. Variants
are interleaved block by block so machine noise hits all alike: ``compute`` (no communication,
the lower bound), ``dense`` (our SSGD), ``topk`` / ``topk_thr`` (Top-k 1 %, exact / threshold
reuse; momentum correction on, the default with momentum SGD), ``topk_nomc`` (Top-k 1 % with
``momentum_correction=False``: plain error feedback), ``dgc`` / ``dgc_exact`` (DGC 1 %, sampled /
exact selection); ``topk_np`` / ``dgc_np``: ``topk`` / ``dgc`` with the NumPy kernels instead of the
native ones (docs/selection.md#native-sweep); ``dense_plain`` / ``topk_plain`` / ``dgc_plain``
(opt-in): ``dense`` / ``topk`` / ``dgc`` with the native kernels' streaming stores off
(docs/selection.md#streaming-stores); ``topk_denseupd`` / ``dgc_denseupd`` (opt-in): ``topk`` /
``dgc`` with the wrapped optimizer's own dense step instead of the sparse update
(``torch_plugin.sparse_update.ENABLED = False`` around its steps, docs/wrapper.md#sparse-update); ``topk_plainres`` /
``dgc_plainres`` (opt-in): ``topk`` / ``dgc`` with the sparse result zeroed then scatter-added
instead of built in one pass (docs/selection.md#scatter-sum); ``lags`` (opt-in): ``topk`` with
one bucket per layer (``fusion_threshold=0``, LAGS-SGD's exchange per layer). Prints the median step and its
ratio to the compute-only step (target: Top-k 1 % and DGC 1 % <= 1.3x).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import machine_info, relaunch_under_mpirun, table, time_blocks, train_step, write_json  # noqa: E402

DEFAULT = ("compute", "dense", "topk", "topk_nomc", "topk_thr", "dgc", "dgc_exact", "topk_np", "dgc_np")
VARIANTS = DEFAULT + ("dense_plain", "topk_plain", "dgc_plain", "topk_denseupd", "dgc_denseupd", "topk_plainres",
                      "dgc_plainres", "lags")


def _with_attr(step, owner, name, value):
    """``step`` run with ``owner.name = value`` in force (a module-level default or a method), put
    back after the step."""
    def run():
        prev = getattr(owner, name)
        setattr(owner, name, value)
        try:
            return step()
        finally:
            setattr(owner, name, prev)
    return run


def _with_setting(step, setter, value):
    """``step`` run with ``setter(value)`` in force; ``setter`` returns the previous setting, put
    back after the step."""
    def run():
        prev = setter(value)
        try:
            return step()
        finally:
            setter(prev)
    return run


def _numpy_sweep(step):
    """``step`` with the NumPy kernels (every selection of a synchronous step ends within it)."""
    from hvd_commopt.select import host_native
    return _with_attr(step, host_native, "USE_NATIVE", False)


def _plain_result(step):
    """``step`` with the sparse result built by zero_ + scatter_add + gather, the path before the
    one-pass build (docs/selection.md#scatter-sum): ``HostKernels.scatter_sum`` says "no such pass"."""
    from hvd_commopt.select.host import HostKernels
    return _with_attr(step, HostKernels, "scatter_sum", lambda self, buf, idx, vals, scale: None)


def _dense_update(step):
    """``step`` with the wrapped optimizer's own dense step, not the sparse update
    (docs/wrapper.md#sparse-update)."""
    from torch_plugin import sparse_update

    def switch(on):
        prev, sparse_update.ENABLED = sparse_update.ENABLED, on
        return prev
    return _with_setting(step, switch, False)


def _plain_stores(step):
    """``step`` with the native kernels' streaming stores off (docs/selection.md#streaming-stores)."""
    from hvd_commopt.select import _hostkernels
    return _with_setting(step, _hostkernels._set_stream_min, -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--variants", default=",".join(DEFAULT), help=f"of {','.join(VARIANTS)}")
    p.add_argument("--profile", default=None, help="a variant to profile with cProfile on rank 0")
    p.add_argument("--profile-sort", default="tottime", help="pstats sort key (tottime, cumulative, ...)")
    p.add_argument("--profile-lines", type=int, default=18, help="rows of the profile to print")
    p.add_argument("--model", default="mlp25x512", choices=["mlp25x512", "suite_mlp", "resnet18"],
                   help="the 25x512 MLP, the suite's deep_mlp (48x256, 3.05M parameters, inputs 64) or its "
                        "ResNet-18 (11.2M parameters, batch 8 of 3x32x32)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {','.join(VARIANTS)}")
    if "compute" not in names:  # the ratios' baseline
        args.variants = ",".join(["compute"] + names)
    if args.quick:
        args.blocks, args.steps = 2, 3
    relaunch_under_mpirun(args.ranks, sys.argv)

    import torch

    import torch_plugin as hco
    from benchmarks.models import deep_mlp, resnet18
    from hvd_commopt import runtime

    hco.init()
    torch.set_num_threads(1)
    rank = hco.rank()
    torch.manual_seed(0)
    if args.model == "suite_mlp":
        base, x = deep_mlp(), torch.randn(32, 64)
    elif args.model == "resnet18":
        base, x = resnet18(), torch.randn(8, 3, 32, 32)
    else:
        base, x = deep_mlp(depth=26, width=512, inputs=512), torch.randn(32, 512)
    y = torch.randint(0, 10, (x.shape[0],))
    d = args.density
    comps = {"dense": None, "topk": hco.Compression.topk(d),
             "topk_nomc": hco.Compression.topk(d, momentum_correction=False),
             "topk_thr": hco.Compression.topk(d, selection="threshold"),
             "dgc": hco.Compression.dgc(d), "dgc_exact": hco.Compression.dgc(d, selection="exact"),
             "topk_np": hco.Compression.topk(d), "dgc_np": hco.Compression.dgc(d),
             "dense_plain": None, "topk_plain": hco.Compression.topk(d), "dgc_plain": hco.Compression.dgc(d),
             "topk_denseupd": hco.Compression.topk(d), "dgc_denseupd": hco.Compression.dgc(d),
             "topk_plainres": hco.Compression.topk(d), "dgc_plainres": hco.Compression.dgc(d),
             "lags": hco.Compression.topk(d)}
    models = {}
    for name in args.variants.split(","):
        m = copy.deepcopy(base)
        mom = 0.0 if name.startswith("dgc") else 0.9  # DGC applies the momentum itself
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=mom)
        if name != "compute":
            kw = {} if comps[name] is None else {"compression": comps[name]}
            if name == "lags":
                kw["fusion_threshold"] = 0  # one bucket per layer
            opt = hco.DistributedOptimizer(opt, named_parameters=m.named_parameters(), **kw)
        models[name] = (m, opt)

    steps = {k: train_step(*v, x, y) for k, v in models.items()}
    steps.update({k: _numpy_sweep(steps[k]) for k in steps if k.endswith("_np")})
    steps.update({k: _plain_stores(steps[k]) for k in steps if k.endswith("_plain")})
    steps.update({k: _plain_result(steps[k]) for k in steps if k.endswith("_plainres")})
    steps.update({k: _dense_update(steps[k]) for k in steps if k.endswith("_denseupd")})
    comm = runtime.communicator()
    samples = time_blocks(steps, args.blocks, args.steps, barrier=comm.barrier)
    med = {k: max(comm.allgather_object(sorted(v)[len(v) // 2])) for k, v in samples.items()}
    nparams = sum(q.numel() for q in base.parameters())
    if rank == 0:
        print(f"\n{args.model}: {nparams / 1e6:.2f}M params, batch {x.shape[0]}, {hco.size()} ranks, one thread each, "
              f"density {d}, median of {args.blocks} blocks x {args.steps} steps")
        print(table(["variant", "median step (ms)", "vs compute-only"],
                    [[k, med[k] * 1e3, med[k] / med["compute"]] for k in med]), flush=True)
        for k in models:
            red = comps.get(k)
            if red is not None and red.stats().get("threshold"):
                print(f"{k}: threshold reuse {red.stats()['threshold']}")
        write_json("compress_step_bench", {"params": nparams, "density": d, "median_step_s": med,
                                           "ratio_vs_compute": {k: v / med["compute"] for k, v in med.items()},
                                           "machine": machine_info()})
    if args.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            steps[args.profile]()
        prof.disable()
        if rank == 0:
            print(f"\nprofile of 10 '{args.profile}' steps (rank 0), by {args.profile_sort}:")
            pstats.Stats(prof).sort_stats(args.profile_sort).print_stats(args.profile_lines)
    comm.barrier()


if __name__ == "__main__":
    main()
