"""A node's wall clock with its jumps filtered out, for the times a leader stamps (pure).

Leader times go into the WAL and drive the request-id table's eviction by time and the
"expired" rule (`kvstore.core.request_horizon`), prepared transactions' ages and their resolvers'
questions. One wrong stamp outlives the fault: a leader whose clock jumped an hour ahead for ten
seconds stamps entries that make every replica forget the shard's request ids (including a
coordinator's decisions, which resolvers then cannot learn: T3 stays in doubt) and refuse fresh
requests as expired until real time catches up (issue 22's campaign, +70 min jumps).

So the process reads its wall clock through `ClockGuard`: between two readings the wall clock may
move as the monotonic clock did, within `tolerance_ms` (NTP slews by at most 0.5 ms/s); a larger
move is a jump, ignored: the times given follow the monotonic clock from the last good reading.
A step that stays `accept_after_ms` (an operator fixed the clock; NTP stepped it) is taken.

Not covered, and documented (docs/design.md §4): a process that starts with a wrong clock has no
earlier reading to hold it to; a jump that lasts longer than `accept_after_ms` is taken.
"""

from __future__ import annotations

import dataclasses

JUMP_TOLERANCE_MS = 2_000  # far above NTP's slew between two readings, far below MAX_CLOCK_SKEW_MS
STEP_ACCEPTED_AFTER_MS = 60_000  # a jump that lasts this long is a step, taken


@dataclasses.dataclass(frozen=True)
class ClockReading:
    """The time to use, and what to tell the operator (None: nothing new)."""

    unix_ms: int
    note: str | None = None


class ClockGuard:
    """Feed it (monotonic ms, wall ms) pairs; it returns the wall time with jumps filtered out."""

    def __init__(self, tolerance_ms: int = JUMP_TOLERANCE_MS, accept_after_ms: int = STEP_ACCEPTED_AFTER_MS) -> None:
        assert 0 < tolerance_ms < accept_after_ms, (tolerance_ms, accept_after_ms)
        self.tolerance_ms = tolerance_ms
        self.accept_after_ms = accept_after_ms
        self._base: tuple[float, int] | None = None  # (monotonic ms, wall ms) of the last good reading
        self._off_since_ms: float | None = None  # monotonic ms the current jump was first seen
        self.jumps = 0  # jumps ignored (each counted once)

    def read(self, monotonic_ms: float, wall_ms: int) -> ClockReading:
        base = self._base
        if base is None:
            self._base = (monotonic_ms, wall_ms)
            return ClockReading(wall_ms)
        assert monotonic_ms >= base[0], f"monotonic time went back: {monotonic_ms} < {base[0]}"
        held = base[1] + int(monotonic_ms - base[0])
        deviation_ms = wall_ms - held
        if abs(deviation_ms) <= self.tolerance_ms:
            back = self._off_since_ms is not None
            self._off_since_ms = None
            self._base = (monotonic_ms, wall_ms)
            return ClockReading(wall_ms, f"the wall clock is back in line ({deviation_ms:+d} ms)" if back else None)
        if self._off_since_ms is None:
            self._off_since_ms = monotonic_ms
            self.jumps += 1
            return ClockReading(held, f"the wall clock jumped {deviation_ms:+d} ms: ignored, leader times follow "
                                      f"the monotonic clock (a step that stays {self.accept_after_ms // 1000} s "
                                      "is taken)")
        if monotonic_ms - self._off_since_ms >= self.accept_after_ms:
            self._off_since_ms = None
            self._base = (monotonic_ms, wall_ms)
            return ClockReading(wall_ms, f"the wall clock stayed {deviation_ms:+d} ms off for "
                                         f"{self.accept_after_ms // 1000} s: taken as a step")
        return ClockReading(held)
