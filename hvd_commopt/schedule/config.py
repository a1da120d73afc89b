"""``Schedule``: the user-facing choices of *when* gradients move and when they are applied.

Each factory returns a frozen, validated config; :func:`hvd_commopt.schedule.build_scheduler`
turns it into the scheduler object the engine drives. Warm-ups, delays and CD-SGD's quantizer are
the reference implementations' (docs/od-sgd.md#hyperparameters, docs/ssd-sgd.md#hyperparameters,
docs/cd-sgd.md#hyperparameters), because the papers' own values could not be read. The local
optimizer of OD/SSD/CD is a choice of ours: by default it mirrors the wrapped optimizer
(``local="mirror"``), because the reference values do not train with PyTorch/Keras momentum 0.9
(docs/od-sgd.md#local-defaults); ``local="reference"`` restores them.

    opt = hco.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   schedule=hco.Schedule.ssd(delay=5, warmup_steps=500))
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = ["Schedule", "SyncConfig", "DelayConfig", "CDConfig", "AveragingConfig", "DiLoCoConfig",
           "LOCAL_OPTIMIZERS", "LOCAL_PRESETS"]

LOCAL_OPTIMIZERS = ("sgd", "dcasgd")

# The local optimizer's presets (docs/od-sgd.md#local-defaults): "mirror" follows the wrapped
# optimizer (its lr, momentum, weight decay per group; the worker's own gradient unscaled);
# "reference" is the reference code's --lr-local / --mom-local / rescale 1/P, per schedule.
_DEFAULT = object()  # "not given": take the value from the preset
LOCAL_PRESETS = {
    "mirror": {"od": dict(local_lr=None, local_momentum=None, local_scale=1.0),
               "ssd": dict(local_lr=None, local_momentum=None, local_scale=1.0),
               "cd": dict(local_lr=None, local_momentum=None, local_scale=1.0)},
    "reference": {"od": dict(local_lr=0.1, local_momentum=0.1, local_scale=None),
                  "ssd": dict(local_lr=0.1, local_momentum=0.0, local_scale=None),
                  "cd": dict(local_lr=0.1, local_momentum=0.1, local_scale=None)},
}


def _local_kw(kind: str, local: str, **given) -> dict:
    """The preset's local_lr/local_momentum/local_scale, overridden by the values given."""
    if local not in LOCAL_PRESETS:
        raise ConfigError(f"local must be one of {tuple(LOCAL_PRESETS)}, got {local!r}; 'mirror' follows the "
                          f"wrapped optimizer, 'reference' is the reference code's local optimizer")
    kw = dict(LOCAL_PRESETS[local][kind])
    kw.update({k: v for k, v in given.items() if v is not _DEFAULT})
    return kw


def _int(value, name: str, lo: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{name} must be an integer >= {lo}, got {value!r}; {fix}")
    return int(value)


def _float(value, name: str, *, lo: float | None = None, lo_open: bool = False, hi_open: float | None = None,
           fix: str = "") -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}; {fix}") from None
    if not math.isfinite(v) or (lo is not None and (v < lo or (lo_open and v == lo))) or \
            (hi_open is not None and v >= hi_open):
        rng = f"{'>' if lo_open else '>='} {lo}" if lo is not None else ""
        if hi_open is not None:
            rng += f"{' and ' if rng else ''}< {hi_open}"
        raise ConfigError(f"{name} must be a finite number {rng}, got {value!r}; {fix}")
    return v


@dataclass(frozen=True)
class SyncConfig:
    """Synchronous SGD with Horovod's semantics (the default)."""

    kind: str = "sync"


@dataclass(frozen=True)
class DelayConfig:
    """OD-SGD / SSD-SGD (docs/od-sgd.md#od-sgd, docs/ssd-sgd.md#ssd-sgd): the global update lags, a local update compensates.

    Attributes:
        kind: "od" or "ssd" (only the defaults differ; one code path, OD == SSD with delay 1).
        delay: k. The local update's base is the global replica every k steps (docs/ssd-sgd.md#closed-form);
            0 disables the delay (the replica is updated with this step's gradient and copied
            into the model: S-SGD through the replica path, docs/od-sgd.md#t-od-3).
        warmup_steps: synchronous steps before the switch.
        local_optimizer: "sgd" or "dcasgd" (DC-ASGD re-derived from its definition, see
            :mod:`hvd_commopt.schedule.local_opt`).
        local_lr: the local step size; None follows the wrapped optimizer's current lr of each
            parameter's group.
        local_momentum: momentum of the local optimizer (its own buffer, never reset); None
            follows the wrapped optimizer's momentum (and dampening/nesterov) of each group.
        local_scale: s_loc, the factor on the worker's own gradient; None means 1/P (reference).
        local_weight_decay: None follows the wrapped optimizer's ``weight_decay`` of the group.
        dc_lambda: DC-ASGD's variance-control coefficient lambda.
        glu: SSD-SGD's global-gradient-for-local-update coefficient c (0 disables), docs/ssd-sgd.md#update-rule.
        check_replica_every: every N steps, compare a hash of the replica across ranks and raise
            RankMismatchError if they differ (0 = never). The safety net of docs/od-sgd.md#collective-equivalent.
    """

    kind: str
    delay: int
    warmup_steps: int
    local_optimizer: str = "sgd"
    local_lr: float | None = None
    local_momentum: float | None = None
    local_scale: float | None = 1.0
    local_weight_decay: float | None = None
    dc_lambda: float = 0.04
    glu: float = 0.0
    check_replica_every: int = 0

    def __post_init__(self) -> None:
        _int(self.delay, "delay", 0, "use delay=1 for OD-SGD, k > 1 for SSD-SGD, 0 to disable the delay")
        _int(self.warmup_steps, "warmup_steps", 0, "pass the number of synchronous steps (0 = none)")
        _int(self.check_replica_every, "check_replica_every", 0, "0 disables the check")
        if self.local_optimizer not in LOCAL_OPTIMIZERS:
            raise ConfigError(f"local_optimizer must be one of {LOCAL_OPTIMIZERS}, got {self.local_optimizer!r}")
        if self.local_lr is not None:
            _float(self.local_lr, "local_lr", lo=0.0, fix="or None to follow the wrapped optimizer's lr")
        if self.local_momentum is not None:
            _float(self.local_momentum, "local_momentum", lo=0.0, hi_open=1.0,
                   fix="or None to follow the wrapped optimizer's momentum")
        if self.local_scale is not None:
            _float(self.local_scale, "local_scale", lo=0.0, lo_open=True, fix="or None for 1/P (reference)")
        if self.local_weight_decay is not None:
            _float(self.local_weight_decay, "local_weight_decay", lo=0.0, fix="or None to follow the optimizer")
        _float(self.dc_lambda, "dc_lambda", lo=0.0, fix="DC-ASGD's default is 0.04")
        _float(self.glu, "glu", lo=0.0, fix="0 disables GLU")
        if self.delay == 0 and self.glu:
            raise ConfigError("glu has no effect with delay=0 (there is no local update); pass glu=0")
        if self.local_optimizer == "dcasgd" and self.glu:
            raise ConfigError("choose one compensation: local_optimizer='dcasgd' or glu > 0, not both "
                              "(pass glu=0 with DC-ASGD)")


@dataclass(frozen=True)
class CDConfig(DelayConfig):
    """CD-SGD (docs/cd-sgd.md#cd-sgd): OD-SGD's one-step delay, ternary-quantized gradients with error feedback,
    and a full-precision correction every ``correction_every``-th step.

    Attributes (beyond :class:`DelayConfig`; ``delay`` is always 1):
        correction_every: k of the k-step correction; step t is full precision when t % k == 0
            (the reference's ``count % compress_steps``, on the global step count). 1 = always
            full precision (equals OD-SGD, T-CD-1).
        threshold: theta of the quantizer in the reference's units: MXNet's *batch-summed*
            gradient.
        batch_size: per-worker batch size B. PyTorch gradients are batch *means*, so the
            quantizer uses theta/B on them, which is the reference's theta on batch sums. None
            applies ``threshold`` to the gradient as given. Keep theta/B a power of two for the
            exact int8 path (T-CD-4).
        flush_residual_on_correction: False (reference code): correction steps send the raw
            gradient and leave the residual untouched. True: they send gradient + residual and
            zero the residual.
    """

    correction_every: int = 5
    threshold: float = 0.5
    batch_size: int | None = None
    flush_residual_on_correction: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delay != 1:
            raise ConfigError("CD-SGD has a one-step delay; delay must be 1")
        _int(self.correction_every, "correction_every", 1, "5 is the reference; 1 = no compression")
        _float(self.threshold, "threshold", lo=0.0, lo_open=True, fix="0.5 is the reference")
        if self.batch_size is not None:
            _int(self.batch_size, "batch_size", 1, "pass the per-worker batch size or None")

    @property
    def theta(self) -> float:
        """The quantizer's threshold on the gradient handed to the engine."""
        return self.threshold / self.batch_size if self.batch_size else self.threshold


@dataclass(frozen=True)
class AveragingConfig:
    """Model averaging instead of gradient averaging: CoCoD-SGD (docs/cocod-sgd.md#cocod-sgd) or local SGD (docs/local-sgd.md#update-rule).

    Attributes:
        kind: "cocod" (average in the background while the next ``period`` steps run) or
            "local_sgd" (blocking average every ``period`` steps).
        period: tau, local steps between averagings.
        warmup_steps: synchronous (gradient-averaging) steps first.
    """

    kind: str
    period: int
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        _int(self.period, "period", 1, "pass tau, the number of local steps between averagings")
        _int(self.warmup_steps, "warmup_steps", 0, "pass the number of synchronous steps (0 = none)")


@dataclass(frozen=True)
class DiLoCoConfig(AveragingConfig):
    """DiLoCo and Streaming DiLoCo (docs/diloco.md#update-rule): ``period`` inner steps of the
    wrapped optimizer, then an outer optimizer step on the averaged pseudo-gradient.

    Attributes (beyond :class:`AveragingConfig`):
        outer_lr, outer_momentum, nesterov: the built-in outer optimizer (SGD in PyTorch's form;
            DiLoCo's Nesterov 0.7 / 0.9 by default), used when ``outer`` is None.
        outer: None, or an optimizer class of the framework (e.g. ``torch.optim.SGD``), built by
            the adapter over the global weights with ``outer_kwargs`` (docs/diloco.md#outer).
        outer_kwargs: keyword arguments of ``outer``, as sorted (key, value) pairs.
        fragments: F, parameter groups synchronised at staggered steps (docs/diloco.md#streaming).
        overlap: tau, inner steps a fragment's average may take to arrive; merged on arrival.
    """

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    outer: Any = None
    outer_kwargs: tuple = ()
    fragments: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _float(self.outer_lr, "outer_lr", lo=0.0, lo_open=True, fix="DiLoCo uses 0.7")
        _float(self.outer_momentum, "outer_momentum", lo=0.0, hi_open=1.0, fix="DiLoCo uses 0.9; 0 = plain SGD")
        if self.outer is not None and not inspect.isclass(self.outer):
            raise ConfigError(f"outer must be an optimizer class such as torch.optim.SGD (the class, not an "
                              f"instance: its arguments go in outer_kwargs=), or None for the built-in Nesterov "
                              f"outer step; got {self.outer!r}")
        _int(self.fragments, "fragments", 1, "pass F, the number of parameter fragments (1 = plain DiLoCo)")
        if self.period % self.fragments:
            raise ConfigError(f"fragments={self.fragments} does not divide period={self.period}: fragments are "
                              f"synchronised every period/fragments steps in turn; pick fragments among the "
                              f"divisors of {self.period}")
        _int(self.overlap, "overlap", 0, "pass tau, the inner steps an average may take to arrive (0 = blocking)")
        if self.overlap >= self.period:
            raise ConfigError(f"overlap={self.overlap} must be smaller than period={self.period}: a fragment's "
                              f"average has to arrive before its next synchronisation; pass overlap < period")


class Schedule:
    """Factories for ``DistributedOptimizer(schedule=...)``."""

    @staticmethod
    def sync() -> SyncConfig:
        """Synchronous SGD (Horovod semantics). The default."""
        return SyncConfig()

    @staticmethod
    def od(warmup_steps: int = 200, local_lr=_DEFAULT, local_momentum=_DEFAULT, local_scale=_DEFAULT,
           local_optimizer: str = "sgd", local_weight_decay: float | None = None, dc_lambda: float = 0.04,
           check_replica_every: int = 0, local: str = "mirror") -> DelayConfig:
        """OD-SGD (Xu et al., arXiv:2005.06728; docs/od-sgd.md#od-sgd). 200 warm-up iterations
        (reference ``fit.py``). The local optimizer mirrors the wrapped one by default;
        ``local="reference"`` gives the reference's (--lr-local 0.1, --mom-local 0.1, rescale
        1/P), docs/od-sgd.md#local-defaults. ``local_lr``/``local_momentum``/``local_scale``
        given explicitly override the preset."""
        return DelayConfig(kind="od", delay=1, warmup_steps=warmup_steps, local_optimizer=local_optimizer,
                           **_local_kw("od", local, local_lr=local_lr, local_momentum=local_momentum,
                                       local_scale=local_scale),
                           local_weight_decay=local_weight_decay, dc_lambda=dc_lambda, glu=0.0,
                           check_replica_every=check_replica_every)

    @staticmethod
    def ssd(delay: int = 5, warmup_steps: int = 500, local_lr=_DEFAULT, local_momentum=_DEFAULT,
            local_scale=_DEFAULT, glu: float = 0.0, local_optimizer: str = "sgd",
            local_weight_decay: float | None = None, dc_lambda: float = 0.04,
            check_replica_every: int = 0, local: str = "mirror") -> DelayConfig:
        """SSD-SGD (arXiv:2012.05396; docs/ssd-sgd.md#ssd-sgd). k = 5 and 500 warm-up iterations
        (hard-coded in the reference). The local optimizer mirrors the wrapped one by default;
        ``local="reference"`` gives the reference's (--lr-local 0.1, --mom-local 0, rescale 1/P),
        which diverges at lr 0.1 with global momentum 0.9 (docs/od-sgd.md#local-defaults).

        ``glu=c > 0`` turns on GLU in the recommended form (docs/ssd-sgd.md#glu-recommended-form; see
        :mod:`hvd_commopt.schedule.delayed`); the reference kernel's coefficient is 0.5. It is
        off by default as in the reference's ``fit.py``, and because on our digits check (2 ranks,
        k = 5, global SGD momentum 0.9) it did not help: 90.0% test accuracy without GLU, 89.7%
        with c = 0.5 and 74.7% with c = 1 (relative to the local lr), against 96.1% for S-SGD
        (measured at lr 0.05 with the reference local optimizer); the mirroring local optimizer
        reached 96.7% there."""
        return DelayConfig(kind="ssd", delay=delay, warmup_steps=warmup_steps, local_optimizer=local_optimizer,
                           **_local_kw("ssd", local, local_lr=local_lr, local_momentum=local_momentum,
                                       local_scale=local_scale),
                           local_weight_decay=local_weight_decay, dc_lambda=dc_lambda, glu=glu,
                           check_replica_every=check_replica_every)

    @staticmethod
    def cd(warmup_steps: int = 1000, correction_every: int = 5, threshold: float = 0.5,
           batch_size: int | None = None, flush_residual_on_correction: bool = False,
           local_lr=_DEFAULT, local_momentum=_DEFAULT, local_scale=_DEFAULT,
           local_optimizer: str = "sgd", local_weight_decay: float | None = None, dc_lambda: float = 0.04,
           check_replica_every: int = 0, local: str = "mirror") -> CDConfig:
        """CD-SGD (Yu et al., arXiv:2106.10796; docs/cd-sgd.md#cd-sgd). Defaults: reference (1000 warm-up
        iterations, compress_steps 5, threshold 0.5); the local optimizer as OD-SGD's (mirrors the
        wrapped one; ``local="reference"`` for the reference's, docs/od-sgd.md#local-defaults)."""
        return CDConfig(kind="cd", delay=1, warmup_steps=warmup_steps, local_optimizer=local_optimizer,
                        **_local_kw("cd", local, local_lr=local_lr, local_momentum=local_momentum,
                                    local_scale=local_scale),
                        local_weight_decay=local_weight_decay, dc_lambda=dc_lambda, glu=0.0,
                        check_replica_every=check_replica_every, correction_every=correction_every,
                        threshold=threshold, batch_size=batch_size,
                        flush_residual_on_correction=bool(flush_residual_on_correction))

    @staticmethod
    def cocod(period: int, warmup_steps: int = 0) -> AveragingConfig:
        """CoCoD-SGD (Shen et al., IJCAI 2019; docs/cocod-sgd.md#cocod-sgd). tau has no reference default."""
        return AveragingConfig("cocod", period, warmup_steps)

    @staticmethod
    def local_sgd(period: int, warmup_steps: int = 0) -> AveragingConfig:
        """Local SGD / periodic model averaging (docs/local-sgd.md#update-rule), plain averaging (gmf = 0)."""
        return AveragingConfig("local_sgd", period, warmup_steps)

    @staticmethod
    def diloco(period: int, outer: Any = None, outer_lr: float = 0.7, outer_momentum: float = 0.9,
               nesterov: bool = True, outer_kwargs: dict | None = None, fragments: int = 1, overlap: int = 0,
               warmup_steps: int = 0) -> DiLoCoConfig:
        """DiLoCo (Douillard et al., arXiv:2311.08105; docs/diloco.md#update-rule): ``period`` (H)
        inner steps of the wrapped optimizer, then the averaged pseudo-gradient (global minus local
        weights) feeds an outer optimizer, Nesterov momentum with lr 0.7 and momentum 0.9 by
        default, or ``outer`` (a framework optimizer class, e.g. ``torch.optim.SGD``, built with
        ``outer_kwargs``). ``fragments=F`` / ``overlap=tau`` give Streaming DiLoCo (Douillard et al.,
        arXiv:2501.18512; docs/diloco.md#streaming). ``compression=`` compresses the
        pseudo-gradient with error feedback (docs/diloco.md#compressed)."""
        if outer_kwargs is not None and not isinstance(outer_kwargs, dict):
            raise ConfigError(f"outer_kwargs must be a dict of the outer optimizer's arguments, got {outer_kwargs!r}")
        if outer_kwargs and outer is None:
            raise ConfigError("outer_kwargs configures an optimizer class given as outer=; for the built-in "
                              "outer step use outer_lr=, outer_momentum=, nesterov=")
        return DiLoCoConfig("diloco", period, warmup_steps, outer_lr=outer_lr, outer_momentum=outer_momentum,
                            nesterov=bool(nesterov), outer=outer,
                            outer_kwargs=tuple(sorted((outer_kwargs or {}).items())),
                            fragments=fragments, overlap=overlap)
