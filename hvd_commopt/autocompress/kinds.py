"""What ``compression="auto"`` chooses from by default: the rule per (optimizer kind x model kind).

``auto`` cannot tell one task from another, but it can see two things about every task: the type of
the optimizer it wraps and the shapes of the gradients it sends. So its default candidates are the
methods that the convergence runs show within the target (0.5 points of S-SGD's final accuracy, 1 %
of its validation loss) on every task measured *of the same kind* (docs/auto-compression.md#kinds):

* the **optimizer kind**, from the host's typed answer (:class:`~hvd_commopt.host.OptimizerFamily`):
  ``"adaptive"`` (Adam and kin, :func:`~hvd_commopt.reduce.adaptive.is_adaptive`), ``"sgd"``
  (SGD and its momentum forms: the optimizer every SGD row was measured with), or ``"other"``
  (anything else, a host that does not say: the rule of every task);
* the **model kind**, from the registered shapes (:func:`model_kind`): ``"convolutional"`` when at
  least half of the gradient elements are in convolution kernels, tensors of 4 or 5 dimensions
  (torch's conv2d/conv3d weights, Keras' Conv2D/Conv3D kernels; 3-D tensors do not count, so a
  conv1d or a stack of MoE experts does not, and a ViT's patch embedding is too small to tip it),
  else ``"other"``.

and a third thing about the job, the **rank count** (the communicator's size, read when the host
is attached): the same method trains differently at 4 ranks than at 2 (int8 as ``auto`` runs it on
the digits CNN: +0.09 points at 2 ranks, -0.56 at 4), so there are two tables:

* up to 2 ranks, :data:`RULES` (and :data:`EVERY_TASK` for a cell with no task): set on the 2-rank
  runs. One rank uses it too, but sends nothing (``auto`` does not compress on one rank);
* above 2 ranks, :data:`RULES_MANY` (and :data:`EVERY_TASK_MANY`): set on the 4-rank runs. A
  method is a default there only where the 4-rank runs show it within the target on every task of
  the cell's kind measured at 4 ranks; a method with no 4-rank evidence in the cell is not a
  default (accuracy first), and a cell with no task measured at 4 ranks takes the methods within
  the target on every task measured at 4 ranks. No run above 4 ranks exists: 8 or 64 ranks take
  the 4-rank table, the nearest evidence, not a proof (docs/auto-compression.md#kinds-ranks).

A user's ``allow=`` and ``min_density=`` override the cell's at any rank count (:meth:`AutoOptions.under
<hvd_commopt.autocompress.options.AutoOptions.under>`). Each cell rests on one to three tasks: it
is evidence of those tasks, not a proof for the kind (docs/auto-compression.md#kinds-measured).
Pure functions and frozen values only: no framework, no state.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Literal, Mapping, Sequence

from ..errors import ConfigError
from ..host import OptimizerFamily
from ..reduce.adaptive import is_adaptive
from .options import DEFAULT_ALLOW, DEFAULT_MIN_DENSITY, AutoOptions

__all__ = ["OptimizerKind", "ModelKind", "ModelReading", "KindRule", "RULES", "EVERY_TASK", "RULES_MANY",
           "EVERY_TASK_MANY", "MANY_RANKS", "Kinds", "model_kind", "optimizer_kind", "rule_for", "CONV_NDIMS"]

OptimizerKind = Literal["adaptive", "sgd", "other"]
ModelKind = Literal["convolutional", "other"]

#: The ranks of a convolution kernel: conv2d/Conv2D (4), conv3d/Conv3D (5). Not 3: conv1d kernels
#: and stacked MoE expert matrices are 3-D and train like dense layers here (no row says otherwise).
CONV_NDIMS = (4, 5)


@dataclass(frozen=True)
class ModelReading:
    """The model kind and what it was read from: ``conv_elements`` of ``elements`` gradient
    elements are in 4-/5-D tensors."""

    kind: ModelKind
    conv_elements: int
    elements: int

    @property
    def conv_share(self) -> float:
        return self.conv_elements / self.elements if self.elements else 0.0


def model_kind(shapes: Iterable[Sequence[int]]) -> ModelReading:
    """``"convolutional"`` when at least half of the elements of ``shapes`` (the registered
    gradients) are in tensors of :data:`CONV_NDIMS` dimensions, else ``"other"`` (also for no
    tensors at all)."""
    conv = total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        total += n
        if len(shape) in CONV_NDIMS:
            conv += n
    kind: ModelKind = "convolutional" if total > 0 and 2 * conv >= total else "other"
    return ModelReading(kind, conv, total)


def optimizer_kind(host: Any) -> OptimizerKind:
    """``"adaptive"`` (Adam-type), ``"sgd"`` (the host says SGD), else ``"other"`` (module docstring)."""
    if is_adaptive(host):
        return "adaptive"
    if isinstance(host, OptimizerFamily) and host.optimizer_family() == "sgd":
        return "sgd"
    return "other"


@dataclass(frozen=True)
class KindRule:
    """One cell: the methods chosen from by default, the lowest density of a sparse one, the tasks
    that back them (their gaps to S-SGD, docs/auto-compression.md#kinds) and the rank count those
    tasks ran at (2: :data:`RULES`; 4: :data:`RULES_MANY`)."""

    methods: tuple[str, ...]
    min_density: float
    evidence: str
    ranks: int = 2


#: The rule of every task (docs/auto-compression.md#accuracy-floor): dense fp32, bf16, int8 with
#: error feedback; within the target on all five tasks measured. The cells without a task of their
#: own, and the optimizers that are neither SGD nor Adam-type, use it.
EVERY_TASK = KindRule(DEFAULT_ALLOW, DEFAULT_MIN_DENSITY,
                      "every task measured (digits CNN, digits MLP, rings, the GPT under SGD and AdamW)")

#: The cells with tasks of their own (docs/auto-compression.md#kinds; 2 ranks, seeds 0-2, the gap
#: of the mean to S-SGD in points, % of the validation loss for the GPT):
#:
#: * SGD x convolutional, rings (a small ResNet, 96 % of its elements in conv kernels): int8
#:   -0.23 and int4 as ``auto`` runs them. int4's seeds 0-2 sat at the target's edge (-0.53 at 8
#:   epochs), so ten seeds decided it: -0.04 at 8 epochs, +0.21 at 4 (fixed int4 -0.14, +0.40;
#:   docs/auto-compression.md#rings-ten-seeds). ``auto``'s unmasked Top-k/DGC at 1 % (-1.50) and
#:   3 % (-0.87) missed; Top-k at 10 % was within over the ten seeds (-0.25, +0.03) but sends 1.6x
#:   int4's bytes, so it is left to ``allow=``. DGC with momentum factor masking as ``auto`` runs it
#:   (``dgc_masked``) was within at 2 ranks and 8 epochs (+0.20 at 3 %, -0.03 at 10 %; 1 % at the
#:   edge) but missed at 4 ranks and 4 epochs by 2.3-3.0 points, so it is not a default; DGC's
#:   ResNet results (Lin et al., ICLR 2018) support it, a user may allow it.
#: * SGD x other, the digits CNN (12 % of its elements in conv kernels: its dense layer dominates),
#:   the digits MLP and the GPT under SGD: int8 (+0.09, -0.37, +0.00 %) and int4 (+0.09, -0.28,
#:   +0.18 %) as ``auto`` runs them; on the suite's 6.4M GPT under SGD int4 is -1.39 % over ten
#:   seeds (lr 0.05; docs/auto-compression.md#gpt-sgd-ten-seeds); the sparse methods missed the GPT
#:   at every density (10 %: Top-k +1.88 %, DGC +1.90 %), Top-k 10 % the digits MLP at 8 epochs (-0.56).
#: * Adam-type x other, the GPT under AdamW: int8 (-0.00 % on the tiny GPT at 400 steps, +0.23 % on
#:   the suite's 6.4M GPT at 150 steps); int4 was within on the tiny GPT (+0.55 %) but ended
#:   **+13.8 %** above S-SGD on the 6.4M GPT (2026-11-28, docs/auto-compression.md#int4-adam), so
#:   it is not a default; no sparse method under Adam (docs/auto-compression.md#adaptive).
#: * Adam-type x convolutional: no task measured, the every-task rule (no entry).
#: The every-task methods and int4: the SGD cells' candidates where int4 trained every task of the cell.
_WITH_INT4 = DEFAULT_ALLOW + ("quant4",)

RULES: Mapping[tuple[OptimizerKind, ModelKind], KindRule] = MappingProxyType({
    ("sgd", "convolutional"): KindRule(_WITH_INT4, DEFAULT_MIN_DENSITY,
                                       "rings (int8, int4 over ten seeds; sparse below 10 % missed)"),
    ("sgd", "other"): KindRule(_WITH_INT4, DEFAULT_MIN_DENSITY,
                               "the digits CNN, the digits MLP and the GPT under SGD (int8, int4; sparse missed the GPT)"),
    ("adaptive", "other"): KindRule(DEFAULT_ALLOW, DEFAULT_MIN_DENSITY,
                                    "the GPT under AdamW (int8; int4 missed the 6.4M GPT; no sparse method under Adam)"),
})


#: Above this many ranks the 4-rank table applies (module docstring): the 2-rank runs are the
#: evidence for 2 ranks (and 1, where nothing is sent), the 4-rank runs for every count above.
MANY_RANKS = 2

#: The rule of every task at 4 ranks (docs/auto-compression.md#kinds-ranks): the methods within the
#: target on every task measured at 4 ranks (seeds 0-2, the matrix's lengths): dense fp32 and bf16
#: (digits CNN -0.46 points, digits MLP -0.09, rings -0.13, the GPT under AdamW -0.00 %).
#: int8 missed the digits CNN in one of its two 4-rank runs (-0.56 as ``auto`` chose it under the
#: every-task rule; -0.37 with only int8 allowed), so it is not here. The cells without a 4-rank
#: task of their own, and the other optimizers, use it.
EVERY_TASK_MANY = KindRule(("none", "bf16"), DEFAULT_MIN_DENSITY,
                           "every task measured at 4 ranks (bf16; int8 missed the digits CNN)", 4)

#: The cells above 2 ranks, set on the 4-rank runs (docs/auto-compression.md#kinds-ranks; seeds
#: 0-2, the matrix's lengths: digits 10 epochs, rings 4, the GPT 400 steps; the gap of the mean to
#: S-SGD in points, % of the validation loss for the GPT; each method as ``auto`` runs it):
#:
#: * SGD x convolutional, rings: int8 +0.17, bf16 -0.13, int4 -0.07 as ``auto`` runs it (six
#:   seeds -0.10; fixed int4 -0.17, six seeds -0.08): fp32, bf16, int8, int4 (as at 2 ranks).
#:   The masked DGC missed by 2.3-3.0 points.
#: * SGD x other, the digits CNN and the digits MLP (the GPT under SGD has no 4-rank row): bf16
#:   -0.46 and -0.09; **int4 missed the digits CNN (-0.74) and int8 missed it in one of two runs**
#:   (-0.56 as ``auto`` chose it, -0.37 with only int8 allowed; six seed-runs -0.46, bf16's figure):
#:   accuracy first, fp32 and bf16 only. Seeds 3-5 put all three above S-SGD (bf16 +0.37, int8
#:   +0.18, int4 +0.56): the task cannot tell them apart; the rule follows the target's seeds 0-2.
#: * Adam-type x other, the GPT under AdamW: bf16 -0.00 %, int8 +0.02 %, int4 +0.54 % (target 1 %)
#:   on the tiny GPT: fp32, bf16, int8 (int4 not: it missed the 6.4M GPT at 2 ranks, as above).
#: * Adam-type x convolutional: no task at 4 ranks, :data:`EVERY_TASK_MANY` (no entry).
RULES_MANY: Mapping[tuple[OptimizerKind, ModelKind], KindRule] = MappingProxyType({
    ("sgd", "convolutional"): KindRule(_WITH_INT4, DEFAULT_MIN_DENSITY,
                                       "rings at 4 ranks (bf16, int8, int4)", 4),
    ("sgd", "other"): KindRule(("none", "bf16"), DEFAULT_MIN_DENSITY, "the digits CNN and the digits MLP at 4 ranks "
                               "(bf16; int4 missed the CNN, int8 in one of two runs)", 4),
    ("adaptive", "other"): KindRule(DEFAULT_ALLOW, DEFAULT_MIN_DENSITY,
                                    "the GPT under AdamW at 4 ranks (bf16, int8; int4 missed the 6.4M GPT at 2)", 4),
})


def rule_for(optimizer: OptimizerKind, model: ModelKind, ranks: int) -> KindRule:
    """The cell's rule at ``ranks`` ranks: from :data:`RULES` up to :data:`MANY_RANKS` ranks, from
    :data:`RULES_MANY` above; :data:`EVERY_TASK` / :data:`EVERY_TASK_MANY` where no task of that
    kind was measured at that rank count (module docstring)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"the rank count must be an integer >= 1 (the communicator's size), got {ranks!r}")
    if ranks > MANY_RANKS:
        return RULES_MANY.get((optimizer, model), EVERY_TASK_MANY)
    return RULES.get((optimizer, model), EVERY_TASK)


_OPTIMIZER_NAMES = {"adaptive": "Adam-type", "sgd": "SGD", "other": "neither SGD nor Adam-type (or not said)"}


@dataclass(frozen=True)
class Kinds:
    """What ``auto`` read (the optimizer kind, the model reading, the job's rank count) and the rule
    it took from them."""

    optimizer: OptimizerKind
    model: ModelReading
    ranks: int

    def __post_init__(self) -> None:
        rule_for(self.optimizer, self.model.kind, self.ranks)  # a bad rank count fails here, named

    @property
    def rule(self) -> KindRule:
        return rule_for(self.optimizer, self.model.kind, self.ranks)

    @property
    def measured_cell(self) -> bool:
        """The cell has tasks of its own at this rank count (else the every-task rule)."""
        return self.rule is not EVERY_TASK and self.rule is not EVERY_TASK_MANY  # rule_for's fallbacks

    def describe(self, options: AutoOptions) -> str:
        """One line for the report: the kinds, why, and the candidates ``options`` (resolved by
        :meth:`AutoOptions.under <hvd_commopt.autocompress.options.AutoOptions.under>`) hold."""
        m, rule = self.model, self.rule
        at = f"at {rule.ranks} ranks"
        cell = (f"the rule of {rule.evidence}" if self.measured_cell
                else f"no task of this kind measured {at}: the rule of every task {at}")
        given = [n for n, g in (("allow=", options.allow_given), ("min_density=", options.min_density_given)) if g]
        ranks = (f"ranks: {self.ranks}, the {rule.ranks}-rank rule"
                 + (" (nothing is sent on one rank)" if self.ranks == 1
                    else f" (measured at {rule.ranks}, used above {MANY_RANKS})" if self.ranks > MANY_RANKS
                    else f" (used up to {MANY_RANKS})"))
        return (f"model: {m.kind}, {m.conv_share:.0%} of {m.elements} gradient elements in conv kernels (4-/5-D); "
                f"optimizer: {_OPTIMIZER_NAMES[self.optimizer]}; {ranks}; candidates: {', '.join(options.allow)}"
                + (("" if self.optimizer != "adaptive" else " (no sparse method under Adam)") if not options.any_sparse
                   else " (sparse methods: none under Adam)" if self.optimizer == "adaptive"
                   else f" (sparse at density >= {options.min_density:g})")
                + f" ({cell}"
                + (f"; the user's {' and '.join(given)} in place of the rule's" if given else "")
                + "; docs/auto-compression.md#kinds)")
