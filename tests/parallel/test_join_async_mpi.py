"""Horovod's join after a DistributedOptimizer loop, non-blocking *_async calls, and a step that
only one rank takes, on 2 real MPI ranks (scenarios in mpi_join_async.py; docs/horovod_api.md#join,
docs/horovod_api.md#async, docs/horovod_api.md#one-rank-step)."""
import os
import re
import subprocess
import sys
import time

import pytest

from tests.parallel.launch import ROOT, run_mpi

pytest.importorskip("torch")
pytest.importorskip("mpi4py")

SCRIPT = str(ROOT / "tests/parallel/mpi_join_async.py")


def job(*args, env=None, check=True):
    t0 = time.monotonic()
    proc = run_mpi(2, [sys.executable, SCRIPT, *args], timeout=200, env=env, check=check)
    return proc.stdout + proc.stderr, time.monotonic() - t0


GLOO = {"HVD_COMMOPT_BACKEND": "gloo"}  # torch.distributed carries the data, MPI the control plane


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_join_after_uneven_optimizer_loops_takes_part_with_zeros(compression, backend):
    out, _ = job("join", compression, env=GLOO if backend == "gloo" else None)
    for r in (0, 1):
        m = re.search(rf"rank {r}: join returned (\d) after ([0-9.]+)s; exact=(\w+); after=(\S+)", out)
        assert m, out
        assert m.group(1) == "1", out  # rank 1 joined last, on both ranks
        assert m.group(3) == "True", out  # every step exactly as Horovod's zeros give it
        assert m.group(4) == "1", out
        assert float(m.group(2)) < 30, out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("method", ["topk", "dgc"])
def test_join_after_uneven_sparse_loops_equals_the_replay_bit_for_bit(method, backend):
    replay = subprocess.run([sys.executable, SCRIPT, "join", method, "replay"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    at10 = re.search(r"rank 0: at 10 weights=(\w+)", replay.stdout)
    at12 = re.search(r"final weights=(\w+)", replay.stdout)
    assert at10 and at12, replay.stdout + replay.stderr
    out, _ = job("join", method, env=GLOO if backend == "gloo" else None)
    assert f"rank 0: join returned 1; final weights={at10.group(1)}" in out, out  # 10 steps, then joined
    assert f"rank 1: at 10 weights={at10.group(1)}" in out, out
    assert f"rank 1: join returned 1; final weights={at12.group(1)}" in out, out  # steps 11-12 with zeros


def test_async_returns_before_the_peer_arrives():
    out, _ = job("async")
    m = re.search(r"rank 0: returned after ([0-9.]+)s; poll=(\w+); result=\[3.0, 3.0, 3.0\]; duplicate=(\w+)", out)
    assert m, out
    assert float(m.group(1)) < 1.0, out  # the peer comes 3 s later
    assert m.group(2) == "False", out
    assert m.group(3) == "ConfigError", out
    assert "rank 1: returned" in out and "result=[3.0, 3.0, 3.0]" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mpi", "gloo"])  # gloo: without the check, Gloo itself aborts a rank
def test_step_only_one_rank_takes_is_named_in_seconds_on_every_rank(backend):
    out, took = job("one_rank_step", env={"HVD_COMMOPT_TIMEOUT": "300", **(GLOO if backend == "gloo" else {})},
                    check=False)
    assert took < 60, f"{took:.0f}s: waited for the timeout\n{out}"
    assert re.search(r"rank 0: \w+Error after [0-9.]+s: .*rank 1 waits in its collective #\d+ allgather_object "
                     r"'negotiate'", out), out
    assert "rank 1: " in out and re.search(r"rank 1: \w+Error after [0-9.]+s", out), out
    assert "a step or collective that only some ranks run" in out, out


@pytest.mark.slow
def test_join_refuses_point_to_point_rounds_clearly():
    out, took = job("join_adasum", env={"HVD_COMMOPT_TIMEOUT": "300"}, check=False)
    assert took < 60, f"{took:.0f}s\n{out}"
    assert re.search(r"rank 0: ConfigError after [0-9.]+s: rank 0 called join\(\), and the other ranks now run "
                     r"collective #\d+ sendrecv", out), out
    assert "point-to-point round" in out, out
    assert re.search(r"rank 1: RankFailedError after [0-9.]+s", out), out


def test_collectives_are_matched_by_name_across_orders():
    out, _ = job("order")
    for r in (0, 1):
        m = re.search(rf"rank {r}: first=\[3.0, 3.0\]; a=195; b=197; mismatch=TensorMismatchError after "
                      rf"([0-9.]+)s; after=2", out)
        assert m, out
        assert float(m.group(1)) < 30, out


def test_sparse_gradients_through_distributed_optimizer():
    out, _ = job("sparse")
    assert "rank 0: sparse exact=[True, True]" in out and "rank 1: sparse exact=[True, True]" in out, out
