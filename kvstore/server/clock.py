"""The clock seam: every place the server waits or stamps a time asks a `Clock`, so a test can
run a replica with a clock of its own (e.g. hours ahead, to cross the request-id horizon)
instead of sleeping or racing the real one. The pure core never reads a clock: it is given
`now` (kvstore.core.batch)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Protocol

from kvstore.core.clock_guard import ClockGuard

log = logging.getLogger(__name__)


class Clock(Protocol):
    def unix_ms(self) -> int:
        """Wall-clock time in Unix milliseconds: leader times of WAL entries, request-id horizons."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: deadlines and bounded waits."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock's time (a pause, a backoff, a linger)."""
        ...


class SystemClock:
    def unix_ms(self) -> int:
        return int(time.time() * 1000)

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK: Clock = SystemClock()


# Tests only: a node started with this variable naming a file reads its wall clock as the
# system's plus the milliseconds written in that file (0 or absent: no offset), so a campaign can
# make a running leader's clock jump forward and back (tests/robustness) without touching the
# machine's clock, which every other process shares. Monotonic time stays real: bounded waits
# and deadlines are the process's own and a wall-clock jump must not stretch them.
OFFSET_FILE_ENV = "KVSTORE_CLOCK_OFFSET_FILE"
_OFFSET_REREAD_S = 0.1


class OffsetFileClock:
    """The system clock plus an offset (ms) read from a file, re-read at most every 100 ms; a file
    that is missing or does not hold an integer means no offset (a half-written file is read again
    on the next call, never taken for a jump)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset_ms = 0
        self._read_at = float("-inf")

    def offset_ms(self) -> int:
        now = time.monotonic()
        if now - self._read_at >= _OFFSET_REREAD_S:
            self._read_at = now
            try:
                with open(self.path) as f:
                    self._offset_ms = int(f.read().strip() or "0")
            except (OSError, ValueError):
                self._offset_ms = 0
        return self._offset_ms

    def unix_ms(self) -> int:
        return int(time.time() * 1000) + self.offset_ms()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class GuardedClock:
    """`inner` with its wall clock's jumps filtered out (`kvstore.core.clock_guard`): what a
    node's leaders stamp. Thread-safe (transaction drivers and replicas share it)."""

    def __init__(self, inner: Clock, guard: ClockGuard | None = None) -> None:
        self.inner = inner
        self.guard = guard or ClockGuard()
        self._lock = threading.Lock()

    def unix_ms(self) -> int:
        with self._lock:
            reading = self.guard.read(self.inner.monotonic() * 1000, self.inner.unix_ms())
        if reading.note is not None:
            log.warning("%s", reading.note)
        return reading.unix_ms

    def monotonic(self) -> float:
        return self.inner.monotonic()

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


_PROCESS_CLOCK: Clock | None = None


def process_clock() -> Clock:
    """The clock of this node's process, one for all its parts: the system's (or the test seam's
    when OFFSET_FILE_ENV is set), guarded against jumps."""
    global _PROCESS_CLOCK
    if _PROCESS_CLOCK is None:
        path = os.environ.get(OFFSET_FILE_ENV, "")
        _PROCESS_CLOCK = GuardedClock(OffsetFileClock(path) if path else SYSTEM_CLOCK)
    return _PROCESS_CLOCK
