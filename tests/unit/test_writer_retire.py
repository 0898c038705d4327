"""`wal.writer.retire`: a producer is dropped off the writer's thread, never waited for (issue 22's
campaign: `Producer.close()` flushes without a timeout, and a transactional producer cut off from
its coordinator held its shard's writer there for minutes)."""

from __future__ import annotations

import threading
from typing import Any

from tests.waiting import wait_until
from wal import writer


class _StuckProducer:
    """Stands in for a librdkafka producer that does not let go: its purge blocks."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.purged: list[dict[str, Any]] = []

    def purge(self, **kwargs: Any) -> None:
        self.purged.append(kwargs)
        self.release.wait(30)

    def close(self) -> None:  # what the writer must not call: it would wait forever
        raise AssertionError("close() flushes without a timeout")


def test_retiring_a_stuck_producer_returns_at_once_and_it_goes_once_released() -> None:
    stuck = _StuckProducer()
    before = writer.retiring()
    writer.retire(stuck, "t.shard-0")  # type: ignore[arg-type]
    # Returned while the purge is (or will be) blocked for 30 s: the producer is still retiring.
    assert writer.retiring() == before + 1
    wait_until(lambda: stuck.purged, 10, what="the purge, in the retiring thread")
    assert stuck.purged == [{"in_queue": True, "in_flight": True, "blocking": False}]
    assert writer.retiring() == before + 1
    stuck.release.set()
    wait_until(lambda: writer.retiring() == before, 10, what="the producer destroyed")
