"""Horovod's timeline API (docs/horovod_api.md#timeline): start_timeline/stop_timeline and
HOROVOD_TIMELINE=DYNAMIC, in both adapters (the core's runtime does the work)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import torch_plugin as hco
from hvd_commopt import runtime, timeline


@pytest.fixture
def size_one(monkeypatch):
    for var in ("HVD_COMMOPT_TIMELINE", "HOROVOD_TIMELINE"):
        monkeypatch.delenv(var, raising=False)
    timeline.stop()
    runtime.shutdown()
    yield monkeypatch
    timeline.stop()
    runtime.shutdown()


def test_dynamic_starts_nothing_until_start_timeline(size_one, tmp_path):
    size_one.chdir(tmp_path)
    size_one.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    hco.init()
    assert timeline.active() is None and os.listdir(tmp_path) == []  # no file named DYNAMIC*
    path = str(tmp_path / "trace.json")
    model = torch.nn.Linear(4, 2)
    opt = hco.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())

    def step():
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()

    step()  # before start_timeline: not recorded
    hco.start_timeline(path)
    step()
    hco.stop_timeline()
    step()  # after stop_timeline: not recorded
    hco.stop_timeline()  # stopping twice is a no-op, as in Horovod
    events = json.loads(open(path).read())  # rank 0 writes file_path itself, valid JSON once stopped
    names = [e["name"] for e in events if e.get("ph") != "M"]
    assert names.count("update") == 1 and names.count("sync step") == 1, names  # the one step between


def test_start_timeline_needs_init_and_the_variable(size_one, tmp_path):
    with pytest.raises(ValueError, match="hvd.init"):
        hco.start_timeline(str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="hvd.init"):
        hco.stop_timeline()
    hco.init()
    with pytest.raises(ValueError, match="HOROVOD_TIMELINE=DYNAMIC"):
        hco.start_timeline(str(tmp_path / "t.json"))
    size_one.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    with pytest.raises(hco.ConfigError, match="mark_cycles"):
        hco.start_timeline(str(tmp_path / "t.json"), mark_cycles="yes")


def test_tf_plugin_exposes_the_same_functions():
    tf_plugin = pytest.importorskip("tf_plugin")
    assert tf_plugin.start_timeline is hco.start_timeline is runtime.start_timeline
    assert tf_plugin.stop_timeline is runtime.stop_timeline
