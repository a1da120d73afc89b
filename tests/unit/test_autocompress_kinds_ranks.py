"""``compression="auto"``'s default candidates at more than 2 ranks (docs/auto-compression.md#kinds-ranks):
up to 2 ranks the table set on the 2-rank runs, above 2 the one set on the 4-rank runs, where a
method with no 4-rank evidence in its cell is not a default; the engine passes the communicator's
size; the user's ``allow=`` still overrides; the report says the rank count and the rule."""
from __future__ import annotations

import numpy as np
import pytest

from hvd_commopt import build_engine, run_ranks
from hvd_commopt.autocompress import DEFAULT_ALLOW, AutoOptions, AutoReducer
from hvd_commopt.autocompress.kinds import (EVERY_TASK, EVERY_TASK_MANY, MANY_RANKS, RULES, RULES_MANY, Kinds,
                                            model_kind, rule_for)
from hvd_commopt.buckets import TensorSpec
from hvd_commopt.errors import ConfigError
from hvd_commopt.host import ADAPTIVE
from hvd_commopt.numpy_ops import NumpyOps

from .test_autocompress_kinds import MLP, RESNET_LIKE, VIT_LIKE, Host

SPARSE = {"topk", "dgc", "dgc_masked", "gtopk", "oktopk", "randomk"}
INT4 = ("none", "bf16", "quant8", "quant4")


def test_the_two_rank_table_up_to_two_ranks():
    for ranks in (1, 2):
        assert rule_for("sgd", "convolutional", ranks).methods == INT4  # int4 over ten seeds of rings
        assert rule_for("sgd", "other", ranks).methods == INT4
        assert rule_for("adaptive", "other", ranks).methods == DEFAULT_ALLOW  # int4 missed the 6.4M GPT under AdamW
        assert rule_for("adaptive", "convolutional", ranks) is EVERY_TASK
        assert rule_for("other", "other", ranks) is EVERY_TASK
    assert MANY_RANKS == 2 and all(r.ranks == 2 for r in RULES.values()) and EVERY_TASK.ranks == 2


@pytest.mark.parametrize("ranks", [3, 4, 8, 64])
def test_the_four_rank_table_above_two_ranks(ranks):
    # the 4-rank runs (docs/auto-compression.md#kinds-ranks): rings trains int8 and int4 at 4 ranks,
    # the digits CNN misses int8 and int4 there, the GPT under AdamW trains int8
    assert rule_for("sgd", "convolutional", ranks).methods == INT4
    assert rule_for("sgd", "other", ranks).methods == ("none", "bf16")
    assert rule_for("adaptive", "other", ranks).methods == DEFAULT_ALLOW
    assert rule_for("adaptive", "convolutional", ranks) is EVERY_TASK_MANY
    assert rule_for("other", "convolutional", ranks) is EVERY_TASK_MANY
    assert EVERY_TASK_MANY.methods == ("none", "bf16")


def test_the_four_rank_table_only_narrows_and_stays_frozen():
    """Accuracy first: a method is a default at 4 ranks only where the 4-rank runs show it within,
    so no cell there holds a method its 2-rank cell does not, nor a sparse method; the floor stays."""
    for key, rule in RULES_MANY.items():
        assert set(rule.methods) <= set(rule_for(*key, 2).methods) and not SPARSE & set(rule.methods)
        assert rule.methods[0] == "none" and rule.min_density == 0.1 and rule.ranks == 4 and rule.evidence
    assert set(EVERY_TASK_MANY.methods) <= set(EVERY_TASK.methods) and EVERY_TASK_MANY.ranks == 4
    with pytest.raises(TypeError):
        RULES_MANY[("sgd", "other")] = EVERY_TASK  # type: ignore[index]


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, None, "4"])
def test_a_bad_rank_count_is_one_clear_error(bad):
    with pytest.raises(ConfigError, match="rank count must be an integer >= 1"):
        rule_for("sgd", "other", bad)
    with pytest.raises(ConfigError, match="the communicator's size"):
        Kinds("sgd", model_kind(MLP), bad)


def _reducer(shapes, family, ranks, **opts) -> AutoReducer:
    red = AutoReducer(AutoOptions(**opts))
    red.bind_host(Host(family), [f"t{i}" for i in range(len(shapes))])
    red.read_model(shapes, ranks)
    return red


def test_the_reducer_takes_the_cell_of_its_rank_count():
    assert _reducer(MLP, "sgd", 2).options.allow == INT4
    assert _reducer(MLP, "sgd", 4).options.allow == rule_for("sgd", "other", 4).methods
    assert _reducer(VIT_LIKE, ADAPTIVE, 4).options.allow == rule_for("adaptive", "other", 4).methods
    assert _reducer(RESNET_LIKE, "sgd", 4).options.allow == rule_for("sgd", "convolutional", 4).methods
    red = _reducer(MLP, "sgd", 4)  # a host bound again keeps the rank count read
    red.bind_host(Host(ADAPTIVE), ["t0"])
    assert red.kinds.ranks == 4 and red.options.allow == rule_for("adaptive", "other", 4).methods


def test_the_users_allow_overrides_the_cell_at_any_rank_count():
    for ranks in (2, 4, 8):
        red = _reducer(MLP, "sgd", ranks, allow=["quant8", "quant4"])
        assert red.options.allow == ("none", "quant8", "quant4") and red.options.allow_given
        floor = _reducer(RESNET_LIKE, "sgd", ranks, allow=["dgc_masked"], min_density=0.03)
        assert floor.options.allow == ("none", "dgc_masked") and floor.options.densities == (0.1, 0.03)
        assert "the user's allow= and min_density= in place of the rule's" in floor.kinds_text
    plain = _reducer(MLP, "sgd", 4, min_density=0.01)  # only the floor given: the 4-rank cell's methods
    assert plain.options.allow == rule_for("sgd", "other", 4).methods and plain.options.min_density == 0.01


def test_the_report_line_says_the_rank_count_and_the_rule():
    two = _reducer(MLP, "sgd", 2).kinds_text
    assert "; optimizer: SGD; ranks: 2, the 2-rank rule (used up to 2); candidates: none, bf16, quant8, quant4 (" in two
    four = _reducer(MLP, "sgd", 4).kinds_text
    allow4 = ", ".join(rule_for("sgd", "other", 4).methods)
    assert (f"; optimizer: SGD; ranks: 4, the 4-rank rule (measured at 4, used above 2); candidates: {allow4} "
            f"(the rule of {RULES_MANY[('sgd', 'other')].evidence}; docs/auto-compression.md#kinds)") in four
    eight = _reducer(MLP, "sgd", 8).kinds_text
    assert "ranks: 8, the 4-rank rule (measured at 4, used above 2)" in eight
    one = _reducer(MLP, "sgd", 1).kinds_text
    assert "ranks: 1, the 2-rank rule (nothing is sent on one rank)" in one
    none4 = _reducer(RESNET_LIKE, ADAPTIVE, 4).kinds_text
    assert "no task of this kind measured at 4 ranks: the rule of every task at 4 ranks" in none4
    assert f"candidates: {', '.join(EVERY_TASK_MANY.methods)} " in none4


SPECS = [TensorSpec(f"fc{i}.w", (64, 32), "float32") for i in range(2)]


def _one_step(comm):
    """An engine with ``compression="auto"`` (no decision within the step); reduce_step attaches
    a host that does not say its optimizer (kind "other"), so the model is read with the size."""
    red = AutoReducer(AutoOptions(warmup_steps=10 ** 6))
    eng = build_engine(comm, NumpyOps(), compression=red, fusion_threshold=0)
    eng.register(SPECS)
    for n in eng.backward_names:
        eng.grad_ready(n, np.ones((64, 32), np.float32))
    eng.reduce_step()
    return red.kinds, red.options.allow, {m.kind for m in red.assignment.values()}


def test_the_engine_passes_the_communicators_size():
    k2, allow2, _ = run_ranks(2, _one_step)[0]
    assert k2.ranks == 2 and k2.optimizer == "other" and allow2 == DEFAULT_ALLOW
    res4 = run_ranks(4, _one_step)
    assert all(r == res4[0] for r in res4)
    k4, allow4, _ = res4[0]
    assert k4.ranks == 4 and allow4 == EVERY_TASK_MANY.methods
    k1, allow1, methods1 = run_ranks(1, _one_step)[0]
    assert k1.ranks == 1 and allow1 == DEFAULT_ALLOW and methods1 <= {"none"}  # one rank: nothing compressed
