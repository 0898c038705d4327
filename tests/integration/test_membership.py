"""Leadership group membership against a real broker: stepping aside hands every partition over.

A replica that cannot apply a committed batch must leave its shard to another node (issue 9);
a consumer group cannot give up one partition alone, so the member leaves the group until it
can lead again. These tests hold that the others get everything at once and that coming back
shares the partitions again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from tests.conftest import unique
from wal.broker import LocalKafka
from wal.membership import GroupMember

pytestmark = pytest.mark.kafka


class _Tracked:
    def __init__(self, kafka: LocalKafka, group: str, topic: str, name: str) -> None:
        self.owned: set[int] = set()
        self.lock = threading.Lock()
        self.member = GroupMember(bootstrap_servers=kafka.bootstrap_servers, group=group, topic=topic,
                                  member_id=name, address=f"{name}:1", session_timeout_ms=6_000,
                                  on_assigned=self._gained, on_revoked=self._lost)

    def _gained(self, shards: list[int]) -> None:
        with self.lock:
            self.owned.update(shards)

    def _lost(self, shards: list[int], lost: bool) -> None:
        with self.lock:
            self.owned.difference_update(shards)

    def snapshot(self) -> set[int]:
        with self.lock:
            return set(self.owned)


def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s}s"
        time.sleep(0.05)


def test_step_aside_hands_every_partition_over_and_come_back_shares_again(kafka: LocalKafka) -> None:
    topic, group = unique("members"), unique("leaders")
    kafka.create_topic(topic, partitions=4)
    a, b = _Tracked(kafka, group, topic, "a"), _Tracked(kafka, group, topic, "b")
    a.member.start()
    b.member.start()
    try:
        _until(lambda: a.snapshot() and b.snapshot() and len(a.snapshot() | b.snapshot()) == 4, 40, "shared")
        a.member.step_aside()
        _until(lambda: not a.snapshot() and b.snapshot() == {0, 1, 2, 3}, 20, "b owns everything")
        time.sleep(1.0)
        assert not a.snapshot(), "a member that stepped aside got partitions back"
        a.member.come_back()
        _until(lambda: a.snapshot() and len(a.snapshot() | b.snapshot()) == 4
               and not (a.snapshot() & b.snapshot()), 40, "shared again")
    finally:
        a.member.leave()
        b.member.leave()
