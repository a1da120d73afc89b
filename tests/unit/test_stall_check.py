"""The early stall check (hvd_commopt.comm.mpi_join.stalled) on crafted peer states: a rank behind
another on a collective the leader finished is slow, not a mismatch; a difference at the same
collective number is one (docs/horovod_api.md#one-rank-step)."""
from __future__ import annotations

import pytest

from hvd_commopt.comm import mpi_join


class FakeBackend:
    """The fields stalled() reads from an MPIBackend, with the peers' replies given."""

    def __init__(self, rank, size, where, history, peers):
        self.rank, self.size = rank, size
        self._where, self._history, self._peers = where, tuple(history), peers
        self._joined_at, self._can_query, self._stall, self._broken = None, True, None, False

    def _query_peers(self):
        return self._peers


def _peer(where, history):
    return {"where": where, "last": None, "left": False, "joined": None, "history": tuple(history)}


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(mpi_join.time, "monotonic", lambda: now[0])
    return now


def _check_twice(be, clock):
    first = mpi_join.stalled(be, 2.0)
    clock[0] += 1.5  # past the confirm period, nobody moved
    return first, mpi_join.stalled(be, 3.5)


def test_trailing_rank_on_the_collective_the_leader_finished_is_not_a_mismatch(clock):
    # the reported case: rank 0 finished #2560 (the allreduce rank 1 still waits in) and waits in #2561
    hist0 = [(2559, "allgather", "bucket1:fc2.weight+3.sparse"), (2560, "allreduce", "bucket0:fc2.bias+3.dense"),
             (2561, "allgather", "bucket1:fc2.weight+3.sparse")]
    where1 = (2560, "allreduce", "bucket0:fc2.bias+3.dense", None)
    be = FakeBackend(1, 2, where1, hist0[:2], {0: _peer(hist0[2] + (None,), hist0)})
    assert _check_twice(be, clock) == (None, None)
    assert not be._broken
    # the same seen from the leader's side
    be0 = FakeBackend(0, 2, hist0[2] + (None,), hist0, {1: _peer(where1, hist0[:2])})
    assert _check_twice(be0, clock) == (None, None)


def test_same_number_different_collectives_is_a_mismatch(clock):
    w0, w1 = (7, "allreduce", "bucket0:a", None), (7, "allgather_object", "negotiate")
    be = FakeBackend(1, 2, w1 + (None,), [w1], {0: _peer(w0, [w0[:3]])})
    first, second = _check_twice(be, clock)
    assert first is None  # confirmed only when seen again a second later
    assert second is not None and second[0] == [0]
    assert "rank 0 waits in its collective #7 allreduce 'bucket0:a'" in second[1]
    assert "rank 1 waits in its collective #7 allgather_object 'negotiate'" in second[1]
    assert be._broken


def test_leader_history_differs_at_the_trailers_number_is_a_mismatch(clock):
    # rank 0 ran an extra step: its #5 was a bucket, where rank 1's #5 is the next call's barrier
    hist0 = [(5, "allreduce", "bucket0:a"), (6, "allreduce", "bucket1:b")]
    w1 = (5, "barrier", "end")
    be = FakeBackend(1, 2, w1 + (None,), [w1], {0: _peer(hist0[1] + (None,), hist0)})
    first, second = _check_twice(be, clock)
    assert first is None and second is not None and second[0] == [0]


def test_trailer_beyond_the_leaders_history_keeps_the_confirmed_report(clock):
    hist0 = [(s, "allreduce", f"bucket{s % 2}:x") for s in range(200 - mpi_join.HISTORY_LEN, 200)]
    w1 = (10, "allreduce", "bucket0:x")
    be = FakeBackend(1, 2, w1 + (None,), [w1], {0: _peer(hist0[-1] + (None,), hist0)})
    first, second = _check_twice(be, clock)
    assert first is None and second is not None and second[0] == [0]


def test_three_ranks_one_behind_one_elsewhere_is_a_mismatch(clock):
    hist = [(3, "allreduce", "bucket0:a"), (4, "allreduce", "bucket1:b")]
    w2 = (4, "barrier", "x")  # rank 2 is at #4 with a different collective than rank 0's #4
    be = FakeBackend(1, 3, hist[0] + (None,), hist[:1],
                     {0: _peer(hist[1] + (None,), hist), 2: _peer(w2 + (None,), hist[:1] + [w2])})
    first, second = _check_twice(be, clock)
    assert first is None and second is not None and set(second[0]) == {0, 2}
