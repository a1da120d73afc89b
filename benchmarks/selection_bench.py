"""Selection cost in memory passes: selection time / time of one pass over the same buffer.

For 1M-64M float32 elements and densities 0.001-0.05, on one thread, in one process (the ratio's
two terms are measured back to back, interleaved, so the shared machine's noise cancels):

* ``pass``: ``torch.abs(t, out=buf)``, one read and one write of the buffer (the unit);
* ``torch.topk``: ``torch.topk(t.abs(), k)``; ``topk_abs``: the TensorOps reference;
* ``exact``: :class:`~hvd_commopt.select.exact_topk.ExactTopK` (bit-identical to topk_abs);
* ``reuse``: :class:`~hvd_commopt.select.strategies.ReuseTopK` in steady state (a reused step);
* ``EF exact`` / ``EF reuse``: the fused error-feedback step (residual += g, select, zero sent);
  ``EF reuse`` with tau 16 and band 0.2, its exact steps and recomputations included;
* ``exact np`` / ``EF exact np``: the same two with the NumPy candidate sweep instead of the
  native one (docs/selection.md#native-sweep; absent when the extension was not built).

Targets (docs/selection.md#selection-bench): exact <= 4 passes, threshold reuse <= 2.

``--layers L`` adds the layer-wise selection (docs/lags-omgs.md#lags-merged) of a bucket of L
equal members, fused with the residual add, in passes over the whole bucket: ``layerwise``
(``TopKSelector(layerwise=True)``, the batched CPU path), ``per member`` (the exact fused step
once per member, what one bucket per layer runs) and ``whole`` (one top-k of the bucket, k the
members' sum).

Run: ``python -m benchmarks.selection_bench [--quick] [--sizes 1,4,16,64] [--densities ...] [--layers 48]``
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks.common import table, write_json
from hvd_commopt.memory.error_feedback import ErrorFeedback
from hvd_commopt.select import host_native
from hvd_commopt.select.strategies import ExactTopK, ReuseTopK
from torch_plugin.ops import TorchOps

OPS = TorchOps()


def _median(fn, reps: int) -> float:
    fn()  # warm (plans, scratch buffers, page faults)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(n: int, d: float, reps: int, slow_refs: bool) -> dict:
    k = max(int(n * d), 1)
    g = torch.from_numpy(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    t = g.clone()
    buf = torch.empty_like(t)
    one_pass = _median(lambda: torch.abs(t, out=buf), reps)
    out = {"n": n, "density": d, "k": k, "pass_ms": one_pass * 1e3}
    ex = ExactTopK()
    out["exact"] = _median(lambda: ex.select(OPS, t, k), reps) / one_pass
    reuse = ReuseTopK(tau=1 << 30, band=0.5)
    reuse.select(OPS, t, k, key="b")  # the exact step sets the threshold
    out["reuse"] = _median(lambda: reuse.select(OPS, t, k, key="b"), reps) / one_pass
    assert reuse.stats()["b"]["last_action"] == "reuse"
    # the fused error-feedback step: residual += g during the pass, select, zero the sent
    ef = ErrorFeedback()
    sel = ExactTopK()
    fn = lambda r, a: (lambda res: (res.values, res.indices, res.acc))(sel.select(OPS, r, k, addend=a))  # noqa: E731
    out["ef_exact"] = _median(lambda: ef.compensate_select(OPS, "b", g, fn), reps) / one_pass
    ef2, rs = ErrorFeedback(), ReuseTopK(tau=16, band=0.2)  # amortised: exact steps and recomputations included
    fn2 = lambda r, a: (lambda res: (res.values, res.indices, res.acc))(rs.select(OPS, r, k, "b", a))  # noqa: E731
    out["ef_reuse"] = _median(lambda: ef2.compensate_select(OPS, "b", g, fn2), reps) / one_pass
    if host_native.native_sweep():  # the same two on the NumPy sweep, in the same process
        host_native.USE_NATIVE = False
        try:
            out["exact_np"] = _median(lambda: ex.select(OPS, t, k), reps) / one_pass
            out["ef_exact_np"] = _median(lambda: ef.compensate_select(OPS, "b", g, fn), reps) / one_pass
        finally:
            host_native.USE_NATIVE = True
    if slow_refs:
        out["torch.topk"] = _median(lambda: torch.topk(t.abs(), k, sorted=False), max(3, reps // 3)) / one_pass
        out["topk_abs"] = _median(lambda: OPS.topk_abs(t, k), max(3, reps // 3)) / one_pass
    return out


def measure_layerwise(n: int, layers: int, d: float, reps: int) -> dict:
    from hvd_commopt.buckets import Bucket, TensorSpec
    from hvd_commopt.compress.topk import TopKSelector
    m = n // layers
    b = Bucket.of(0, [TensorSpec(f"l{i}", (m,), "float32") for i in range(layers)])
    rng = np.random.default_rng(n + layers)
    g = torch.from_numpy(rng.standard_normal(b.numel).astype(np.float32))
    r = torch.from_numpy(rng.standard_normal(b.numel).astype(np.float32))
    buf = torch.empty_like(r)
    one_pass = _median(lambda: torch.abs(r, out=buf), reps)
    lw, whole = TopKSelector(d, layerwise=True), TopKSelector(d)
    k_l = max(int(m * d), 1)
    ex = ExactTopK()

    def per_member():
        for off in range(0, b.numel, m):
            ex.select(OPS, r[off:off + m], k_l, addend=g[off:off + m], out=buf[off:off + m])

    out = {"n": b.numel, "layers": layers, "density": d, "pass_ms": one_pass * 1e3}
    out["layerwise"] = _median(lambda: lw.select_acc(OPS, r, b, 0, g, buf, []), reps) / one_pass
    out["per_member"] = _median(per_member, reps) / one_pass
    k = lw.k_for(b.numel, b)
    out["whole"] = _median(lambda: whole.selection.select_acc(OPS, r, k, None, 0, g, buf), reps) / one_pass
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1M and 4M only, fewer repetitions")
    p.add_argument("--sizes", default="1,4,16,64", help="sizes in Mi elements")
    p.add_argument("--densities", default="0.001,0.01,0.05")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--no-refs", action="store_true", help="skip torch.topk / topk_abs (slow at 64M)")
    p.add_argument("--layers", type=int, default=0, help="also the layer-wise selection of L equal members")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [1, 4] if a.quick else [int(s) for s in a.sizes.split(",")]
    reps = 5 if a.quick else a.reps
    rows, res = [], []
    cols = ["torch.topk", "topk_abs", "exact", "exact_np", "reuse", "ef_exact", "ef_exact_np", "ef_reuse"]
    for m in sizes:
        for d in (float(x) for x in a.densities.split(",")):
            r = measure(m << 20, d, reps, not a.no_refs)
            res.append(r)
            rows.append([f"{m}M", d, f"{r['pass_ms']:.2f}"] + [f"{r[c]:.2f}" if c in r else "-" for c in cols])
            print(rows[-1], flush=True)
    print("\nselection time / one pass (torch.abs(t, out=buf)), one thread; targets: exact <= 4, reuse <= 2")
    print(table(["n", "density", "pass ms"] + cols, rows))
    ok_exact = max(r["exact"] for r in res) <= 4.0
    ok_reuse = max(r["reuse"] for r in res) <= 2.0
    print(f"worst exact {max(r['exact'] for r in res):.2f} passes ({'meets' if ok_exact else 'misses'} <= 4); "
          f"worst reuse {max(r['reuse'] for r in res):.2f} ({'meets' if ok_reuse else 'misses'} <= 2)")
    lw_rows, lw_res = [], []
    if a.layers:
        for m in sizes:
            for d in (float(x) for x in a.densities.split(",")):
                r = measure_layerwise(m << 20, a.layers, d, reps)
                lw_res.append(r)
                lw_rows.append([f"{m}M", a.layers, d, f"{r['pass_ms']:.2f}"] +
                               [f"{r[c]:.2f}" for c in ("layerwise", "per_member", "whole")])
        print(f"\nlayer-wise selection with the residual add, {a.layers} members, in passes over the bucket")
        print(table(["n", "layers", "density", "pass ms", "layerwise", "per member", "whole"], lw_rows))
    write_json("selection_bench", {"rows": res, "layerwise": lw_res})


if __name__ == "__main__":
    main()
