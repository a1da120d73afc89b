"""Every memory, selector and reducer is checked against the seam it implements: the Memory and
MomentumMemory protocols (hvd_commopt/memory/base.py), the Selector base's declared capabilities
(hvd_commopt/compress/selector.py) and the reducers' bind_host/relayout (hvd_commopt/reduce/base.py)."""
from __future__ import annotations

import inspect

import pytest

from hvd_commopt import Compression
from hvd_commopt.compress import DGCSelector, RandomKSelector, Selector, TopKSelector
from hvd_commopt.host import GradientCapture, MomentumSwitch, ScheduleHost
from hvd_commopt.memory import DGCMemory, ErrorFeedback, Memory, MomentumCorrection, MomentumMemory
from hvd_commopt.reduce import DenseAllreduce, GTopK, OkTopK, Reducer, SparseAllgather, SparseReducer
from hvd_commopt.reduce.adasum import AdasumReducer
from tests.unit.schedule_helpers import NumpyHost, SwitchableMomentumHost, init_params

MEMORIES = {
    "error_feedback": lambda: ErrorFeedback(),
    "error_feedback_off": lambda: ErrorFeedback(enabled=False),
    "dgc": lambda: DGCMemory(0.9),
    "dgc_from_optimizer": lambda: DGCMemory(None, nesterov=True, clip_norm=1.0),
    "momentum_correction": lambda: MomentumCorrection(auto=True),
}
MOMENTUM = {"dgc", "dgc_from_optimizer", "momentum_correction"}

SELECTORS = {
    "topk": lambda: TopKSelector(0.01),
    "topk_threshold": lambda: TopKSelector(0.01, selection="threshold"),
    "topk_sampled": lambda: TopKSelector(0.01, selection="sampled"),
    "topk_layerwise": lambda: TopKSelector(0.01, layerwise=True),
    "dgc": lambda: DGCSelector(0.01),
    "dgc_exact": lambda: DGCSelector(0.01, selection="exact"),
    "randomk": lambda: RandomKSelector(0.01),
}


def _members(proto: type) -> dict[str, object]:
    """The protocol's own declared members (methods and annotated attributes), base protocols included."""
    out: dict[str, object] = {}
    for cls in reversed(proto.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        out.update({n: None for n in getattr(cls, "__annotations__", {})})
        out.update({n: v for n, v in vars(cls).items() if callable(v) and not n.startswith("_")})
        out.update({n: None for n, v in vars(cls).items() if isinstance(v, property)})  # read-only attributes
    return out


def _params(fn: object) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize("name", sorted(MEMORIES))
def test_every_memory_implements_the_memory_protocol(name):
    mem = MEMORIES[name]()
    assert isinstance(mem, Memory)
    for member, proto_fn in _members(Memory).items():
        assert hasattr(mem, member), member
        if proto_fn is not None:  # a method: the same parameters, by name and order
            assert _params(getattr(type(mem), member)) == _params(proto_fn), member
    assert isinstance(mem.fuses_selection, bool) and isinstance(mem.reads_parts, bool)
    assert mem.nonfinite in ("skip", "raise")


@pytest.mark.parametrize("name", sorted(MEMORIES))
def test_momentum_memories_and_only_they_implement_momentum_memory(name):
    mem = MEMORIES[name]()
    assert isinstance(mem, MomentumMemory) == (name in MOMENTUM)
    if name in MOMENTUM:
        for member, proto_fn in _members(MomentumMemory).items():
            assert hasattr(mem, member), member
            if proto_fn is not None:
                assert _params(getattr(type(mem), member)) == _params(proto_fn), member
        assert isinstance(mem.momentum, float) and isinstance(mem.nesterov, bool)
        assert isinstance(mem.from_optimizer, bool) and isinstance(mem.auto, bool)


@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_every_selector_declares_its_capabilities(name):
    sel = SELECTORS[name]()
    assert isinstance(sel, Selector)
    assert type(sel).select is not Selector.select  # every selector selects
    for flag in ("fuses_memory", "folds_finite", "reads_parts", "sends_k", "layerwise"):
        assert isinstance(getattr(sel, flag), bool), flag
    # a fused selector offers the fused form, and only a fused selection can fold the finite check
    assert (type(sel).select_acc is not Selector.select_acc) == sel.fuses_memory
    assert sel.fuses_memory or not sel.folds_finite
    assert sel.selection is None or sel.fuses_memory
    assert _params(type(sel).select) == _params(Selector.select)
    assert _params(type(sel).select_acc) == _params(Selector.select_acc)
    assert isinstance(sel.selection_stats(), dict)


REDUCERS = {
    "dense": lambda: DenseAllreduce(),
    "dense_ef": lambda: DenseAllreduce(Compression.fp16, ErrorFeedback()),
    "adasum": lambda: AdasumReducer(),
    "topk": lambda: Compression.topk(0.01),
    "randomk": lambda: Compression.randomk(0.3),
    "dgc": lambda: Compression.dgc(0.01),
    "gtopk": lambda: Compression.gtopk(0.01),
    "oktopk": lambda: Compression.oktopk(0.01),
    "allgather_dgc_memory": lambda: SparseAllgather(TopKSelector(0.01), DGCMemory(0.9)),
}


@pytest.mark.parametrize("name", sorted(REDUCERS))
def test_every_reducer_binds_a_host_and_relayouts(name):
    red = REDUCERS[name]()
    assert isinstance(red, Reducer)
    assert _params(type(red).bind_host) == _params(Reducer.bind_host)
    assert _params(type(red).relayout) == _params(Reducer.relayout)
    if isinstance(red, SparseReducer):
        assert isinstance(red.compressor, Selector) and isinstance(red.memory, Memory)
        assert isinstance(red, (SparseAllgather, GTopK, OkTopK))
    # a host without an optimizer: nothing to switch off, whatever the memory
    assert red.bind_host(GradientCapture(), ["w"]) is None


def test_hosts_declare_whether_they_can_switch_the_momentum_off():
    assert isinstance(SwitchableMomentumHost({}), MomentumSwitch)
    assert not isinstance(NumpyHost({}), MomentumSwitch)
    assert not isinstance(GradientCapture(), MomentumSwitch)
    assert isinstance(NumpyHost({}), ScheduleHost)


@pytest.mark.parametrize("make", [lambda: Compression.dgc(0.01), lambda: Compression.topk(0.01),
                                  lambda: DenseAllreduce(Compression.none, MomentumCorrection())])
def test_bind_host_gives_a_momentum_memory_the_optimizers_momentum(make):
    red = make()
    assert red.bind_host(SwitchableMomentumHost(init_params(), momentum=0.9), ["w", "b"]) == {"momentum": 0.0}
    assert red.memory.momentum == 0.9  # the optimizer then runs without its momentum


def test_bind_host_leaves_error_feedback_alone():
    for red in (Compression.topk(0.01, momentum_correction=False), DenseAllreduce(Compression.fp16, ErrorFeedback())):
        assert red.bind_host(SwitchableMomentumHost(init_params(), momentum=0.9), ["w"]) is None
