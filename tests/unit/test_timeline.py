"""Tests for hvd_commopt/timeline.py, the Chrome-trace writer, and its communicator hook."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from hvd_commopt import timeline
from hvd_commopt.comm import run_ranks


@pytest.fixture(autouse=True)
def _no_active_timeline():
    timeline.stop()
    yield
    timeline.stop()


def _events(path: str) -> list[dict]:
    return json.loads(open(path).read())  # must be valid JSON once closed


def test_rank_path() -> None:
    assert timeline.rank_path("/t/trace.json", 3) == "/t/trace.rank3.json"
    assert timeline.rank_path("/t/trace", 0) == "/t/trace.rank0.json"
    assert timeline.rank_path("/t/{rank}/x.json", 1) == "/t/1/x.json"


def test_spans_instants_and_metadata(tmp_path) -> None:
    tl = timeline.start(str(tmp_path / "tr.json"), rank=2)
    with timeline.span("backward", "backward", {"layer": 1}):
        time.sleep(0.002)
    timeline.instant("grad w", "backward")
    t0 = time.perf_counter()
    timeline.complete("allreduce b0", "comm", t0, t0 + 0.5, {"bytes_sent": 8})
    assert timeline.stop() == tl.path == str(tmp_path / "tr.rank2.json")
    ev = _events(tl.path)
    names = {e["name"] for e in ev if e["ph"] == "M"}
    assert {"process_name", "thread_name", "hvd_commopt_timeline"} <= names
    span = next(e for e in ev if e["name"] == "backward")
    assert span["ph"] == "X" and span["pid"] == 2 and span["dur"] >= 1500 and span["args"] == {"layer": 1}
    comm = next(e for e in ev if e["name"] == "allreduce b0")
    assert comm["dur"] == pytest.approx(5e5) and comm["tid"] == timeline.LANES["comm"]
    assert any(e["ph"] == "i" and e["name"] == "grad w" for e in ev)


def test_disabled_is_a_noop(tmp_path) -> None:
    assert timeline.active() is None
    with timeline.span("x", "step"):
        pass
    timeline.instant("y", "step")
    assert timeline.stop() is None
    assert list(tmp_path.iterdir()) == []


def test_thread_safe_and_bounded(tmp_path) -> None:
    tl = timeline.start(str(tmp_path / "t.json"), rank=0, flush_every=64, max_events=1000)

    def work(k: int) -> None:
        for i in range(500):
            timeline.instant(f"e{k}.{i}", "comm")
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tl._buf) < 64  # streamed to disk, not held in memory
    timeline.stop()
    ev = _events(tl.path)
    inst = [e for e in ev if e["ph"] == "i"]
    assert len(inst) == 1000
    summary = next(e for e in ev if e["name"] == "hvd_commopt_timeline")
    assert summary["args"]["dropped"] == 1000


def test_env_variable_starts_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HVD_COMMOPT_TIMELINE", str(tmp_path / "env.json"))
    tl = timeline.start_from_env(rank=1)
    assert tl is not None and tl.path == str(tmp_path / "env.rank1.json")
    assert timeline.start_from_env(rank=1) is tl  # already recording: kept


def test_communicator_records_each_collective(tmp_path) -> None:
    timeline.start(str(tmp_path / "c.json"), rank=0)

    def body(comm):
        buf = np.ones(1000, dtype=np.float32)
        comm.allreduce_(buf, name="bucket0")
        comm.barrier()
        return float(buf[0])

    assert run_ranks(2, body) == [2.0, 2.0]
    path = timeline.stop()
    comm = [e for e in _events(path) if e.get("cat") == "comm"]
    ar = [e for e in comm if e["name"] == "allreduce bucket0"]
    assert len(ar) == 2  # both in-process ranks share the process-wide timeline
    assert ar[0]["args"]["bytes_sent"] == 4000 and ar[0]["dur"] >= 0
    assert any(e["name"] == "barrier barrier" for e in comm)


def test_engine_records_ready_compress_and_wait(tmp_path) -> None:
    from hvd_commopt import NumpyOps, build_engine
    from hvd_commopt.engine import TensorSpec

    timeline.start(str(tmp_path / "e.json"), rank=0)

    def body(comm):
        eng = build_engine(comm, NumpyOps(), fusion_threshold=0)
        eng.register([TensorSpec("a", (3,), "float32"), TensorSpec("b", (2,), "float32")])
        for n, k in (("b", 2), ("a", 3)):
            eng.grad_ready(n, np.ones(k, dtype=np.float32))
        return eng.reduce_step()["a"].tolist()

    assert run_ranks(2, body) == [[1.0, 1.0, 1.0]] * 2
    ev = _events(timeline.stop())
    lanes = {(e.get("cat"), e["name"].split()[0]) for e in ev if e["ph"] in ("X", "i")}
    assert {("backward", "grad"), ("compress", "compress+launch"), ("comm", "allreduce"),
            ("wait", "wait")} <= lanes
