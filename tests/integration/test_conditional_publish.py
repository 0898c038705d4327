"""KIP-27 emulated: a batch that does not land where it expected has no effect (W2, W3)."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, Message, Producer

from tests.integration.helpers import payloads, replay_all, writer
from wal import OffsetMismatchError, ShardWriter
from wal.broker import LocalKafka
from wal.record import WriterIdentity, encode

pytestmark = pytest.mark.kafka


def foreign_write(bootstrap: str, topic: str) -> None:
    """An unguarded producer: one raw record, one forged WAL record with a wrong expected offset."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    producer.produce(topic, b"not a wal record", partition=0)
    forged, headers = encode(0, WriterIdentity("intruder"), b"forged")
    producer.produce(topic, forged, partition=0, headers=headers)
    assert producer.flush(10) == 0


def test_foreign_writes_between_batches_abort_the_next_batch(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    first = w.append([b"one", b"two", b"three"])
    assert first.offsets == (0, 1, 2) and first.upcoming_offset == 4

    foreign_write(kafka.bootstrap_servers, topic)  # lands at 4 and 5

    with pytest.raises(OffsetMismatchError) as info:
        w.append([b"four", b"five"])
    assert (info.value.expected, info.value.actual) == (4, 6)
    assert w.upcoming_offset is None  # W2: unknown after any abort
    assert w.stats.offset_mismatches == 1

    records, replayer = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records) == [b"one", b"two", b"three"]  # nothing of the aborted batch
    assert replayer.stats.rejected_malformed == 1  # the raw record
    assert replayer.stats.rejected_mismatch == 1  # the forged one: no effect

    again = w.append([b"four", b"five"])  # re-reads the end offset, then lands where expected
    assert again.offsets[0] > 6
    records, _ = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records) == [b"one", b"two", b"three", b"four", b"five"]
    w.close()


def test_explicit_expected_offset_that_is_wrong_has_no_effect(kafka: LocalKafka, topic: str) -> None:
    w = writer(kafka.bootstrap_servers, topic)
    upcoming = w.fence()
    assert upcoming == 0
    with pytest.raises(OffsetMismatchError):
        w.append([b"stale leader's idea"], expected_offset=upcoming + 7)
    settled = w.settled_end_offset()
    assert settled == 2  # the aborted record and its marker
    ok = w.append([b"right"], expected_offset=settled)
    records, _ = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records) == [b"right"]
    assert records[0].offset == ok.offsets[0]
    w.close()


class _SwappingWriter(ShardWriter):
    """Files record 0's delivery report under record 1 and the other way round: the same set of
    offsets, each in the wrong slot. A check of sorted offsets would pass it; W2 must not."""

    def _on_delivery(self, reports: list[tuple[KafkaError | None, int] | None], index: int,
                     err: KafkaError | None, msg: Message) -> None:
        swapped = {0: 1, 1: 0}.get(index, index) if len(reports) > 1 else index
        super()._on_delivery(reports, swapped, err, msg)


def test_delivery_reports_checked_record_by_record(kafka: LocalKafka, topic: str) -> None:
    base = writer(kafka.bootstrap_servers, topic)
    w = _SwappingWriter(base.config)
    assert w.fence() == 0
    with pytest.raises(OffsetMismatchError) as info:
        w.append([b"a", b"b", b"c"])
    assert (info.value.expected, info.value.actual) == (0, 1)
    records, _ = replay_all(kafka.bootstrap_servers, topic)
    assert records == []  # the batch was aborted, not committed with records in the wrong slots
    single = w.append([b"alone"])  # one record: nothing to swap, it commits
    records, _ = replay_all(kafka.bootstrap_servers, topic)
    assert payloads(records) == [b"alone"] and records[0].offset == single.offsets[0]
    w.close()
