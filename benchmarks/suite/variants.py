"""The algorithms the suite compares, each a named variant built by one small function.

A builder that fails with the library's ``ConfigError`` (a combination the library refuses) is
reported as skipped, with the library's message (:class:`Skip`).

Every builder runs on every rank with the same arguments, so skips are identical on all ranks and
the collective set-up calls (``DistributedOptimizer`` verifies the model across ranks) line up.
"""
from __future__ import annotations

import copy

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn

from .baselines import b_ddp, ddp_bytes_per_step
from .runner import Ctx, Runner, Skip

__all__ = ["Skip", "Ctx", "Runner", "VARIANTS", "DEFAULT", "QUICK", "build", "describe", "ddp_bytes_per_step",
           "known", "is_ours"]


def _hco():
    import torch_plugin as hco
    return hco


# -- builders ----------------------------------------------------------------------------------------
def _sgd(model: nn.Module, ctx: Ctx, momentum: float | None = None) -> torch.optim.Optimizer:
    """The local optimizer: SGD with ``ctx.momentum`` (``momentum`` overrides it: DGC applies its
    own), or AdamW (``ctx.optimizer == "adamw"``; weight decay 0.01, no momentum to override)."""
    if ctx.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=ctx.lr, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=ctx.lr, momentum=ctx.momentum if momentum is None else momentum)


def _ours(name: str, model: nn.Module, ctx: Ctx, momentum: float | None = None, **kw: Any) -> Runner:
    from hvd_commopt.errors import ConfigError
    hco = _hco()
    if ctx.communicator is not None:
        kw.setdefault("communicator", ctx.communicator)
    elif ctx.fresh_comm is not None and "communicator" not in kw:
        # Each variant's collectives on TCP connections of their own, as a job running only this
        # variant has, and as each DDP instance has its own group: on one shared group, S-SGD ran
        # at 0.84x DDP at 10 Gbit/s after the sparse variants' small messages, 0.95x on its own
        # (docs/benchmarking.md#block-warmup)
        kw["communicator"] = ctx.fresh_comm()
    try:
        opt = hco.DistributedOptimizer(_sgd(model, ctx, momentum), named_parameters=model.named_parameters(), **kw)
    except (ConfigError, TypeError) as e:
        raise Skip(f"refused by the library: {e}") from None
    return Runner(name, model, opt, model, ours=True)


def b_compute(model: nn.Module, ctx: Ctx) -> Runner:
    return Runner("compute", model, _sgd(model, ctx), model)


def b_ssgd_gloo(model: nn.Module, ctx: Ctx) -> Runner:
    if ctx.gloo_comm is None:
        raise Skip("no Gloo process group in this job")
    return _ours("ssgd_gloo", model, ctx, communicator=ctx.gloo_comm())


def _fusion_kw(ctx: Ctx, planner: str) -> dict[str, Any]:
    """fusion= and short tuner phases: profile a few steps, plan, no measuring phase (the suite
    measures; the harness warms up until the tuner is done). The network is calibrated once per
    job and the cost model shared by every planned variant, instead of once per variant (each
    calibration moves ~0.3 GB: half a minute at 100 Mbit/s)."""
    opts: dict[str, Any] = {"warmup_steps": 1, "profile_steps": ctx.profile_steps, "measure_steps": 0}
    if ctx.cost_model is None:
        try:
            from hvd_commopt import calibrate, runtime
            ctx.cost_model = calibrate.calibrate(runtime.communicator(), repeats=5, warmup=2)
        except Exception:  # noqa: BLE001 - e.g. a native-buffer backend: let the tuner calibrate
            ctx.cost_model = False
    if ctx.cost_model is not False:
        opts["cost_model"] = ctx.cost_model
    return {"fusion": planner, "fusion_options": opts}


def b_fusion(kind: str) -> Callable[[nn.Module, Ctx], Runner]:
    def build_(model: nn.Module, ctx: Ctx) -> Runner:
        return _ours(kind, model, ctx, **_fusion_kw(ctx, kind))
    return build_


def b_sparse(kind: str, layerwise: bool = False, planner: str | None = None,
             name: str | None = None, selection: str | None = None,
             schedule: str | None = None, fused: bool = False,
             density: float | None = None) -> Callable[[nn.Module, Ctx], Runner]:
    """A sparse variant; ``selection`` picks the selection mode (docs/selection.md), ``schedule``
    "od"/"ssd" runs it under a delayed schedule (docs/ssd-sgd.md#sparse-delayed). ``layerwise``:
    LAGS's per-layer top-k, sent one bucket per layer, or with ``fused`` in the default buckets
    (``Compression.topk(layerwise=True)``, docs/lags-omgs.md#lags-merged)."""
    def build_(model: nn.Module, ctx: Ctx) -> Runner:
        if density is not None:  # a fixed density, whatever --density says (the trust table's 1 % rows)
            ctx = dataclasses.replace(ctx, density=density)
        factory = getattr(_hco().Compression, kind)
        kw: dict[str, Any] = {}
        momentum = None
        sel = {} if selection is None else {"selection": selection}
        if kind == "dgc":  # DGC applies momentum itself: the wrapped optimizer runs without it
            comp = factory(density=ctx.density, momentum=ctx.momentum, steps_per_epoch=ctx.steps_per_epoch, **sel)
            momentum = 0.0
        elif kind == "randomk" and ctx.mode == "tta":
            # random-k trains with momentum only at density >= 0.3 (docs/topk.md#randomk-momentum);
            # at the suite's 0.01 it diverges, which is what the time-to-accuracy table showed
            from hvd_commopt.compress.randomk import RANDOMK_MIN_DENSITY
            comp = factory(density=max(ctx.density, RANDOMK_MIN_DENSITY))
        else:
            comp = factory(density=ctx.density, **sel, **({"layerwise": True} if fused else {}))
        if schedule is not None:
            kw["schedule"] = getattr(_hco().Schedule, schedule)(warmup_steps=ctx.warmup_steps)
        if layerwise and not fused:
            kw["fusion_threshold"] = 0  # one bucket per layer: LAGS (layer-wise selection, sent from the hooks)
        if planner is not None:
            kw.update(_fusion_kw(ctx, planner))
        label = name or {("topk", True): "lags", ("topk", False): "topk"}.get((kind, layerwise), kind)
        return _ours(label, model, ctx, momentum=momentum, compression=comp, **kw)
    return build_


def ab_variant(build: Callable[[nn.Module, Ctx], Runner], name: str, **choice: Any) -> Callable[[nn.Module, Ctx], Runner]:
    """``build``'s variant with one implementation choice of the :class:`Runner` switched (an A/B in
    one job): ``native_kernels=False`` runs the NumPy host kernels (docs/selection.md#native-sweep),
    ``pair_sum=False`` sums small buffers at 2 ranks by Gloo's allreduce (docs/backends.md#pair-sum),
    ``direct=False`` queues every collective on the progress thread (docs/backends.md#direct-start)."""
    def build_(model: nn.Module, ctx: Ctx) -> Runner:
        r = build(model, ctx)
        r.name = name
        for field_name, value in choice.items():
            setattr(r, field_name, value)
        return r
    return build_


def without_lane(build: Callable[[nn.Module, Ctx], Runner], name: str) -> Callable[[nn.Module, Ctx], Runner]:
    """``build``'s variant on a Gloo backend of its own built without the MPI lane, so its small
    collectives stay on Gloo (docs/backends.md#small-on-mpi): an A/B in one job, where every
    variant of ours has a communicator of its own anyway."""
    def build_(model: nn.Module, ctx: Ctx) -> Runner:
        if ctx.communicator is not None:
            raise Skip(f"{name} builds a Gloo backend of its own; it cannot run on a named one")
        if ctx.fresh_comm is not None:  # None: our backend is not Gloo, so there is no lane
            fresh = ctx.fresh_comm
            ctx = dataclasses.replace(ctx, fresh_comm=lambda: fresh(lane=False))
        r = build(model, ctx)
        r.name = name
        return r
    return build_


def b_schedule(kind: str) -> Callable[[nn.Module, Ctx], Runner]:
    def build_(model: nn.Module, ctx: Ctx) -> Runner:
        factory = getattr(_hco().Schedule, kind)
        if kind in ("cocod", "local_sgd"):
            sched = factory(period=ctx.period, warmup_steps=ctx.warmup_steps)
        elif kind == "cd" and ctx.batch_size:
            sched = factory(warmup_steps=ctx.warmup_steps, batch_size=ctx.batch_size)
        elif kind in ("od", "ssd", "cd"):
            sched = factory(warmup_steps=ctx.warmup_steps)
        else:
            sched = factory()
        return _ours(kind, model, ctx, schedule=sched)
    return build_


def b_fp16(model: nn.Module, ctx: Ctx) -> Runner:
    return _ours("fp16", model, ctx, compression=_hco().Compression.fp16)


def b_bf16(model: nn.Module, ctx: Ctx) -> Runner:
    return _ours("bf16", model, ctx, compression=_hco().Compression.bf16)


# name -> (builder, one-line description)
VARIANTS: dict[str, tuple[Callable[[nn.Module, Ctx], Runner], str]] = {
    "compute": (b_compute, "no communication: the compute-only lower bound"),
    "ddp": (b_ddp, "PyTorch DDP over Gloo, its defaults: a 1 MiB first bucket, then 25 MiB"),
    "ddp_nofirst": (lambda m, c: b_ddp(m, c, first_bucket=False), "DDP with bucket_cap_mb=25: no first bucket"),
    "ddp_powersgd1": (lambda m, c: b_ddp(m, c, 1), "DDP + PowerSGD comm hook, rank 1"),
    "ddp_powersgd4": (lambda m, c: b_ddp(m, c, 4), "DDP + PowerSGD comm hook, rank 4"),
    "ddp_bf16": (lambda m, c: b_ddp(m, c, hook="bf16"), "DDP + bf16_compress_hook (gradients sent as bfloat16)"),
    "ddp_fp16": (lambda m, c: b_ddp(m, c, hook="fp16"), "DDP + fp16_compress_hook (gradients sent as float16)"),
    "ssgd": (lambda m, c: _ours("ssgd", m, c), "our S-SGD, threshold fusion (25 MiB), default backend"),
    "ssgd_nofirst": (lambda m, c: _ours("ssgd_nofirst", m, c, fusion_options={"first_bucket_bytes": 0}),
                     "our S-SGD without DDP's 1 MiB first bucket (nothing overlaps backward on a model under 25 MiB)"),
    "ssgd_gloo": (b_ssgd_gloo, "our S-SGD over the same Gloo as DDP"),
    "mgwfbp": (b_fusion("mgwfbp"), "S-SGD, MG-WFBP merged buckets"),
    "optimal": (b_fusion("optimal"), "S-SGD, exact (DP) bucket planner"),
    "fusion_auto": (b_fusion("auto"), "S-SGD, the planner the simulator predicts fastest"),
    "fp16": (b_fp16, "S-SGD, fp16 compression"),
    "bf16": (b_bf16, "S-SGD, bf16 compression"),
    "topk": (b_sparse("topk"), "Top-k S-SGD (whole-bucket top-k, allgather, error feedback)"),
    "gtopk": (b_sparse("gtopk"), "gTop-k S-SGD (recursive doubling)"),
    "lags": (b_sparse("topk", layerwise=True), "LAGS-SGD: layer-wise top-k, one bucket per layer"),
    "lags_fused": (b_sparse("topk", layerwise=True, fused=True, name="lags_fused"),
                   "LAGS-SGD's layer-wise top-k in the default buckets, one exchange per bucket"),
    "omgs": (b_sparse("topk", planner="mgwfbp", name="omgs"),
             "OMGS-SGD: top-k, sparse buckets merged by the OMGS planner (fusion='mgwfbp' on a sparse reducer)"),
    "dgc": (b_sparse("dgc"), "Deep Gradient Compression"),
    "topk_np": (ab_variant(b_sparse("topk"), "topk_np", native_kernels=False),
                "topk with the NumPy host kernels instead of the native ones"),
    "dgc_np": (ab_variant(b_sparse("dgc"), "dgc_np", native_kernels=False),
               "dgc with the NumPy host kernels instead of the native ones"),
    "lags_fused_np": (ab_variant(b_sparse("topk", layerwise=True, fused=True), "lags_fused_np", native_kernels=False),
                      "lags_fused with the NumPy host kernels instead of the native ones"),
    "topk_ar": (ab_variant(b_sparse("topk"), "topk_ar", pair_sum=False),
                "topk whose dense 1-D bucket is summed by Gloo's allreduce, not an allgather (2 ranks)"),
    "lags_queued": (ab_variant(b_sparse("topk", layerwise=True), "lags_queued", direct=False),
                    "lags whose collectives all go through the progress thread, none started from the hooks"),
    "lags_nolane": (without_lane(b_sparse("topk", layerwise=True), "lags_nolane"),
                    "lags with its small collectives on Gloo, not the MPI lane (multi-host Gloo only)"),
    "ssgd_nolane": (without_lane(lambda m, c: _ours("ssgd", m, c), "ssgd_nolane"),
                    "ssgd with its small collectives on Gloo, not the MPI lane (multi-host Gloo only)"),
    "ssgd_poll200": (ab_variant(lambda m, c: _ours("ssgd", m, c), "ssgd_poll200", long_wait_pauses=False),
                     "ssgd whose waiter polls every 200 us however long the collective runs (before 2026-11-27)"),
    "dgc_nolane": (without_lane(b_sparse("dgc"), "dgc_nolane"),
                   "dgc with its small collectives on Gloo, not the MPI lane (multi-host Gloo only)"),
    "dgc_exact": (b_sparse("dgc", selection="exact", name="dgc_exact"), "DGC with the exact (fast) top-k selection"),
    "topk_thr": (b_sparse("topk", selection="threshold", name="topk_thr"),
                 "Top-k with Ok-Topk's threshold reuse (exact threshold every 16 steps)"),
    "oktopk": (b_sparse("oktopk"), "Ok-Topk: O(k) split-and-reduce sparse allreduce"),
    "ssd_topk": (b_sparse("topk", schedule="ssd", name="ssd_topk"), "SSD-SGD (k = 5) with Top-k exchange"),
    "od_topk": (b_sparse("topk", schedule="od", name="od_topk"), "OD-SGD with Top-k exchange"),
    "od_dgc": (b_sparse("dgc", schedule="od", name="od_dgc"), "OD-SGD with DGC exchange"),
    "topk_10pct": (b_sparse("topk", name="topk_10pct", density=0.1),
                   "Top-k at density 0.1 (auto's accuracy floor), whatever --density says"),
    "topk_1pct": (b_sparse("topk", name="topk_1pct", density=0.01),
                  "Top-k at density 0.01, whatever --density says"),
    "dgc_1pct": (b_sparse("dgc", name="dgc_1pct", density=0.01),
                 "DGC at density 0.01, whatever --density says"),
    "topk_01pct": (b_sparse("topk", name="topk_01pct", density=0.001),
                   "Top-k at density 0.001 (the papers' setting), whatever --density says"),
    "dgc_01pct": (b_sparse("dgc", name="dgc_01pct", density=0.001),
                  "DGC at density 0.001 (the papers' setting), whatever --density says"),
    "bf16_nphalf": (ab_variant(b_bf16, "bf16_nphalf", native_half_sum=False),
                    "bf16 with MPI's half-precision ring adding through NumPy, not the native kernel"),
    "quant8": (lambda m, c: _ours("quant8", m, c, compression=_hco().Compression.quantize(8)),
               "int8 quantiser with error feedback (all-to-all, then allgather of the re-quantised sums)"),
    "quant4": (lambda m, c: _ours("quant4", m, c, compression=_hco().Compression.quantize(4)),
               "int4 quantiser with error feedback (all-to-all, then allgather of the re-quantised sums)"),
    "quant8_composed": (ab_variant(lambda m, c: VARIANTS["quant8"][0](m, c), "quant8_composed", native_quant=False),
                        "int8 quantiser encoding through the composed torch ops, not the native host kernel"),
    "quant4_composed": (ab_variant(lambda m, c: VARIANTS["quant4"][0](m, c), "quant4_composed", native_quant=False),
                        "int4 quantiser encoding through the composed torch ops, not the native host kernel"),
    "randomk": (b_sparse("randomk"), "Random-k (shared seed, allreduce of k values)"),
    "od": (b_schedule("od"), "OD-SGD (one-step delayed global update)"),
    "ssd": (b_schedule("ssd"), "SSD-SGD (k = 5 delay, GLU)"),
    "cd": (b_schedule("cd"), "CD-SGD (delayed, ternary-compressed gradients)"),
    "cocod": (b_schedule("cocod"), "CoCoD-SGD (decoupled model averaging)"),
    "local_sgd": (b_schedule("local_sgd"), "local SGD (periodic model averaging)"),
    "auto": (lambda m, c: _ours("auto", m, c, compression=_hco().Compression.auto(cost_model=c.cost_model or None, verbose=True)),
             "compression='auto': per bucket, the method the link model predicts fastest (docs/auto-compression.md)"),
    "auto_dense": (lambda m, c: _ours("auto", m, c, compression=_hco().Compression.auto(allow=["none"])),
                   "compression='auto' allowed dense fp32 only: its dense path's cost (docs/auto-compression.md#dense-path)"),
    "auto_dgcm": (lambda m, c: _ours("auto", m, c, compression=_hco().Compression.auto(
        cost_model=c.cost_model or None, verbose=True, allow=["none", "bf16", "quant8", "dgc_masked"], min_density=0.03)),
        "auto with DGC with momentum masking >= 3 % allowed: not a default (docs/auto-compression.md#kinds-measured)"),
    "bf16_fusion": (lambda m, c: _ours("bf16_fusion", m, c, compression=_hco().Compression.bf16, **_fusion_kw(c, "auto")),
                    "bf16 on the buckets fusion='auto' plans (the simulator's fastest planner)"),
    "auto_fusion": (lambda m, c: _ours("auto_fusion", m, c, compression=_hco().Compression.auto(
        cost_model=c.cost_model or None, verbose=True), **_fusion_kw(c, "auto")),
        "compression='auto' on the buckets fusion='auto' plans"),
    "auto_nphalf": (ab_variant(lambda m, c: VARIANTS["auto"][0](m, c), "auto_nphalf", native_half_sum=False),
                    "auto with MPI's half-precision ring adding through NumPy in every step (its trial included)"),
}

# ssgd_gloo is opt-in: with DDP's Gloo group and our Gloo communicator in one process, a ResNet job
# died 4 times out of 6 with a Gloo message-size mismatch ("op.preamble.length <= op.nbytes");
# the runs without it never did. Across hosts our variants run on Gloo by default now
# (docs/backends.md#choice); `--backend both` times each of them on both backends.
# the _np variants are opt-in as well: an A/B of the native host kernels, not methods of their own.
NATIVE_AB = ("topk_np", "dgc_np", "lags_fused_np", "bf16_nphalf", "auto_nphalf", "quant8_composed", "quant4_composed")
BACKEND_AB = ("topk_ar", "lags_queued")  # opt-in A/Bs of a backend choice, like the _np ones
BACKEND_AB += ("ssgd_poll200",)
TRUST_ROWS = ("topk_10pct", "topk_1pct", "dgc_1pct", "topk_01pct", "dgc_01pct")  # opt-in: the trust table's fixed densities
TRUST_ROWS += ("quant8", "quant4")  # opt-in too: the trust table's fixed quantisers
TRUST_ROWS += ("auto_dgcm",)  # opt-in too: auto with the masked DGC allowed, the trust rows' A/B
TRUST_ROWS += ("bf16_fusion", "auto_fusion")  # opt-in too: with fusion="auto"
DEFAULT = [n for n in VARIANTS if n != "ssgd_gloo" and n not in NATIVE_AB + BACKEND_AB + TRUST_ROWS]
QUICK = ["compute", "ddp", "ddp_bf16", "ddp_powersgd1", "ssgd", "mgwfbp", "fp16", "topk", "gtopk", "dgc", "od", "local_sgd"]


# the variants that do not run on our library: the bounds and DDP's, what ours are compared with
BASELINES = ("compute", "ddp", "ddp_nofirst", "ddp_powersgd1", "ddp_powersgd4", "ddp_bf16", "ddp_fp16")


def is_ours(name: str) -> bool:
    """Whether variant ``name`` runs on our library (then ``<name>@mpi`` / ``@gloo`` exist)."""
    return name.partition("@")[0] not in BASELINES


def known(name: str) -> bool:
    base, _, backend = name.partition("@")
    return base in VARIANTS and (not backend or (backend in ("mpi", "gloo") and is_ours(base)))


def build(name: str, model: nn.Module, ctx: Ctx) -> Runner:
    """Build variant ``name`` on ``model`` (raises :class:`Skip` with the reason, or KeyError).
    ``<variant>@mpi`` / ``@gloo``: one of our variants on that backend instead of the default."""
    if not known(name):
        raise KeyError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    base, _, backend = name.partition("@")
    if backend:
        if ctx.backend_comm is None:
            raise Skip(f"no {backend} communicator in this job")
        ctx = dataclasses.replace(ctx, communicator=ctx.backend_comm(backend))
    r = VARIANTS[base][0](model, ctx)
    r.name = name
    return r


def describe(name: str) -> str:
    base, _, backend = name.partition("@")
    text = VARIANTS[base][1] if base in VARIANTS else name
    return f"{text}, on {backend}" if backend else text


def build_for_tta(names: str, base: nn.Module, ctx: Ctx, barrier: Callable[[], None]
                  ) -> tuple[dict[str, Runner], dict[str, str]]:
    """The time-to-accuracy jobs' runners: each of the comma-separated ``names`` on a copy of
    ``base`` (every rank builds them in the same order, a barrier after each), and per name "ok"
    or why it was skipped ("compute" trains nothing, so it has no accuracy to reach)."""
    runners: dict[str, Runner] = {}
    status: dict[str, str] = {}
    for name in names.split(","):
        if name == "compute":
            status[name] = "skipped: no communication means no data parallelism (not a training run)"
            continue
        try:
            runners[name] = build(name, copy.deepcopy(base), ctx)
            status[name] = "ok"
        except Skip as e:
            status[name] = f"skipped: {e}"
        barrier()
    return runners, status

