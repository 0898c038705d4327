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


# ---- the shell: a consumer that dies under the member -------------------------------------------------

class ScriptedConsumer:
    """One librdkafka consumer's life, scripted: on its first poll the group assigns `assign`
    in `generation`; with `fatal`, the next poll reports a fatal error (through error_cb, as
    librdkafka does: e.g. FENCED_INSTANCE_ID after its own session timeout)."""

    scripts: list[tuple[frozenset[int], int, bool]] = []
    made = 0

    def __init__(self, config: dict[str, object]) -> None:
        self.config = config
        self.assign, self.generation, self.fatal = ScriptedConsumer.scripts.pop(0)
        ScriptedConsumer.made += 1
        self.polls = 0
        self.on_assign: object = None
        self.on_revoke: object = None

    def subscribe(self, topics: list[str], on_assign: object, on_revoke: object, on_lost: object) -> None:
        self.on_assign, self.on_revoke = on_assign, on_revoke

    def poll(self, timeout: float) -> None:
        from confluent_kafka import KafkaError

        self.polls += 1
        if self.polls == 1:
            from confluent_kafka import TopicPartition

            self.on_assign(self, [TopicPartition("t", p) for p in sorted(self.assign)])  # type: ignore[operator]
        elif self.polls == 2 and self.fatal:
            error_cb = self.config["error_cb"]
            error_cb(KafkaError(KafkaError.FENCED_INSTANCE_ID, "fenced by a consumer with the same instance id",  # type: ignore[operator]
                                fatal=True))
        else:
            import time

            time.sleep(min(timeout, 0.01))

    def assignment(self) -> list[object]:
        return []

    def incremental_assign(self, partitions: list[object]) -> None:
        pass

    def incremental_unassign(self, partitions: list[object]) -> None:
        pass

    def pause(self, partitions: list[object]) -> None:
        pass

    def consumer_group_metadata(self) -> bytes:
        return metadata(self.generation, group="g")

    def unsubscribe(self) -> None:  # a leave: the revocation callback runs (in librdkafka: in the next poll)
        from confluent_kafka import TopicPartition

        self.on_revoke(self, [TopicPartition("t", p) for p in sorted(self.assign)])  # type: ignore[operator]

    def memberid(self) -> str:
        return ""

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("after", "told"), [
    # The new consumer gets the same partitions in the same generation: nobody hears of anything.
    ((ALL, 5), []),
    # A new generation: told as a gain again (the owner probes its writers), never as a loss.
    ((ALL, 6), [("assigned", [0, 1, 2, 3])]),
    # Some went elsewhere: those are lost after all, the rest told again.
    ((frozenset({0, 1}), 6), [("lost", [2, 3]), ("assigned", [0, 1])]),
])
def test_a_consumer_that_dies_under_the_member_is_held_until_the_next_one_is_assigned(
        monkeypatch: pytest.MonkeyPatch, after: tuple[frozenset[int], int], told: list[tuple[str, list[int]]]) -> None:
    """Issue 18: after a broker stall librdkafka's rejoin can race its own registration and die
    (FENCED_INSTANCE_ID, fatal). The member starts a new consumer; what the old one owned is held
    through it, as a loss librdkafka declares by itself is, and settled by the new assignment."""
    import threading

    from tests.waiting import wait_until
    from wal import membership

    ScriptedConsumer.scripts = [(ALL, 5, True), (after[0], after[1], False)]
    ScriptedConsumer.made = 0
    monkeypatch.setattr(membership, "Consumer", ScriptedConsumer)
    events: list[tuple[str, list[int]]] = []
    lock = threading.Lock()

    def record(what: str, partitions: list[int]) -> None:
        with lock:
            events.append((what, list(partitions)))

    member = membership.GroupMember(bootstrap_servers="unused:9092", group="g", topic="t", member_id="n1",
                                    address="n1:1", session_timeout_ms=1_500,
                                    on_assigned=lambda p: record("assigned", p),
                                    on_revoked=lambda p, lost: record("lost" if lost else "revoked", p))
    monkeypatch.setattr(member, "_stop", threading.Event())
    member.start()
    try:
        wait_until(lambda: ScriptedConsumer.made == 2 and member.generation == after[1] and not member._hold, 10,
                   what="the second consumer's assignment settled")
        with lock:
            assert events[0] == ("assigned", [0, 1, 2, 3])
            assert events[1:] == told
        assert member.owned == after[0]
    finally:
        member._stop.set()
        member._thread.join(10)
        assert not member._thread.is_alive(), "the member thread did not stop"


def test_a_fenced_static_member_is_fatal_whatever_fatal_says() -> None:
    from confluent_kafka import KafkaError

    from wal.membership import is_fatal

    # confluent-kafka-python issue #869: the code is _FATAL, `fatal()` is False.
    assert is_fatal(KafkaError(KafkaError._FATAL, "Fatal error: Broker: Static consumer fenced"))
    assert is_fatal(KafkaError(KafkaError.FENCED_INSTANCE_ID, "fenced", fatal=True))
    assert not is_fatal(KafkaError(KafkaError._TRANSPORT, "broker down"))


def test_a_member_the_coordinator_stops_listing_rejoins(monkeypatch: pytest.MonkeyPatch) -> None:
    import wal.membership as membership

    now = [100.0]
    monkeypatch.setattr(membership.time, "monotonic", lambda: now[0])
    member = membership.GroupMember(bootstrap_servers="127.0.0.1:1", group="g", topic="t", member_id="n1",
                                    address="a:1", session_timeout_ms=1500, on_assigned=lambda _: None,
                                    on_revoked=lambda _p, _l: None)
    assert member.missing_limit_s == membership.MISSING_LIMIT_S
    member.listed(False)
    now[0] += member.missing_limit_s
    member.listed(False)
    assert not member._rejoin.is_set()  # at the limit: not yet
    member.listed(True)  # listed again: the count starts over
    member.listed(False)
    now[0] += member.missing_limit_s + 0.1
    member.listed(False)
    assert member._rejoin.is_set()
    member._rejoin.clear()
    member.step_aside()  # out on purpose: not missing
    member.listed(False)
    now[0] += 60
    member.listed(False)
    assert not member._rejoin.is_set()


def test_describe_waits_its_own_bound_and_never_lets_librdkafka_time_the_request_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """librdkafka's timeout of a coordinator request that is still waiting frees its state under
    it; the coordinator's return then aborts the process (issues 4605 and 3663 upstream, the -6
    exits of issue 22's campaign). `describe` asks for a timeout far past its own wait, waits its own
    bound, and destroys a client whose request did not answer: shutdown ends the request safely."""
    import concurrent.futures

    import wal.membership as membership

    made: list[FakeAdmin] = []

    class FakeAdmin:
        def __init__(self, config: dict[str, object]) -> None:
            self.timeouts: list[float] = []
            self.answer: concurrent.futures.Future[object] = concurrent.futures.Future()
            made.append(self)

        def describe_consumer_groups(self, groups: list[str], request_timeout: float) -> dict[str, object]:
            self.timeouts.append(request_timeout)
            return {groups[0]: self.answer}

    monkeypatch.setattr(membership, "AdminClient", FakeAdmin)
    member = membership.GroupMember(bootstrap_servers="127.0.0.1:1", group="g", topic="t", member_id="n1",
                                    address="a:1", session_timeout_ms=1500, on_assigned=lambda _: None,
                                    on_revoked=lambda _p, _l: None)
    with pytest.raises(TimeoutError):
        member.describe(0.05)  # the coordinator never answers
    assert made[0].timeouts == [membership.DESCRIBE_REQUEST_TIMEOUT_S] and member._admin is None  # destroyed

    class Description:
        members: list[object] = []

    def answered(config: dict[str, object]) -> FakeAdmin:
        admin = FakeAdmin(config)
        admin.answer.set_result(Description())
        return admin

    monkeypatch.setattr(membership, "AdminClient", answered)
    assert member.describe(0.05) == []
    assert member.describe(0.05) == [] and len(made) == 2  # an answering client is kept
    with pytest.raises(AssertionError, match="describe bound"):
        member.describe(membership.DESCRIBE_REQUEST_TIMEOUT_S)
