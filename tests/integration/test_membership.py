"""Leadership group membership against a real broker: stepping aside hands every partition over.

A replica that cannot apply a committed batch must leave its shard to another node (issue 9);
a consumer group cannot give up one partition alone, so the member leaves the group until it
can lead again. These tests hold that the others get everything at once and that coming back
shares the partitions again.
"""

from __future__ import annotations

import threading

import pytest

from tests.conftest import unique
from tests.waiting import NotYet, holds_for, wait_until
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


def _shared(a: _Tracked, b: _Tracked) -> bool:
    """Every partition owned, by exactly one of the two, and each owns some."""
    mine, theirs = a.snapshot(), b.snapshot()
    if not (mine and theirs and len(mine | theirs) == 4 and not mine & theirs):
        raise NotYet(f"a owns {sorted(mine)}, b owns {sorted(theirs)}")
    return True


def test_step_aside_hands_every_partition_over_and_come_back_shares_again(kafka: LocalKafka) -> None:
    topic, group = unique("members"), unique("leaders")
    kafka.create_topic(topic, partitions=4)
    a, b = _Tracked(kafka, group, topic, "a"), _Tracked(kafka, group, topic, "b")
    a.member.start()
    b.member.start()
    try:
        wait_until(lambda: _shared(a, b), 40, what="the partitions shared by a and b")
        a.member.step_aside()
        wait_until(lambda: not a.snapshot() and b.snapshot() == {0, 1, 2, 3}, 20, what="b to own everything")
        # What is asserted is an absence (no partition comes back to a), so it is watched over a window.
        holds_for(lambda: not a.snapshot(), 1.0, what="a, which stepped aside, owning no partition")
        a.member.come_back()
        wait_until(lambda: _shared(a, b), 40, what="the partitions shared again")
    finally:
        a.member.leave()
        b.member.leave()
