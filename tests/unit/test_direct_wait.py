"""How the waiter of a directly started collective polls (docs/backends.md#direct-wait), on a fake
clock: short waits keep the 50-200 us pauses; a long one wakes far less and still sees the work
done at most 1 % of its age late (or 200 us, whichever is more)."""
from __future__ import annotations

import pytest

from hvd_commopt.comm import direct


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def perf_counter(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def _wait(monkeypatch: pytest.MonkeyPatch, done_at: float, slice_s: float = 0.2) -> tuple[FakeClock, int]:
    clock = FakeClock()
    monkeypatch.setattr(direct, "time", clock)
    polls = 0

    def is_completed() -> bool:
        nonlocal polls
        polls += 1
        return clock.t >= done_at

    h = direct.DirectHandle("allreduce", "b", is_completed, lambda hh: hh._set("ok"))
    h._submitted = 0.0  # started at the fake clock's zero
    while not h.wait_ready(slice_s):  # the communicator waits in slices (its peer checks)
        pass
    assert h.wait() == "ok"
    return clock, polls


def test_a_short_wait_polls_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, polls = _wait(monkeypatch, 0.015)  # a 15 ms allreduce at the end of a step
    assert clock.sleeps[:3] == [5e-5, 1e-4, 2e-4]
    assert max(clock.sleeps) == 2e-4  # below 20 ms of age, 1 % of it is less than 200 us
    assert 70 <= polls <= 100
    assert clock.t - 0.015 <= 2e-4


@pytest.mark.parametrize("done_at", [0.05, 0.3, 2.0])
def test_a_long_wait_wakes_less_and_is_at_most_one_percent_late(monkeypatch: pytest.MonkeyPatch,
                                                                 done_at: float) -> None:
    clock, polls = _wait(monkeypatch, done_at)
    assert max(clock.sleeps) <= direct.PAUSE_MAX_S
    assert clock.t - done_at <= max(direct.LATE_FRACTION * done_at, direct.PAUSE_SHORT_S) + 1e-12
    assert polls < 0.8 * done_at / direct.PAUSE_SHORT_S  # the 200 us pauses alone: done_at / 200 us
    if done_at >= 2.0:
        assert polls < 1300  # 10,000 with the 200 us pauses alone


def test_a_slice_that_runs_out_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(direct, "time", clock)
    h = direct.DirectHandle("allreduce", "b", lambda: False, lambda hh: hh._set("ok"))
    h._submitted = 0.0
    assert h.wait_ready(0.2) is False
    assert clock.t == pytest.approx(0.2)  # the last pause is cut to the slice's end
