"""`kvstore.core.clock_guard`: the times a node stamps, with its wall clock's jumps filtered out."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvstore.core.clock_guard import ClockGuard
from kvstore.server.clock import GuardedClock

T0 = 1_800_000_000_000
HOUR_MS = 3_600_000

# (monotonic ms, wall ms) read -> (time given, a note containing, or None)
Step = tuple[float, int, int, str | None]


def _run(guard: ClockGuard, steps: list[Step]) -> None:
    for number, (mono, wall, given, note) in enumerate(steps):
        reading = guard.read(mono, wall)
        assert reading.unix_ms == given, f"step {number}: {reading}"
        if note is None:
            assert reading.note is None, f"step {number}: {reading}"
        else:
            assert reading.note is not None and note in reading.note, f"step {number}: {reading}"


def test_a_clock_in_line_is_given_as_it_is_slew_included() -> None:
    _run(ClockGuard(), [
        (0, T0, T0, None),
        (1_000, T0 + 1_000, T0 + 1_000, None),
        (2_000, T0 + 2_400, T0 + 2_400, None),  # NTP slewing (or a big step within the tolerance)
        (3_000, T0 + 3_400, T0 + 3_400, None),
    ])


def test_a_short_jump_forward_or_back_is_ignored_then_the_clock_is_back() -> None:
    """Issue 22's campaign: a leader's clock +70 min for ten seconds stamped entries that made
    the shard forget its request ids, a coordinator's decisions with them (T3 in doubt)."""
    guard = ClockGuard()
    _run(guard, [
        (0, T0, T0, None),
        (1_000, T0 + 1_000 + 70 * 60_000, T0 + 1_000, "jumped +4200000 ms: ignored"),
        (5_000, T0 + 5_000 + 70 * 60_000, T0 + 5_000, None),  # still off: the monotonic clock's time
        (11_000, T0 + 11_000, T0 + 11_000, "back in line (+0 ms)"),
        (12_000, T0 + 12_000 - 300_000, T0 + 12_000, "jumped -300000 ms"),
        (13_000, T0 + 13_000, T0 + 13_000, "back in line"),
    ])
    assert guard.jumps == 2


def test_a_step_that_stays_is_taken_after_a_minute() -> None:
    guard = ClockGuard(tolerance_ms=2_000, accept_after_ms=60_000)
    _run(guard, [
        (0, T0, T0, None),
        (1_000, T0 + 1_000 - HOUR_MS, T0 + 1_000, "jumped -3600000 ms"),
        (60_999, T0 + 60_999 - HOUR_MS, T0 + 60_999, None),
        (61_000, T0 + 61_000 - HOUR_MS, T0 + 61_000 - HOUR_MS, "stayed -3600000 ms off for 60 s: taken"),
        (62_000, T0 + 62_000 - HOUR_MS, T0 + 62_000 - HOUR_MS, None),  # the new line
    ])


def test_the_bounds_are_checked() -> None:
    with pytest.raises(AssertionError):
        ClockGuard(tolerance_ms=0)
    with pytest.raises(AssertionError):
        ClockGuard(tolerance_ms=5_000, accept_after_ms=5_000)
    guard = ClockGuard()
    guard.read(10, T0)
    with pytest.raises(AssertionError, match="monotonic time went back"):
        guard.read(9, T0)


class _Jumpy:
    """A clock whose wall time the test moves; its monotonic time too."""

    def __init__(self) -> None:
        self.mono_s = 100.0
        self.wall_ms = T0
        self.slept: list[float] = []

    def unix_ms(self) -> int:
        return self.wall_ms

    def monotonic(self) -> float:
        return self.mono_s

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_the_guarded_clock_logs_each_jump_once(caplog: pytest.LogCaptureFixture) -> None:
    inner = _Jumpy()
    clock = GuardedClock(inner)
    assert clock.unix_ms() == T0 and clock.monotonic() == 100.0
    inner.mono_s, inner.wall_ms = 101.0, T0 + 1_000 + HOUR_MS
    with caplog.at_level(logging.WARNING, logger="kvstore.server.clock"):
        assert clock.unix_ms() == T0 + 1_000
        inner.mono_s = 102.0
        assert clock.unix_ms() == T0 + 2_000
    assert [r.getMessage() for r in caplog.records if "jumped" in r.getMessage()] != []
    assert len(caplog.records) == 1
    asyncio.run(clock.sleep(0.5))
    assert inner.slept == [0.5]
