"""`wal.Replayer` and librdkafka's out-of-range refusal (auto.offset.reset=error), without Kafka.

The consumer is a fake that replays scripted `consume()` batches the way librdkafka delivers
them (observed against a real broker, see tests/integration/test_replay.py): one error event
_AUTO_OFFSET_RESET carrying the refused offset, then nothing more for the partition, and a
plain seek() refused with _STATE until the partition is assigned anew.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from wal import clients, record, replayer
from wal.errors import OffsetOutOfRangeError, UnavailableError
from wal.record import WriterIdentity


class FakeMessage:
    def __init__(self, offset: int, value: bytes | None = None, headers: Any = None,
                 error: KafkaError | None = None) -> None:
        self._offset, self._value, self._headers, self._error = offset, value, headers, error

    def error(self) -> KafkaError | None:
        return self._error

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> Any:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return (1, 1000)


def accepted_at(offset: int, payload: bytes) -> FakeMessage:
    value, headers = record.encode(offset, WriterIdentity("w", 1), payload)
    return FakeMessage(offset, value, headers)


def refusal(offset: int) -> FakeMessage:
    return FakeMessage(offset, error=KafkaError(
        KafkaError._AUTO_OFFSET_RESET,
        "fetch failed due to requested offset not available on the broker: Broker: Offset out of range (broker 1)"))


class FakeConsumer:
    """Scripted consume() batches; stopped after a refusal, like librdkafka's fetch state NONE."""

    def __init__(self, config: dict[str, Any]) -> None:
        assert config["auto.offset.reset"] == "error"
        self.batches: list[list[FakeMessage]] = []
        self.stopped = False
        self.assigned: list[int] = []
        self.seeks: list[int] = []

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned.append(partitions[0].offset)
        self.stopped = False

    def seek(self, partition: TopicPartition) -> None:
        if self.stopped:
            raise KafkaException(KafkaError(KafkaError._STATE, "Failed to seek: Local: Erroneous state"))
        self.seeks.append(partition.offset)

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        if not self.batches:
            return []
        batch = self.batches.pop(0)
        if any(m.error() is not None and m.error().code() == KafkaError._AUTO_OFFSET_RESET  # type: ignore[union-attr]
               for m in batch):
            self.stopped = True
        return batch

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(partitions[0].topic, partitions[0].partition, -1001)]

    def close(self) -> None:
        pass


class FakeEnds:
    def __init__(self, log_start: int, log_end: int) -> None:
        self.start, self.end, self.fail = log_start, log_end, False

    def log_start(self, topic: str, partition: int) -> int:
        if self.fail:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "list_offsets", retriable=True))
        return self.start

    def high_watermark(self, topic: str, partition: int) -> int:
        return self.end

    def close(self) -> None:
        pass


def make(monkeypatch: pytest.MonkeyPatch, start: int, log_start: int, log_end: int
         ) -> tuple[replayer.Replayer, FakeConsumer, FakeEnds]:
    monkeypatch.setattr(replayer, "Consumer", FakeConsumer)
    r = replayer.Replayer("unused:9092", "t", 0, start)
    ends = FakeEnds(log_start, log_end)
    r._ends = ends  # type: ignore[assignment]
    consumer = r._consumer
    assert isinstance(consumer, FakeConsumer)
    return r, consumer, ends


def test_consumers_are_configured_to_error_out_of_range() -> None:
    assert clients.consumer_config("b:9092", "read_committed")["auto.offset.reset"] == "error"


def test_below_the_log_start_raises_and_keeps_raising_until_seek(monkeypatch: pytest.MonkeyPatch) -> None:
    r, consumer, _ = make(monkeypatch, start=0, log_start=3, log_end=9)
    consumer.batches = [[refusal(0)]]
    with pytest.raises(OffsetOutOfRangeError) as info:
        r.poll_once(0.1)
    assert info.value.below_start
    assert (info.value.position, info.value.log_start, info.value.log_end) == (0, 3, 9)
    assert "refused offset 0" in str(info.value)
    consumer.batches = [[accepted_at(5, b"must not be read")]]  # never consumed while refused
    with pytest.raises(OffsetOutOfRangeError):
        r.poll_once(0.1)
    assert consumer.batches and r.position == 0 and r.stats.accepted == 0
    r.seek(3)  # re-assigns: librdkafka would refuse a seek of the stopped partition
    assert consumer.assigned == [0, 3] and consumer.seeks == []
    consumer.batches = [[accepted_at(3, b"x")]]
    assert [a.payload for a in r.poll_once(0.1)] == [b"x"]
    assert r.position == 4


def test_ahead_of_the_end_raises_not_below_start(monkeypatch: pytest.MonkeyPatch) -> None:
    r, consumer, _ = make(monkeypatch, start=102, log_start=0, log_end=2)
    consumer.batches = [[refusal(102)]]
    with pytest.raises(OffsetOutOfRangeError) as info:
        r.poll_once(0.1)
    assert not info.value.below_start
    assert (info.value.position, info.value.log_start, info.value.log_end) == (102, 0, 2)


def test_records_before_the_refusal_are_returned_first(monkeypatch: pytest.MonkeyPatch) -> None:
    r, consumer, _ = make(monkeypatch, start=0, log_start=4, log_end=9)
    consumer.batches = [[accepted_at(0, b"a"), accepted_at(1, b"b"), refusal(2), accepted_at(4, b"never")]]
    assert [a.payload for a in r.poll_once(0.1)] == [b"a", b"b"]
    assert r.position == 2
    with pytest.raises(OffsetOutOfRangeError) as info:
        r.poll_once(0.1)
    assert info.value.position == 2 and info.value.below_start


def test_unreadable_ends_leave_the_replayer_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    r, consumer, ends = make(monkeypatch, start=0, log_start=3, log_end=9)
    ends.fail = True
    consumer.batches = [[refusal(0)]]
    with pytest.raises(UnavailableError):
        r.poll_once(0.1)
    with pytest.raises(UnavailableError):
        r.poll_once(0.1)
    ends.fail = False
    with pytest.raises(OffsetOutOfRangeError):
        r.poll_once(0.1)


def test_seek_refused_before_a_poll_saw_the_refusal_drops_it_and_reassigns(monkeypatch: pytest.MonkeyPatch) -> None:
    r, consumer, _ = make(monkeypatch, start=102, log_start=0, log_end=2)
    consumer.stopped = True  # librdkafka stopped the partition; its refusal is still queued
    consumer.batches = [[refusal(102)]]
    r.seek(0)
    assert consumer.assigned == [102, 0] and not consumer.batches
    consumer.batches = [[accepted_at(0, b"a")]]
    assert [a.payload for a in r.poll_once(0.1)] == [b"a"]


def test_other_seek_errors_are_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    r, consumer, _ = make(monkeypatch, start=0, log_start=0, log_end=2)

    def broken_seek(partition: TopicPartition) -> None:
        raise KafkaException(KafkaError(KafkaError._INVALID_ARG, "bad"))

    monkeypatch.setattr(consumer, "seek", broken_seek)
    with pytest.raises(KafkaException):
        r.seek(1)


# ---- records that cannot be judged (issue 18) --------------------------------------------------------


class PoisonedMessage(FakeMessage):
    """A record whose header key is not UTF-8: confluent-kafka's `headers()` raises SystemError the
    first time and then returns a cached list holding a NULL, which crashes the interpreter when
    touched. Here a second call fails the test instead."""

    def __init__(self, offset: int) -> None:
        super().__init__(offset, b"x", None)
        self.asked = 0

    def headers(self) -> Any:
        self.asked += 1
        assert self.asked == 1, f"offset {self._offset}: headers() asked again after it failed"
        raise SystemError("<method 'headers' of 'cimpl.Message' objects> returned a result with an exception set")


def test_list_extend_keeps_what_it_appended_before_its_iterator_raised() -> None:
    """`Replayer._headers_of` counts on it to find which message failed."""
    def items() -> Any:
        yield 1
        yield 2
        raise SystemError("third")

    out: list[int] = [0]
    with pytest.raises(SystemError):
        out.extend(items())
    assert out == [0, 1, 2]


@pytest.mark.parametrize("poisoned_at", [[0], [1], [2], [0, 2], [0, 1, 2]])
def test_a_record_whose_headers_cannot_be_read_is_malformed_and_asked_once(
        monkeypatch: pytest.MonkeyPatch, poisoned_at: list[int]) -> None:
    r, consumer, _ = make(monkeypatch, 0, 0, 10)
    messages: list[FakeMessage] = [PoisonedMessage(o) if o in poisoned_at else accepted_at(o, b"p%d" % o)
                                   for o in range(3)]
    consumer.batches.append(messages)
    got = r.poll_once(0.1)
    assert [a.offset for a in got] == [o for o in range(3) if o not in poisoned_at]
    assert (r.stats.rejected_malformed, r.stats.unreadable) == (len(poisoned_at), len(poisoned_at))
    assert r.position == 3
    assert all(m.asked == 1 for m in messages if isinstance(m, PoisonedMessage))


def test_a_judgement_that_raises_makes_its_record_malformed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should judging ever raise on some bytes (a bug), the reader judges record by record and
    skips the one that raises, instead of failing at the same checkpoint forever."""
    r, consumer, _ = make(monkeypatch, 0, 0, 10)
    consumer.batches.append([accepted_at(0, b"a"), accepted_at(1, b"b"), accepted_at(2, b"c")])
    real_judge = record.judge

    def judge_batch(*args: Any) -> Any:
        raise RuntimeError("a bug")

    def judge(offset: int, *args: Any) -> Any:
        if offset == 1:
            raise RuntimeError("a bug on this record")
        return real_judge(offset, *args)

    monkeypatch.setattr(record, "judge_batch", judge_batch)
    monkeypatch.setattr(record, "judge", judge)
    got = r.poll_once(0.1)
    assert [(a.offset, a.payload) for a in got] == [(0, b"a"), (2, b"c")]
    assert (r.stats.accepted, r.stats.rejected_malformed, r.stats.unreadable) == (2, 1, 1)
