"""Replay reaches the end even when the partition ends in markers, resumes, and tails; a position
outside the log raises OffsetOutOfRangeError instead of jumping (auto.offset.reset=error)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from tests.integration.helpers import payloads, writer
from tests.waiting import wait_until
from wal import OffsetMismatchError, OffsetOutOfRangeError, Replayer
from wal.broker import LocalKafka
from wal.record import WriterIdentity, encode

pytestmark = pytest.mark.kafka


def test_replay_reaches_end_of_partition_ending_in_commit_marker(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"a", b"b"])
    last = w.append([b"c"])
    with Replayer(kafka.bootstrap_servers, topic, 0, 0) as r:
        # The commit marker is written after commit_transaction returned (docs/design.md §5): the high
        # watermark reaches the upcoming offset a moment later, not necessarily at once.
        wait_until(lambda: r.end_offset() == last.upcoming_offset, 10, what="the commit marker in the high watermark")
        assert payloads(list(r.read_to_end(10))) == [b"a", b"b", b"c"]
        assert r.position == last.upcoming_offset  # past the final commit marker
    w.close()


def test_replay_reaches_end_of_partition_ending_in_abort_marker(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"a"])
    with pytest.raises(OffsetMismatchError):
        w.append([b"aborted-1", b"aborted-2"], expected_offset=99)
    end = 2 + 2 + 1  # "a", its marker, two aborted records, the abort marker
    wait_until(lambda: w.end_offset() == end, 10, what="the abort marker in the high watermark")
    with Replayer(kafka.bootstrap_servers, topic, 0, 0) as r:
        assert payloads(list(r.read_to_end(10))) == [b"a"]
        assert r.position == end
    w.close()


def test_replay_resumes_from_an_offset_and_tails(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"one"])
    second = w.append([b"two", b"three"])
    with Replayer(kafka.bootstrap_servers, topic, 0, second.offsets[0]) as r:
        assert payloads(list(r.read_to_end(10))) == [b"two", b"three"]
        checkpoint = r.position
        w.append([b"four"])
        tailed = r.poll(5.0)
        assert payloads(tailed) == [b"four"]
        r.seek(second.offsets[1])
        assert payloads(list(r.read_to_end(10))) == [b"three", b"four"]
        assert r.position > checkpoint
    w.close()


def test_a_tailing_replayer_moves_past_the_commit_marker_with_the_batch(kafka: LocalKafka, topic: str) -> None:
    """A takeover waits for its standby to pass the old leader's last commit marker. The
    position must move past it with the batch, not one empty fetch later (PARTITION_EOF, which
    the broker holds for fetch.wait.max.ms = 500 ms): the polls below add up to 0.15 s."""
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"one"])
    with Replayer(kafka.bootstrap_servers, topic, 0, 0) as r:
        list(r.read_to_end(10))
        batch = w.append([b"two", b"three"])
        end = batch.upcoming_offset
        assert end == batch.offsets[-1] + 2  # the commit marker sits between
        tailed = r.poll(10.0)
        for _ in range(3):
            if r.position >= end:
                break
            tailed += r.poll_once(0.05)
        assert payloads(tailed) == [b"two", b"three"]
        assert r.position == end == r.end_offset()
        # A seek back is not undone by the consumer's (older) position.
        r.seek(0)
        assert payloads(list(r.read_to(end, 10))) == [b"one", b"two", b"three"]
        assert r.position == end
    w.close()


def _delete_records_before(bootstrap: str, topic: str, offset: int) -> None:
    """Truncate partition 0 below `offset`, as retention would: its log start becomes `offset`."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.delete_records([TopicPartition(topic, 0, offset)], request_timeout=10, operation_timeout=10)
    (future,) = futures.values()
    assert future.result(timeout=15).low_watermark == offset


def test_a_replayer_below_the_log_start_raises_instead_of_jumping(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"a0", b"a1"])
    second = w.append([b"b0", b"b1"])
    last = w.append([b"c0", b"c1"])
    end, start = last.upcoming_offset, second.offsets[0]  # 9, 3
    _delete_records_before(kafka.bootstrap_servers, topic, start)
    with Replayer(kafka.bootstrap_servers, topic, 0, 0) as r:
        assert r.log_start() == start
        with pytest.raises(OffsetOutOfRangeError) as info:
            list(r.read_to_end(10))
        assert info.value.below_start
        assert (info.value.position, info.value.log_start, info.value.log_end) == (0, start, end)
        # Not a silent jump: nothing was read, and the replayer stays refused until seek().
        assert r.position == 0 and r.stats.accepted == 0
        with pytest.raises(OffsetOutOfRangeError):
            r.poll_once(0.2)
        # seek() is the way on (a plain librdkafka seek would fail: the partition is stopped).
        r.seek(start)
        assert payloads(list(r.read_to_end(10))) == [b"b0", b"b1", b"c0", b"c1"]
        assert r.position == end
    with Replayer(kafka.bootstrap_servers, topic, 0, start) as r:
        assert payloads(list(r.read_to_end(10))) == [b"b0", b"b1", b"c0", b"c1"]
    w.close()


def test_a_replayer_ahead_of_the_end_raises_and_resumes_after_seek(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    end = w.append([b"a"]).upcoming_offset
    with Replayer(kafka.bootstrap_servers, topic, 0, end + 100) as r:
        with pytest.raises(OffsetOutOfRangeError) as info:  # the first fetch is refused; no waiting
            for _ in range(10):
                assert r.poll_once(0.5) == []
        assert not info.value.below_start
        assert (info.value.position, info.value.log_start, info.value.log_end) == (end + 100, 0, end)
        with pytest.raises(OffsetOutOfRangeError):
            r.poll_once(0.2)  # still refused: no fetching from anywhere else meanwhile
        w.append([b"b"])
        r.seek(end)
        assert payloads(list(r.read_to_end(10))) == [b"b"]
    w.close()


def test_a_position_at_the_log_start_or_the_end_is_in_range(kafka: LocalKafka, topic: str) -> None:
    """The boundaries: a reader at the log start replays, one at the end waits (no error)."""
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"a"])
    end = w.append([b"b"]).upcoming_offset
    _delete_records_before(kafka.bootstrap_servers, topic, end)
    with Replayer(kafka.bootstrap_servers, topic, 0, end) as r:
        assert r.log_start() == end == r.end_offset()
        assert r.poll_once(0.5) == [] and r.position == end
        w.append([b"c"])
        assert payloads(list(r.read_to_end(10))) == [b"c"]
    w.close()


def test_a_seek_before_any_poll_saw_the_refusal_is_not_refused_again(kafka: LocalKafka, topic: str) -> None:
    """librdkafka queues the refusal, then stops the partition; a seek() in between is refused
    (_STATE) and re-assigns, and the queued refusal must not then refuse the new position."""
    w = writer(kafka.bootstrap_servers, topic)
    end = w.append([b"a"]).upcoming_offset
    with Replayer(kafka.bootstrap_servers, topic, 0, end + 100) as r:
        # Timing is the point here: nothing observes the refusal without polling, and polling would
        # consume it. The first fetch is refused within ~0.3 s; were it later, the seek below would
        # simply come first and the test would pass without the race (weaker, never flaky).
        time.sleep(2.0)
        r.seek(0)
        assert payloads(list(r.read_to_end(10))) == [b"a"]
        assert r.position == end
    w.close()


def test_poll_payloads_accepts_exactly_what_poll_once_accepts(kafka: LocalKafka, topic: str) -> None:
    """The replay path of replicas (`poll_payloads`: pairs, no record objects) against the full one,
    on a partition with guarded batches, aborted records and rogue ones (a raw record, forged
    records at wrong and at right offsets, a record without the header, a tombstone), and more
    records than one consume() step."""
    w = writer(kafka.bootstrap_servers, topic)
    w.append([b"a%d" % i for i in range(700)])  # more than CONSUME_STEP
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "enable.idempotence": True})
    upcoming = w.settled_end_offset()  # 701: 700 records and their commit marker
    forged_wrong, headers_wrong = encode(upcoming + 5, WriterIdentity("intruder"), b"wrong place")
    forged_right, headers_right = encode(upcoming + 2, WriterIdentity("intruder"), b"right place")
    producer.produce(topic, b"not a wal record", partition=0)  # upcoming
    producer.produce(topic, forged_wrong, partition=0, headers=headers_wrong)  # upcoming + 1: mismatch
    producer.produce(topic, forged_right, partition=0, headers=headers_right)  # upcoming + 2: accepted (W3)
    producer.produce(topic, forged_right, partition=0)  # no header: malformed
    producer.produce(topic, None, partition=0, headers=headers_right)  # a tombstone: malformed
    assert producer.flush(10) == 0
    with pytest.raises(OffsetMismatchError):
        w.append([b"aborted"])
    w.append([b"b%d" % i for i in range(10)], expected_offset=w.settled_end_offset())
    end = w.settled_end_offset()
    with Replayer(kafka.bootstrap_servers, topic, 0, 0) as full, \
            Replayer(kafka.bootstrap_servers, topic, 0, 0) as pairs:
        expected = [(r.offset, r.payload) for r in full.read_to(end, 10)]
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + 10
        while pairs.position < end and time.monotonic() < deadline:
            got += pairs.poll_payloads(0.5)
        assert got == expected
        assert [p for _, p in got] == [b"a%d" % i for i in range(700)] + [b"right place"] + [
            b"b%d" % i for i in range(10)]
        assert (pairs.position, pairs.stats) == (full.position, full.stats)
        assert (pairs.stats.rejected_mismatch, pairs.stats.rejected_malformed) == (1, 3)
    w.close()
