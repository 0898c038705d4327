"""The clock seam: every place the server waits or stamps a time asks a `Clock`, so a test can
run a replica with a clock of its own (e.g. hours ahead, to cross the request-id horizon)
instead of sleeping or racing the real one. The pure core never reads a clock: it is given
`now` (kvstore.core.batch)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


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
