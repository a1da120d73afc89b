"""Checkpoints with per-rank parts (docs/wrapper.md#checkpoints): in-process ranks, NumpyOps.

Rank 0's state_dict holds every rank's part; any rank resumes from it bit-exactly; another world
size resets the per-rank state with a warning; a missing part is refused naming the fix.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from hvd_commopt import Compression, NumpyOps, build_engine, run_ranks
from hvd_commopt.checkpoint import HostTensor, from_host, to_host
from hvd_commopt.engine import TensorSpec
from hvd_commopt.errors import ConfigError

ops = NumpyOps()
SPECS = [TensorSpec("w1", (10, 6), "float32"), TensorSpec("b1", (3,), "float32")]


def grads(rank, step):
    rng = np.random.default_rng(1000 * step + rank)
    return {s.name: rng.standard_normal(s.numel).astype(np.float32) for s in SPECS}


def engine(comm):
    eng = build_engine(comm, ops, compression=Compression.topk(0.2), fusion_threshold=1 << 30)
    eng.register(SPECS)
    return eng


def run_steps(eng, rank, first, count):
    out = None
    for s in range(first, first + count):
        g = grads(rank, s)
        for name in eng.backward_names:
            eng.grad_ready(name, g[name].copy())
        out = eng.reduce_step()
    return {k: v.copy() for k, v in out.items()}


def residuals(eng):
    return {k: np.array(v, copy=True) for k, v in eng.reducer.state_dict()["memory"]["residuals"].items()}


def saved(P, steps=2):
    def body(comm):
        eng = engine(comm)
        run_steps(eng, comm.rank, 0, steps)
        return eng.state_dict(), residuals(eng)
    return run_ranks(P, body)


def test_rank0_holds_every_part_the_others_their_own():
    res = saved(3)
    sd0 = res[0][0]
    assert sd0["world_size"] == 3 and sd0["step"] == 2 and sorted(sd0["ranks"]) == [0, 1, 2]
    for r in (1, 2):
        assert sorted(res[r][0]["ranks"]) == [r]
        for k, v in res[r][1].items():  # rank 0's copy of rank r's residual is rank r's
            np.testing.assert_array_equal(sd0["ranks"][r]["reducer"]["memory"]["residuals"][k], v)
    assert not all(np.array_equal(res[0][1][k], res[1][1][k]) for k in res[0][1])  # they do differ


def test_every_rank_resumes_from_rank0s_checkpoint_bit_exactly():
    P = 3
    ref = run_ranks(P, lambda comm: (lambda e: (run_steps(e, comm.rank, 0, 5), residuals(e)))(engine(comm)))
    ck = saved(P)[0][0]

    def body(comm):
        eng = engine(comm)
        eng.load_state_dict(ck)
        assert eng.step == 2
        return run_steps(eng, comm.rank, 2, 3), residuals(eng)
    res = run_ranks(P, body)
    for r in range(P):
        for k in ref[r][0]:
            np.testing.assert_array_equal(ref[r][0][k], res[r][0][k])
        for k in ref[r][1]:
            np.testing.assert_array_equal(ref[r][1][k], res[r][1][k])


def test_per_rank_files_still_work_and_a_missing_part_is_refused():
    res = saved(2)

    def body(comm):
        eng = engine(comm)
        eng.load_state_dict(res[comm.rank][0])  # its own file
        for k, v in residuals(eng).items():
            np.testing.assert_array_equal(v, res[comm.rank][1][k])
        if comm.rank == 0:
            with pytest.raises(ConfigError, match=r"rank 0: this checkpoint holds the per-rank state of rank\(s\) "
                                                  r"\[1\] only. Save rank 0's optimizer.state_dict\(\)"):
                eng.load_state_dict(res[1][0])
    run_ranks(2, body)


def test_another_world_size_keeps_shared_state_and_resets_per_rank_state():
    ck = saved(3)[0][0]

    def body(comm):
        eng = engine(comm)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            eng.load_state_dict(ck)
        msgs = [str(x.message) for x in w]
        assert any(f"rank {comm.rank}: this checkpoint was saved by 3 ranks and is loaded by 2" in m for m in msgs)
        assert eng.step == 2 and residuals(eng) == {}
        return run_steps(eng, comm.rank, 2, 2)
    res = run_ranks(2, body)
    for k in res[0]:
        np.testing.assert_array_equal(res[0][k], res[1][k])


def test_a_checkpoint_without_format_loads_as_this_ranks_own_state():
    def body(comm):
        eng = engine(comm)
        run_steps(eng, 0, 0, 2)
        legacy = {"step": 2, "reducer": eng.reducer.state_dict(), "schedule": {"kind": "sync"}}
        before = residuals(eng)
        eng2 = engine(comm)
        eng2.load_state_dict(legacy)
        assert eng2.step == 2
        for k, v in residuals(eng2).items():
            np.testing.assert_array_equal(v, before[k])
    run_ranks(1, body)


def test_host_round_trip_keeps_structure_and_dtypes():
    obj = {"a": [np.arange(3, dtype=np.float16), (1, "x", None)], 3: {"b": np.ones((2, 2), np.float64)}}
    host = to_host(ops, obj)
    assert isinstance(host["a"][0], HostTensor) and host["a"][1] == (1, "x", None)
    back = from_host(ops, host)
    assert back["a"][0].dtype == np.float16 and back[3]["b"].shape == (2, 2)
    np.testing.assert_array_equal(back[3]["b"], obj[3]["b"])


def test_without_per_rank_state_rank0_alone_may_call_state_dict():
    """Synchronous SGD without error feedback: nothing differs across ranks, so state_dict()
    communicates nothing and Horovod's `if rank == 0: save(opt.state_dict())` works; every rank
    loads rank 0's file."""
    def body(comm):
        eng = build_engine(comm, ops, fusion_threshold=1 << 30)
        eng.register(SPECS)
        run_steps(eng, comm.rank, 0, 2)
        sd = eng.state_dict() if comm.rank == 0 else None  # rank 1 runs no collective here
        comm.barrier()
        return sd
    res = run_ranks(2, body)
    sd0 = res[0]
    assert sd0["world_size"] == 2 and sd0["step"] == 2 and sorted(sd0["ranks"]) == [0, 1]

    def load(comm):
        eng = build_engine(comm, ops, fusion_threshold=1 << 30)
        eng.register(SPECS)
        eng.load_state_dict(sd0)
        return eng.state_dict()["step"]
    assert run_ranks(2, load) == [2, 2]
