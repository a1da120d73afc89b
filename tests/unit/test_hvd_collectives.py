"""Core Horovod-style collectives on in-process ranks: the cross-rank check, ops, dtypes,
alltoall, reducescatter, join, process sets (exact values)."""
import numpy as np
import pytest

from hvd_commopt import collectives as C
from hvd_commopt import scatter as S
from hvd_commopt.comm.inproc import run_ranks
from hvd_commopt.errors import ConfigError
from hvd_commopt.join import join
from hvd_commopt.negotiate import TensorMismatchError
from hvd_commopt.numpy_ops import NumpyOps
from hvd_commopt.process_sets import registry

OPS = NumpyOps()


def test_mismatch_raises_the_same_error_on_every_rank_and_the_stream_survives():
    def body(comm):
        msgs = []
        for call in (lambda: C.allreduce(comm, OPS, np.zeros(3 + comm.rank, np.float32)),
                     lambda: C.allreduce(comm, OPS, np.zeros(3, np.int32 if comm.rank else np.float32)),
                     lambda: C.broadcast(comm, OPS, np.zeros(2, np.float32), comm.rank),
                     lambda: C.allgather(comm, OPS, np.zeros((2 + comm.rank) * 2, np.float32), (2 + comm.rank,))):
            with pytest.raises(TensorMismatchError) as e:
                call()
            msgs.append(str(e.value))
        return msgs, C.allreduce(comm, OPS, np.ones(2, np.float32), op="sum")
    res = run_ranks(3, body)
    assert res[0][0] == res[1][0] == res[2][0]
    assert "rank 2: allreduce float32[5]" in res[0][0][0]
    assert "rank 1: allreduce int32[3]" in res[0][0][1] and "root 2" in res[0][0][2]
    assert all(r[1].tolist() == [3, 3] for r in res)


def test_ops_int_scaling_and_uint16():
    def body(comm):
        r = comm.rank
        return (C.allreduce(comm, OPS, np.array([r, -r], np.float16), op="min").tolist(),
                C.allreduce(comm, OPS, np.array([r + 1], np.int64), op="product").tolist(),
                C.allreduce(comm, OPS, np.array([7, -7], np.int32), op="sum", prescale_factor=0.5).tolist(),
                C.allreduce(comm, OPS, np.array([9], np.int64), op="average").tolist())
    for out in run_ranks(3, body):
        assert out == ([0.0, -2.0], [6], [9, -9], [9])


def test_alltoall_reducescatter_and_bad_splits():
    def body(comm):
        r = comm.rank
        t = np.arange(3, dtype=np.float64) + 10 * r
        got = S.alltoall_async(comm, OPS, t, (3,), [1, 2] if r == 0 else [2, 1]).wait()
        rs = S.reducescatter_async(comm, OPS, np.arange(6, dtype=np.float32), (3, 2), op="sum").wait()
        with pytest.raises(ConfigError, match="splits"):
            S.alltoall_async(comm, OPS, t, (3,), [3, 1])
        return got[0].tolist(), got[1], rs.tolist()
    a, b = run_ranks(2, body)
    assert a == ([0.0, 10.0, 11.0], [1, 2], [0.0, 2.0, 4.0, 6.0])
    assert b == ([1.0, 2.0, 12.0], [2, 1], [8.0, 10.0])


def test_join_mirrors_allreduces_with_zeros_and_refuses_allgather():
    def body(comm):
        if comm.rank == 1:
            return join(comm, OPS), None
        out = C.allreduce(comm, OPS, np.full(2, 6.0, np.float32))
        with pytest.raises(TensorMismatchError, match=r"join\(\)"):
            C.allgather(comm, OPS, np.ones(1, np.float32), ())
        return join(comm, OPS), out.tolist()
    res = run_ranks(3, body)
    assert [r[0] for r in res] == [2, 2, 2]  # rank 2 joined last (it joined in the final round only)
    assert res[0][1] == [4.0, 4.0]  # (6 + 0 + 6) / 3


def test_process_sets_subset_collectives_and_registration_checks():
    def body(comm):
        reg = registry(comm)
        pair = reg.add([0, 2])
        with pytest.raises(Exception, match="same ranks"):
            reg.add([comm.rank])
        out = None
        if comm.rank in (0, 2):
            c = reg.communicator_for(pair)
            out = (C.allreduce(c, OPS, np.full(2, comm.rank + 1.0, np.float32), op="sum").tolist(),
                   C.broadcast(c, OPS, np.full(1, comm.rank, np.int8), pair.local(2)).tolist(), c.rank, c.size)
        else:
            with pytest.raises(ConfigError, match="not in process set"):
                reg.communicator_for(pair)
        return out
    res = run_ranks(3, body)
    assert res[0] == ([4.0, 4.0], [2], 0, 2) and res[2] == ([4.0, 4.0], [2], 1, 2) and res[1] is None
