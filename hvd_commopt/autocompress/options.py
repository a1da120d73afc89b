"""The options of ``Compression.auto(...)`` and the candidate methods it may choose from.

Accuracy first (docs/auto-compression.md#accuracy-floor): :data:`DEFAULT_ALLOW` and
:data:`DEFAULT_MIN_DENSITY` are the rule of every task, the methods that the convergence runs of
2026-11-27 show within the target (0.5 points of S-SGD's accuracy, 1 % of its validation loss) on
*every* task: dense fp32, bf16, and the int8 quantiser with error feedback (as ``auto`` runs it,
over its memory). int4 missed the suite's 6.4M GPT under AdamW by 13.8 %, 2-bit missed four
tasks, and the sparse methods missed the GPT under SGD at every density. Once the optimizer and model kinds are read,
the methods and the floor the user did not give come from their cell of
:data:`~hvd_commopt.autocompress.kinds.RULES` (:meth:`AutoOptions.under`,
docs/auto-compression.md#kinds). Named in ``allow=``, a sparse method runs with error feedback
(momentum correction when the wrapped optimizer has momentum, without momentum factor masking but
for ``dgc_masked``) at a density no lower than ``min_density``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..errors import ConfigError

__all__ = ["Method", "AutoOptions", "METHODS", "DEFAULT_ALLOW", "DENSITY_GRID", "DEFAULT_MIN_DENSITY"]

#: Every method the chooser knows: dense fp32, the two 16-bit casts, the low-bit quantiser at 8, 4
#: and 2 bits (``Compression.quantize``'s exchange, docs/auto-compression.md#quantised), and the
#: sparse methods of the library (all with the shared error-feedback memory,
#: docs/auto-compression.md#shared-memory).
CASTS = ("bf16", "fp16")
QUANT = ("quant8", "quant4", "quant2")
#: ``dgc_masked``: DGC with momentum factor masking on its buckets (docs/auto-compression.md#dgc-masked).
SPARSE = ("topk", "dgc", "dgc_masked", "gtopk", "oktopk", "randomk")
METHODS = ("none",) + CASTS + QUANT + SPARSE
#: Chosen from unless ``allow=`` says otherwise: the methods within the accuracy target on every
#: convergence task (module docstring, docs/auto-compression.md#accuracy-floor). fp16 needs a loss
#: scale to be safe; int4 missed the 6.4M GPT under AdamW (+13.8 %), 2-bit the GPT (+3 to +10 %); Top-k and DGC at
#: 10 % missed on the GPT under SGD; random-k trains worse than top-k at the same density, Ok-Topk
#: has no convergence row, gTop-k's merge rounds are not in the model (docs/auto-compression.md#defaults).
DEFAULT_ALLOW = ("none", "bf16", "quant8")
#: The densities tried for each sparse method (those at or above ``min_density``).
DENSITY_GRID = (0.1, 0.03, 0.01, 0.003, 0.001, 0.0003, 0.0001)
#: The lowest density chosen from unless ``min_density`` says otherwise (docs/auto-compression.md#accuracy-floor).
DEFAULT_MIN_DENSITY = 0.1


@dataclass(frozen=True, order=True)
class Method:
    """One candidate: ``kind`` (one of :data:`METHODS`) at ``density`` (1.0 for dense kinds)."""

    kind: str
    density: float = 1.0

    @property
    def sparse(self) -> bool:
        return self.kind in SPARSE

    @property
    def quantised(self) -> bool:
        """The low-bit quantiser (docs/auto-compression.md#quantised): every element sent, in ``bits``."""
        return self.kind in QUANT

    @property
    def bits(self) -> int:
        """Bits per value on the wire: 32 (fp32), 16 (the casts), 8/4/2 (the quantisers); 32 for
        the sparse methods' values."""
        if self.quantised:
            return int(self.kind[len("quant"):])
        return 16 if self.kind in CASTS else 32

    @property
    def holds_residual(self) -> bool:
        """It leaves a residual in the shared memory (the sparse methods and the quantisers), so a
        switch from it to dense fp32 or a cast sends that residual first (docs/auto-compression.md#shared-memory)."""
        return self.sparse or self.quantised

    @property
    def key(self) -> str:
        """``"none"``, ``"bf16"``, ``"topk@0.01"``: the name in reports and broadcasts."""
        return f"{self.kind}@{self.density:g}" if self.sparse else self.kind

    @property
    def lossiness(self) -> tuple[int, float]:
        """Order for ties (least lossy first): fp32, bf16, fp16, int8, int4, 2-bit, then sparse by
        falling density."""
        if not self.sparse:
            return (METHODS.index(self.kind), 0.0)
        return (len(METHODS), -self.density)

    @property
    def family(self) -> int:
        """The tie-break of :func:`~hvd_commopt.autocompress.choose.choose`: fp32, bf16, fp16, int8,
        int4, 2-bit, then every sparse method and density alike (docs/auto-compression.md#ties)."""
        return self.lossiness[0]

    @classmethod
    def parse(cls, key: str) -> Method:
        kind, _, dens = key.partition("@")
        return cls(kind, float(dens) if dens else 1.0)


class CandidateRule(Protocol):
    """A cell's default candidates (:class:`~hvd_commopt.autocompress.kinds.KindRule`)."""

    @property
    def methods(self) -> tuple[str, ...]: ...
    @property
    def min_density(self) -> float: ...


@dataclass(frozen=True)
class AutoOptions:
    """What ``Compression.auto(...)`` was given (docs/auto-compression.md#options).

    Attributes:
        min_density: the lowest density a sparse method may use (default: the rule of the
            optimizer and model kinds, :mod:`.kinds`; :data:`DEFAULT_MIN_DENSITY` until they are read).
        allow: the methods to choose from (default: the rule of the kinds; :data:`DEFAULT_ALLOW`
            until they are read); "none" (dense fp32) is always a candidate, being the reference.
        allow_given, min_density_given: the user set them (the kinds' rule does not replace them).
        margin: re-decide when the measured step differs from the predicted one by more than
            this fraction (default 0.25).
        period: at least this many steps between two decisions (default 200).
        verbose: print the report on rank 0 after each decision.
        cost_model: a fitted :class:`~hvd_commopt.fusion.cost_model.CostModel` (or its dict, or a
            JSON path) instead of calibrating the link at the first decision.
        warmup_steps, profile_steps, measure_steps: steps before profiling (dense), steps
            profiled, steps measured after a decision.
    """

    min_density: float = None  # None: the kinds' rule (__post_init__ fills it)
    allow: tuple[str, ...] = None  # None: the kinds' rule
    margin: float = 0.25
    period: int = 200
    verbose: bool = False
    cost_model: Any = None
    warmup_steps: int = 3
    profile_steps: int = 5
    measure_steps: int = 5
    densities: tuple[float, ...] = field(default=(), init=False)
    allow_given: bool = field(default=False, init=False)
    min_density_given: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow_given", self.allow is not None)
        object.__setattr__(self, "min_density_given", self.min_density is not None)
        if self.min_density is None:
            object.__setattr__(self, "min_density", DEFAULT_MIN_DENSITY)
        allow = DEFAULT_ALLOW if self.allow is None else self.allow
        if isinstance(allow, str):
            allow = (allow,)
        allow = tuple(allow)
        if not allow:
            raise ConfigError("Compression.auto(allow=[]) leaves nothing to choose from; name at least one of "
                              f"{METHODS} (or leave allow out for {DEFAULT_ALLOW})")
        unknown = [a for a in allow if a not in METHODS]
        if unknown:
            raise ConfigError(f"Compression.auto(allow=...) names unknown methods {unknown}; the methods are {METHODS}")
        if not (isinstance(self.min_density, (int, float)) and 0 < self.min_density <= 1):
            raise ConfigError(f"min_density must be in (0, 1], got {self.min_density!r}")
        dens = tuple(d for d in DENSITY_GRID if d >= self.min_density)
        sparse = [a for a in allow if a in SPARSE]
        if sparse and not dens and all(a in SPARSE for a in allow):
            raise ConfigError(f"Compression.auto(allow={list(allow)}, min_density={self.min_density}) excludes every "
                              f"candidate: the densities tried are {DENSITY_GRID}; lower min_density to at most "
                              f"{DENSITY_GRID[0]} or allow 'none'/'bf16'/'quant8'")
        if not (isinstance(self.margin, (int, float)) and self.margin > 0):
            raise ConfigError(f"margin must be a fraction > 0 (e.g. 0.25), got {self.margin!r}")
        for name in ("period", "warmup_steps", "profile_steps", "measure_steps"):
            v = getattr(self, name)
            low = 1 if name in ("period", "profile_steps") else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}")
        object.__setattr__(self, "allow", tuple(dict.fromkeys(("none",) + allow)))
        object.__setattr__(self, "densities", dens)

    def under(self, rule: CandidateRule) -> AutoOptions:
        """These options with the methods and density floor the user did not set taken from
        ``rule`` (the optimizer and model kinds' cell, :func:`~hvd_commopt.autocompress.kinds.rule_for`);
        what the user set stays (docs/auto-compression.md#kinds). The flags keep saying what the
        user set."""
        out = replace(self, allow=self.allow if self.allow_given else rule.methods,
                      min_density=self.min_density if self.min_density_given else rule.min_density)
        object.__setattr__(out, "allow_given", self.allow_given)
        object.__setattr__(out, "min_density_given", self.min_density_given)
        return out

    def candidates(self, sparse_ok: bool = True) -> tuple[Method, ...]:
        """The methods a bucket may use, least lossy first (``sparse_ok`` False: 1-D buckets)."""
        out = [Method(a) for a in self.allow if a not in SPARSE]
        if sparse_ok:
            out += [Method(a, d) for a in self.allow if a in SPARSE for d in self.densities]
        return tuple(sorted(out, key=lambda m: m.lossiness))

    @property
    def any_sparse(self) -> bool:
        return bool(self.densities) and any(a in SPARSE for a in self.allow)

    def config(self) -> dict:
        return {"min_density": self.min_density, "allow": list(self.allow), "margin": self.margin,
                "period": self.period, "warmup_steps": self.warmup_steps, "profile_steps": self.profile_steps,
                "measure_steps": self.measure_steps, "cost_model given": self.cost_model is not None}
