"""Run by tests/torch/test_triton_select.py in a process started with ``TRITON_INTERPRET=1``
(Triton reads it when it is imported, so the test process cannot switch it): the Triton select's
cases on CPU tensors. ``python -m tests.torch.triton_interpreted equal|glue|reuse|fused_add|memory_steps``; prints one line per
failure and exits 1 if any."""
from __future__ import annotations

import sys
import threading

import numpy as np
import torch

from tests.torch.test_device_route import Recorder
from hvd_commopt.select import device
from torch_plugin import ops as torch_ops
from torch_plugin import triton_select

OPS = torch_ops.TorchOps()


def data(kind: str, n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(n).astype(np.float32)
    elif kind == "ties":  # a few magnitudes: thousands tied at the k-th
        x = (rng.integers(-4, 5, n) * 0.25).astype(np.float32)
    elif kind == "zeros":  # the k-th is zero: +0 and -0 tie
        x = np.zeros(n, np.float32)
        x[rng.integers(0, n, 50)] = rng.standard_normal(50)
        x[::7] = -0.0
    else:  # NaN (several payloads) above +Inf, -Inf, denormals
        x = rng.standard_normal(n).astype(np.float32)
        x[::997], x[5::1009], x[7::1013] = np.nan, -np.inf, np.inf
        x.view(np.int32)[11::2003] = 0x7FC00123
        x[13::501] = np.float32(1e-42)
    return torch.from_numpy(x)


def equal() -> list[str]:
    """Both candidate paths (the buffer fits; it overflows and the radix select finishes on the
    data) and the default capacity, on every kind of data: the torch route's set and ranking."""
    bad, default = [], triton_select.capacity
    for buffer, cap in (("default", default), ("fits", lambda n, k: n), ("overflows", lambda n, k: 1)):
        triton_select.capacity = cap
        for kind in ("normal", "ties", "zeros", "nonfinite"):
            for n, k in ((20_000, 1), (50_000, 500), (30_001, 7_000)):
                t = data(kind, n, seed=n + k)
                if not torch.equal(triton_select.topk_abs_index(t, k), OPS.topk_abs_index(t, k)):
                    bad.append(f"topk_abs_index {buffer} {kind} n={n} k={k}")
                (gi, gk), (ri, rk) = triton_select.topk_abs_ranked(t, k), OPS.topk_abs_ranked(t, k)
                if not (torch.equal(gi, ri) and torch.equal(gk, rk)):
                    bad.append(f"topk_abs_ranked {buffer} {kind} n={n} k={k}")
    triton_select.capacity = default
    return bad


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def reuse_states(t: torch.Tensor, k: int, lo_c: int, hi_c: int, tau: int) -> list[tuple[str, torch.Tensor, int]]:
    """Carried thresholds that land inside the band, above it (too many pass), below it (too
    few), every element (key 0), only NaN (its key), none (above NaN's key), and an age at tau."""
    n = t.numel()
    keys = OPS.topk_abs_ranked(t, n)[1]
    picks = {"in band": k - 1, "overflow": min(hi_c + 3, n - 1), "just over": min(hi_c, n - 1),
             "underflow": max(lo_c - 3, 0), "just under": max(lo_c - 2, 0)}
    out = [(name, keys[i:i + 1].clone(), 0) for name, i in picks.items()]
    for name, key in (("all", 0), ("nan only", 0x7F800001), ("none", 0x7F800002)):
        out.append((name, torch.tensor([key], dtype=torch.int64), 0))
    out.append(("age at tau", keys[k - 1:k].clone(), tau))
    out.append(("age below tau", keys[k - 1:k].clone(), tau - 1))
    return out


def reuse() -> list[str]:
    """Threshold reuse's reused step (triton_select.threshold_reuse) against the torch route
    (select/device.py reuse_candidates): the padded selection's bits and the carried state,
    inside, over and under the band, with ties, zeros and ±0, NaN/Inf."""
    bad = []
    for kind in ("normal", "ties", "zeros", "nonfinite"):
        for n, k, band in ((20_000, 1, 0.5), (50_000, 500, 0.2), (30_001, 7_000, 0.1)):
            t = data(kind, n, seed=n + k)
            lo_c, hi_c, tau = int(np.ceil(k * (1 - band))), int(np.floor(k * (1 + band))), 4
            for name, thr, age in reuse_states(t, k, lo_c, hi_c, tau):
                prev = (thr, torch.tensor([age], dtype=torch.int64))
                got = triton_select.threshold_reuse(t, k, lo_c, hi_c, tau, prev)
                want = device.reuse_candidates(OPS, t, k, lo_c, hi_c, tau, prev)
                (gv, gi), (wv, wi) = device.padded(OPS, t, got[0], got[1]), device.padded(OPS, t, want[0], want[1])
                same = (torch.equal(bits(gv), bits(wv)) and torch.equal(gi, wi)
                        and all(torch.equal(a, b) for a, b in zip(got[2], want[2])))
                if not same:
                    bad.append(f"threshold_reuse {kind} n={n} k={k} band={band} {name}")
    return bad


def residual_for(kind: str, n: int, seed: int) -> torch.Tensor:
    """A residual for :func:`data`'s gradient: other values, NaN where the gradient has one
    (another payload, and a signalling one), NaN where it has none, Inf against -Inf."""
    r = data("normal" if kind == "nonfinite" else kind, n, seed + 1)
    if kind == "nonfinite":
        bits = r.view(torch.int32)
        bits[11::2003] = 0x7FC00456  # a NaN against the gradient's 0x7FC00123
        bits[::997] = 0x7F800001  # a signalling NaN against the gradient's NaN
        r[3::1201] = np.nan
        r[5::1009] = np.inf  # against the gradient's -Inf: NaN
    return r


def _sum(t, a, out):
    """The torch route's sum (exact_topk.sum_into)."""
    return OPS.add(t if out is None else OPS.copy_into(out, 0, t), a)


def fused_add() -> list[str]:
    """The error-feedback add made in the kernels' first read (triton_select.add_topk_abs_index,
    add_threshold_reuse) against the torch route's add, then select (docs/selection.md#triton-fused-ef):
    the sum's bits (into the first operand, or into another buffer), the selection and the carried
    state, on every kind of data, NaN payloads included, both candidate paths."""
    bad, default = [], triton_select.capacity
    for kind in ("normal", "ties", "zeros", "nonfinite"):
        for n, k in ((20_000, 1), (30_001, 7_000)):
            g, r = data(kind, n, seed=n + k), residual_for(kind, n, seed=n + k)
            for into in ("first", "out"):
                for buffer, cap in (("default", default), ("overflows", lambda n, k: 1)):
                    triton_select.capacity = cap
                    want_acc = _sum(r.clone(), g, None if into == "first" else torch.empty_like(g))
                    t, out = r.clone(), None if into == "first" else torch.full_like(g, 7.0)
                    acc, idx = triton_select.add_topk_abs_index(t, g, out, k)
                    if acc is not (t if out is None else out) or not torch.equal(bits(acc), bits(want_acc)):
                        bad.append(f"add_topk_abs_index sum {kind} n={n} k={k} into {into}")
                    if not torch.equal(idx, OPS.topk_abs_index(want_acc, k)):
                        bad.append(f"add_topk_abs_index {buffer} {kind} n={n} k={k} into {into}")
                    triton_select.capacity = default
            band = 0.2
            lo_c, hi_c, tau = int(np.ceil(k * (1 - band))), int(np.floor(k * (1 + band))), 4
            want_acc = _sum(r.clone(), g, None)
            for name, thr, age in reuse_states(want_acc, k, lo_c, hi_c, tau):
                if name not in ("in band", "overflow", "underflow", "nan only", "age at tau"):
                    continue
                prev = (thr, torch.tensor([age], dtype=torch.int64))
                t, out = (r.clone(), None) if name != "in band" else (r.clone(), torch.empty_like(g))
                acc, got = triton_select.add_threshold_reuse(t, g, out, k, lo_c, hi_c, tau, prev)
                want = device.reuse_candidates(OPS, want_acc, k, lo_c, hi_c, tau, prev)
                (gv, gi), (wv, wi) = device.padded(OPS, acc, got[0], got[1]), device.padded(OPS, want_acc, want[0], want[1])
                same = (torch.equal(bits(acc), bits(want_acc)) and torch.equal(bits(gv), bits(wv)) and torch.equal(gi, wi)
                        and all(torch.equal(a, b) for a, b in zip(got[2], want[2])))
                if not same:
                    bad.append(f"add_threshold_reuse {kind} n={n} k={k} {name}")
    return bad


def memory_steps() -> list[str]:
    """Error feedback's step on the device route (ErrorFeedback.compensate_select with the exact
    top-k, and with threshold reuse over its exact, reused and recomputed steps), the Triton
    kernels forced on CPU tensors against the torch-op route: values, indices and residuals
    bit for bit, with a snapshot (the sum into the spare buffer) and without (in place)."""
    from hvd_commopt.memory.error_feedback import ErrorFeedback
    from hvd_commopt.select import kernels as K
    from hvd_commopt.select.strategies import SelectionStrategy
    bad = []
    K.HOST_KERNELS = False
    takes = torch_ops._triton_takes
    for kind in ("normal", "ties", "nonfinite"):
        for selection in ("exact", "threshold"):
            n, k = 30_001, 600
            runs = []
            for triton_on in (True, False):
                torch_ops._triton_takes = (lambda t, k: 0 < k < t.numel()) if triton_on else takes
                ef, sel = ErrorFeedback(), SelectionStrategy(selection, tau=3, band=0.2)
                steps = []
                for step in range(7):
                    g = data(kind, n, seed=100 + step) * (1.0 + 0.3 * step)
                    if step % 2:
                        ef.snapshot(OPS, "b", g, step)
                    vals, idx = ef.compensate_select(
                        OPS, "b", g, lambda r, a, out=None: sel.select_acc(OPS, r, k, None, step, a, out))
                    steps.append((bits(vals).clone(), idx.clone(), bits(ef.residual(OPS, "b", g)).clone()))
                runs.append(steps)
            torch_ops._triton_takes = takes
            for step, (got, want) in enumerate(zip(*runs)):
                if not all(torch.equal(a, b) for a, b in zip(got, want)):
                    bad.append(f"{selection} with error feedback, {kind}, step {step}")
    K.HOST_KERNELS = True
    return bad


class Launch:
    """A kernel whose launches are marked, so the recorder leaves out what the interpreter does
    inside them (it copies the arguments to host arrays); the glue between them is recorded."""

    def __init__(self, kernel, state):
        self.kernel, self.state = kernel, state

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kw):
            self.state.inside = True
            try:
                return run(*args, **kw)
            finally:
                self.state.inside = False
        return launch


def glue() -> list[str]:
    """The torch ops between the kernels: no forbidden op, no scalar read, on both paths, with the
    add fused and without."""
    K, state, bad = triton_select.kernels(), threading.local(), []
    for name in K.__all__:
        setattr(K, name, Launch(getattr(K, name), state))

    class GlueRecorder(Recorder):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(state, "inside", False):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    for kind in ("normal", "zeros"):  # the buffer fits / overflows
        t = data(kind, 40_000, 3)
        rec = GlueRecorder()
        with rec:
            got = triton_select.topk_abs_index(t, 900)
            triton_select.topk_abs_ranked(t, 900)
            for thr in (OPS.topk_abs_ranked(t, 900)[1][899:900], torch.zeros(1, dtype=torch.int64)):  # in band, over
                triton_select.threshold_reuse(t, 900, 720, 1080, 4, (thr, torch.zeros(1, dtype=torch.int64)))
                triton_select.add_threshold_reuse(t.clone(), t, None, 900, 720, 1080, 4,
                                                  (thr, torch.zeros(1, dtype=torch.int64)))
            triton_select.add_topk_abs_index(t.clone(), t, torch.empty_like(t), 900)
        if rec.bad or rec.scalar_reads:
            bad.append(f"{kind}: {rec.bad} {rec.scalar_reads} scalar reads at {rec.where}")
        if not torch.equal(got, OPS.topk_abs_index(t, 900)):
            bad.append(f"{kind}: not the torch route's set")
    return bad


if __name__ == "__main__":
    failures = {"equal": equal, "glue": glue, "reuse": reuse, "fused_add": fused_add,
                "memory_steps": memory_steps}[sys.argv[1]]()
    for line in failures:
        print("FAIL", line)
    print("ok" if not failures else f"{len(failures)} failures")
    sys.exit(1 if failures else 0)
