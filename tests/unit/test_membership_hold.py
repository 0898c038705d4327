"""The pure decisions behind holding a loss librdkafka declares on its own (issue 18).

`generation_of` reads the generation out of librdkafka's serialized consumer group metadata (a
real consumer's bytes are checked in tests/integration/test_membership_stall.py); `settle` is
the verdict on held partitions once the group assigned again.
"""

from __future__ import annotations

import struct

import pytest

from wal.membership import CGMD_MAGIC, Hold, Settled, generation_of, group_config, rebalance_timeout_ms, settle


def metadata(generation: int, group: str = "g", member: str = "m-1", instance: str | None = "n1") -> bytes:
    """Bytes laid out as rd_kafka_consumer_group_metadata_write lays them out."""
    tail = b"\0" + instance.encode() + b"\0" if instance is not None else b"\1"
    return CGMD_MAGIC + struct.pack("=i", generation) + group.encode() + b"\0" + member.encode() + b"\0" + tail


@pytest.mark.parametrize(("raw", "group", "expected"), [
    (metadata(7), "g", 7),
    (metadata(1, instance=None), "g", 1),
    (metadata(0), "g", 0),
    (metadata(2**31 - 1, group="peer.leaders"), "peer.leaders", 2**31 - 1),
    (metadata(-1), "g", None),  # not joined yet
    (metadata(7), "other", None),  # another group's metadata: never trusted
    (metadata(7, group="gg"), "g", None),
    (b"CGMDv3:" + metadata(7)[len(CGMD_MAGIC):], "g", None),  # a format we do not know
    (metadata(7)[:len(CGMD_MAGIC) + 4], "g", None),  # truncated before the group id
    (CGMD_MAGIC + struct.pack("=i", 7) + b"g", "g", None),  # group id not terminated
    (b"", "g", None),
])
def test_generation_of_reads_only_what_it_recognizes(raw: bytes, group: str, expected: int | None) -> None:
    assert generation_of(raw, group) == expected


ALL = frozenset({0, 1, 2, 3})


@pytest.mark.parametrize(("held", "assigned", "generation", "expected"), [
    # The coordinator never removed the member: back in the same generation, led throughout.
    (ALL, ALL, 5, Settled(kept=ALL, regained=frozenset(), released=frozenset())),
    # The coordinator removed it and the rejoin got everything again: a gain again, writers checked.
    (ALL, ALL, 7, Settled(kept=frozenset(), regained=ALL, released=frozenset())),
    # Someone else kept some of them after a rebalance: those are lost after all.
    (ALL, frozenset({1, 3}), 7, Settled(kept=frozenset(), regained=frozenset({1, 3}),
                                        released=frozenset({0, 2}))),
    (ALL, frozenset(), 7, Settled(kept=frozenset(), regained=frozenset(), released=ALL)),
    # Same generation cannot change an assignment, but a partial answer is still judged per partition.
    (ALL, frozenset({0}), 5, Settled(kept=frozenset({0}), regained=frozenset(), released=frozenset({1, 2, 3}))),
    # A generation we could not read is never taken for the same one.
    (ALL, ALL, None, Settled(kept=frozenset(), regained=ALL, released=frozenset())),
    # Partitions newly assigned are plain gains: no part of the verdict.
    (frozenset({0, 1}), ALL, 5, Settled(kept=frozenset({0, 1}), regained=frozenset(), released=frozenset())),
])
def test_settle(held: frozenset[int], assigned: frozenset[int], generation: int | None, expected: Settled) -> None:
    verdict = settle(Hold(held, 5, deadline=0.0), assigned, generation)
    assert verdict == expected
    assert verdict.kept | verdict.regained | verdict.released == held  # every held partition judged once
    assert not (verdict.kept & verdict.regained or verdict.kept & verdict.released
                or verdict.regained & verdict.released)


@pytest.mark.parametrize(("session_ms", "expected_ms"), [(1_500, 30_000), (6_000, 30_000), (45_000, 45_000)])
def test_a_hold_lasts_one_rebalance_timeout(session_ms: int, expected_ms: int) -> None:
    """The hold's bound is the rebalance timeout the member sends with its join (librdkafka uses
    max.poll.interval.ms for it): once the coordinator answers, a rebalance ends within it."""
    assert rebalance_timeout_ms(session_ms) == expected_ms
    assert group_config("b:9092", "g", "n1", "h:1", session_ms)["max.poll.interval.ms"] == expected_ms
