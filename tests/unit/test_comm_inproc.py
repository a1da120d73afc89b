"""The communicator's collectives on in-process ranks, and the never-hang guarantee."""
import time

import numpy as np
import pytest

from hvd_commopt.comm import InProcWorld, run_ranks
from hvd_commopt.errors import CollectiveTimeoutError, ConfigError, RankMismatchError


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allreduce_sum_is_identical_on_all_ranks(size):
    def body(comm):
        a = np.arange(5, dtype=np.float32) * (comm.rank + 1)
        comm.allreduce_(a)
        return a
    out = run_ranks(size, body)
    expect = np.arange(5, dtype=np.float32) * sum(range(1, size + 1))
    for a in out:
        np.testing.assert_array_equal(a, expect)


def test_min_max_and_bad_op():
    def body(comm):
        lo = np.array([comm.rank], dtype=np.int64)
        hi = lo.copy()
        comm.allreduce_(lo, "min")
        comm.allreduce_(hi, "max")
        with pytest.raises(ConfigError, match="average = sum then divide"):
            comm.allreduce_async_(lo, "average")
        return int(lo[0]), int(hi[0])
    assert run_ranks(3, body) == [(0, 2)] * 3


def test_allgather_with_different_sizes():
    def body(comm):
        out, counts = comm.allgather(np.full(comm.rank + 1, comm.rank, dtype=np.int32))
        return out.tolist(), counts
    for out, counts in run_ranks(3, body):
        assert out == [0, 1, 1, 2, 2, 2]
        assert counts == [1, 2, 3]


def test_broadcast_objects_and_barrier():
    def body(comm):
        b = np.full(3, comm.rank, dtype=np.float64)
        comm.broadcast_(b, root=2)
        comm.barrier()
        return b.tolist(), comm.broadcast_object({"r": comm.rank}, root=1), comm.allgather_object(comm.rank)
    for b, obj, objs in run_ranks(3, body):
        assert b == [2.0, 2.0, 2.0]
        assert obj == {"r": 1}
        assert objs == [0, 1, 2]


def test_sendrecv_ring():
    def body(comm):
        p, r = comm.size, comm.rank
        got = comm.sendrecv(np.array([r, r], dtype=np.int64), (r + 1) % p, (r - 1) % p)
        return got.tolist()
    assert run_ranks(4, body) == [[3, 3], [0, 0], [1, 1], [2, 2]]


def test_async_handles_poll_and_count_traffic():
    def body(comm):
        a = np.ones(1000, dtype=np.float32)
        h = comm.allreduce_async_(a)
        comm.wait(h)
        assert h.poll()
        return h.bytes_sent, comm.traffic.snapshot()["bytes_sent"]
    sent, total = run_ranks(4, body)[0]
    assert sent == int(2 * 3 / 4 * 4000)  # ring allreduce: 2(P-1)/P of the buffer
    assert total == sent


def test_rank_that_skips_a_collective_is_named_and_nobody_hangs():
    def body(comm):
        if comm.rank == 1:
            return "skipped"
        with pytest.raises(CollectiveTimeoutError) as e:
            comm.allreduce_(np.ones(2, dtype=np.float32), name="grad.bucket0")
        assert e.value.missing_ranks == [1]
        assert "grad.bucket0" in str(e.value) and "[1] did not arrive" in str(e.value)
        return "timed out"
    t0 = time.monotonic()
    assert run_ranks(3, body, timeout_s=0.5) == ["timed out", "skipped", "timed out"]
    assert time.monotonic() - t0 < 10


def test_ranks_calling_different_collectives_are_refused():
    def body(comm):
        if comm.rank == 0:
            comm.allreduce_(np.ones(2, dtype=np.float32), name="x")
        else:
            comm.broadcast_(np.ones(2, dtype=np.float32), 0, name="y")
    with pytest.raises(RankMismatchError, match="different collectives"):
        run_ranks(2, body, timeout_s=5)


def test_world_size_must_be_positive():
    with pytest.raises(ValueError):
        InProcWorld(0)
