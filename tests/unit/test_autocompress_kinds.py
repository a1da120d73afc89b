"""``compression="auto"``'s default candidates per (optimizer kind x model kind): the model kind read
from the registered shapes, the optimizer kind from the host's typed family, the frozen table, the
user's ``allow=``/``min_density=`` over it, and the report's line (docs/auto-compression.md#kinds)."""
from __future__ import annotations

import pytest

from hvd_commopt.autocompress import DEFAULT_ALLOW, AutoOptions, AutoReducer
from hvd_commopt.autocompress.kinds import EVERY_TASK, RULES, Kinds, model_kind, optimizer_kind, rule_for
from hvd_commopt.autocompress.report import format_report
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.errors import ConfigError
from hvd_commopt.host import ADAPTIVE, GradientCapture


class Host:
    """A host that says its optimizer's family (hvd_commopt.host.OptimizerFamily); it holds no
    weights, so no momentum is bound (the kinds are what is tested)."""

    holds_weights = False

    def __init__(self, family: str):
        self.family = family

    def optimizer_family(self) -> str:
        return self.family


RESNET_LIKE = [(64, 3, 7, 7), (64,), (64,), (64, 64, 3, 3), (64, 64, 3, 3), (128, 64, 3, 3), (128,), (10, 128), (10,)]
# ViT-B/16: the patch embedding is a 768x3x16x16 conv; twelve blocks of 4 attention and 2 MLP matrices
VIT_LIKE = [(768, 3, 16, 16), (768,), (197, 768)] + [(768, 768)] * 48 + [(3072, 768), (768, 3072)] * 12 + [(1000, 768)]
MLP = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]
# a mixture of experts: 8 experts' matrices stacked in 3-D, a small conv stem (3-D counts as dense)
MOE_LIKE = [(16, 3, 3, 3), (8, 512, 2048), (8, 2048, 512), (512, 512)]
DIGITS_CNN = [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 512), (64,), (10, 64), (10,)]


def test_model_kind_from_the_shapes():
    r = model_kind(RESNET_LIKE)
    assert r.kind == "convolutional" and r.elements == sum(_n(s) for s in RESNET_LIKE)
    assert r.conv_elements == _n((64, 3, 7, 7)) + 2 * _n((64, 64, 3, 3)) + _n((128, 64, 3, 3))
    assert model_kind([(4, 2, 3, 3, 3)]).kind == "convolutional"  # conv3d: 5-D
    assert model_kind(VIT_LIKE).kind == "other"  # the patch embedding is 0.7 % of the elements
    assert model_kind(MLP).kind == "other" and model_kind(MLP).conv_elements == 0
    assert model_kind(MOE_LIKE).kind == "other"  # 3-D expert stacks are not conv kernels
    assert model_kind([(8, 4, 5)]).kind == "other"  # nor is a conv1d kernel
    assert model_kind(DIGITS_CNN).kind == "other"  # 12 % in its convs: the dense layer dominates
    assert model_kind(DIGITS_CNN).conv_elements == 4752 and model_kind(DIGITS_CNN).elements == 38282


def test_model_kind_edges():
    empty = model_kind([])
    assert empty.kind == "other" and empty.elements == 0 and empty.conv_share == 0.0
    assert model_kind([(2, 2, 2, 2), (16,)]).kind == "convolutional"  # exactly half: convolutional
    assert model_kind([(2, 2, 2, 2), (17,)]).kind == "other"
    assert model_kind([(0, 3, 3, 3)]).kind == "other"  # no elements at all


def test_optimizer_kind_from_the_hosts_family():
    assert optimizer_kind(Host(ADAPTIVE)) == "adaptive"
    assert optimizer_kind(Host("sgd")) == "sgd"
    assert optimizer_kind(Host("other")) == "other"
    assert optimizer_kind(GradientCapture()) == "other"  # a host that does not say
    assert optimizer_kind(None) == "other"


def test_the_table_per_cell():
    conv = rule_for("sgd", "convolutional", 2)  # rings: int8, int4 over ten seeds; no sparse method
    assert conv.methods == ("none", "bf16", "quant8", "quant4") and conv.min_density == 0.1
    assert rule_for("sgd", "other", 2).methods == ("none", "bf16", "quant8", "quant4")
    # the GPT under AdamW: int8; int4 missed the suite's 6.4M GPT (+13.8 %) though within on the tiny one
    assert rule_for("adaptive", "other", 2).methods == DEFAULT_ALLOW
    assert rule_for("adaptive", "other", 4).methods == DEFAULT_ALLOW
    assert rule_for("adaptive", "convolutional", 2) is EVERY_TASK  # no task measured
    assert rule_for("other", "convolutional", 2) is EVERY_TASK and rule_for("other", "other", 2) is EVERY_TASK
    assert EVERY_TASK.methods == DEFAULT_ALLOW and EVERY_TASK.min_density == 0.1
    for rule in RULES.values():  # no sparse method is a default in any cell; the floor stays 0.1
        assert not {"topk", "dgc", "dgc_masked", "gtopk", "oktopk", "randomk"} & set(rule.methods)
        assert rule.min_density == 0.1 and rule.evidence
    with pytest.raises(TypeError):
        RULES[("sgd", "other")] = EVERY_TASK  # type: ignore[index]


def test_the_users_allow_and_min_density_stay():
    sgd_other = rule_for("sgd", "other", 2)
    plain = AutoOptions()
    assert plain.allow == DEFAULT_ALLOW and not plain.allow_given and not plain.min_density_given
    assert plain.under(sgd_other).allow == sgd_other.methods
    given = AutoOptions(allow=["bf16", "topk"]).under(sgd_other)
    assert given.allow == ("none", "bf16", "topk") and given.allow_given and not given.min_density_given
    assert given.min_density == sgd_other.min_density and given.densities == (0.1,)
    floor = AutoOptions(min_density=0.01).under(sgd_other)
    assert floor.allow == sgd_other.methods and floor.min_density == 0.01 and floor.min_density_given
    both = AutoOptions(allow=("topk",), min_density=0.03).under(rule_for("adaptive", "other", 2))
    assert both.allow == ("none", "topk") and both.densities == (0.1, 0.03)
    assert AutoOptions(allow=DEFAULT_ALLOW).allow_given  # given, even when equal to the default
    with pytest.raises(ConfigError, match="excludes every candidate"):
        AutoOptions(allow=["topk"], min_density=0.5)


def _reducer(shapes, family, **opts) -> AutoReducer:
    red = AutoReducer(AutoOptions(**opts))
    red.bind_host(Host(family), [f"t{i}" for i in range(len(shapes))])
    red.read_model(shapes, 2)
    return red


def test_the_reducer_reads_the_kinds_and_resolves_its_options():
    red = _reducer(MLP, "sgd")
    assert red.kinds == Kinds("sgd", model_kind(MLP), 2) and red.options.allow == ("none", "bf16", "quant8", "quant4")
    assert red.policy.options is red.options  # the policy decides with the resolved options
    assert red.requested.allow == DEFAULT_ALLOW  # what the user gave (nothing) is kept apart
    conv = _reducer(RESNET_LIKE, "sgd")
    assert conv.options.allow == ("none", "bf16", "quant8", "quant4")  # rings
    assert conv.kinds.rule is RULES[("sgd", "convolutional")]  # its own cell
    assert _reducer(VIT_LIKE, ADAPTIVE).options.allow == ("none", "bf16", "quant8")
    assert _reducer(RESNET_LIKE, ADAPTIVE).options.allow == DEFAULT_ALLOW
    assert _reducer(MLP, "sgd", allow=["bf16"]).options.allow == ("none", "bf16")
    # a host bound again re-reads the optimizer kind over the same model reading
    red.bind_host(Host(ADAPTIVE), ["t0"])
    assert red.kinds.optimizer == "adaptive" and red.options.allow == ("none", "bf16", "quant8")
    red.bind_host(GradientCapture(), ["t0"])
    assert red.kinds.optimizer == "other" and red.options.allow == DEFAULT_ALLOW


def test_the_layout_is_stale_when_the_kinds_change_the_1d_split():
    red = AutoReducer(AutoOptions(allow=["topk"]))
    assert red.keeps_dense(TensorSpec("b", (4,), "float32"))  # built before the optimizer is known
    assert not red.layout_stale
    red.bind_host(Host(ADAPTIVE), ["b"])
    red.read_model([(4,)], 2)
    assert red.layout_stale  # under Adam no sparse method: S-SGD's buckets
    assert not red.keeps_dense(TensorSpec("b", (4,), "float32")) and not red.layout_stale
    fresh = AutoReducer()
    assert not fresh.layout_stale  # no layout built yet
    conv = AutoReducer(AutoOptions(allow=["dgc_masked"]))  # a sparse method allowed, before the optimizer
    assert conv.keeps_dense(TensorSpec("b", (4,), "float32"))
    conv.bind_host(Host("sgd"), ["w", "b"])
    conv.read_model([(8, 4, 3, 3), (4,)], 2)
    assert not conv.layout_stale  # SGD: the sparse method stays a candidate, the 1-D tensors apart


def test_the_report_says_the_kinds_read_and_why():
    red = _reducer(RESNET_LIKE, "sgd")
    text = red.kinds_text
    share = model_kind(RESNET_LIKE).conv_share
    assert text.startswith(f"model: convolutional, {share:.0%} of {model_kind(RESNET_LIKE).elements} gradient "
                           f"elements in conv kernels (4-/5-D); optimizer: SGD; ranks: 2, the 2-rank rule (used up to 2); "
                           f"candidates: none, bf16, quant8, quant4 (")
    assert "rings" in text and "docs/auto-compression.md#kinds" in text
    assert "user's" not in text
    user = _reducer(MLP, ADAPTIVE, allow=["quant4", "topk"], min_density=0.01).kinds_text
    assert "optimizer: Adam-type" in user and "sparse methods: none under Adam" in user
    assert "the user's allow= and min_density= in place of the rule's" in user
    none = _reducer(RESNET_LIKE, ADAPTIVE).kinds_text
    assert "no task of this kind measured at 2 ranks: the rule of every task at 2 ranks" in none
    assert AutoReducer().kinds_text.startswith("kinds not read")
    rep = {"predicted_s": 0.01, "dense_predicted_s": 0.02, "margin": 0.25, "period": 200, "kinds": text,
           "buckets": [{"bucket": "b0", "bytes": 4, "method": "quant8", "why": "fastest"}]}
    assert format_report(rep).splitlines()[1] == f"  {text}"


def _n(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
