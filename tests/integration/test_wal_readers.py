"""The WAL readers registry (`wal.readers`) on a real broker: no topic means no readers, the first
record creates a compacted topic next to the WAL, the last record per reader wins, a tombstone
removes one, malformed records are skipped and reported, and what the broker's log cleaner keeps
after compacting still lists the same readers."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from tests.conftest import unique
from tests.waiting import NotYet, wait_until
from wal import Reader, ReaderRegistry, RegistryError, readers_topic
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka


def wal_topic(kafka: LocalKafka, partitions: int = 2) -> str:
    name = unique("rwal")
    kafka.create_topic(name, partitions=partitions)
    return name


def feed(name: str, *positions: int, at_ms: int = 1) -> Reader:
    return Reader(name, "change-feed", f"/{name}", dict(enumerate(positions)), at_ms)


def topic_configs(kafka: LocalKafka, topic: str) -> dict[str, str]:
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    (future,) = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)]).values()
    return {name: entry.value for name, entry in future.result(30).items()}


def raw_records(kafka: LocalKafka, topic: str) -> list[tuple[int, bytes | None]]:
    """(offset, key) of every record the topic still holds."""
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": unique("raw"),
                         "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    out: list[tuple[int, bytes | None]] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error() is not None:
                break  # end of the partition
            out.append((int(message.offset() or 0), message.key()))
    finally:
        consumer.close()
    return out


def test_no_registry_means_no_readers_and_the_first_record_creates_it(kafka: LocalKafka) -> None:
    topic = wal_topic(kafka)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    with ReaderRegistry(kafka.bootstrap_servers, topic, timeout_s=20) as registry:
        listed = registry.list()
        assert (listed.readers, listed.malformed) == ((), ())
        assert readers_topic(topic) not in admin.list_topics(timeout=10).topics  # listing never creates it

        registry.record(feed("a", 5, 7))
        assert registry.list().readers == (feed("a", 5, 7),)
    meta = admin.list_topics(timeout=10).topics[readers_topic(topic)]
    assert len(meta.partitions) == 1
    configs = topic_configs(kafka, readers_topic(topic))
    assert (configs["cleanup.policy"], configs["retention.ms"], configs["retention.bytes"]) == ("compact", "-1", "-1")
    assert configs["unclean.leader.election.enable"] == "false"


def test_the_last_record_wins_a_tombstone_removes_and_another_registry_sees_the_same(kafka: LocalKafka) -> None:
    topic = wal_topic(kafka)
    with ReaderRegistry(kafka.bootstrap_servers, topic, timeout_s=20) as writer:
        writer.record(feed("a", 5, 7))
        writer.record(feed("b", 1, 1))
        writer.record(feed("a", 9, 8, at_ms=2))
        writer.remove("b")
        writer.record(feed("c", 3))
    # A second client (as `kvstore wal truncate` is) reads what the first wrote.
    with ReaderRegistry(kafka.bootstrap_servers, topic, timeout_s=20) as reader:
        assert reader.list().readers == (feed("a", 9, 8, at_ms=2), feed("c", 3))
        reader.remove("c")
        reader.record(feed("b", 4, 4))
        assert [r.name for r in reader.list().readers] == ["a", "b"]


def test_malformed_records_are_skipped_and_reported_not_a_failure(kafka: LocalKafka) -> None:
    topic = wal_topic(kafka)
    with ReaderRegistry(kafka.bootstrap_servers, topic, timeout_s=20) as registry:
        registry.record(feed("good", 3, 4))
        producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
        reports: list[KafkaError | None] = []

        def produce(key: bytes | None, value: bytes) -> None:
            producer.produce(readers_topic(topic), value, key=key, partition=0,
                             on_delivery=lambda err, _msg: reports.append(err))
            assert producer.flush(10) == 0

        produce(b"garbage", b"not json")
        produce(b"good", feed("other", 1).encode())  # a readable record under another reader's key
        produce(b"half", b'{"format": 1, "name": "half"}')
        assert reports == [None, None, None]
        produce(None, b"{}")  # a compacted topic refuses a record without a key: nothing to skip there
        assert reports[-1] is not None and reports[-1].code() == KafkaError.INVALID_RECORD
        listed = registry.list()
        assert listed.readers == (feed("good", 3, 4),)  # its earlier, readable record stands
        assert [(m.key, m.why.split(":")[0]) for m in listed.malformed] == [
            ("garbage", "not UTF-8 JSON"), ("good", "the record's key 'good' is not its name 'other'"),
            ("half", "positions is not an object")]
        registry.remove("garbage")  # a malformed reader can be deregistered by its key
        assert [m.key for m in registry.list().malformed] == ["good", "half"]


def test_a_registry_that_cannot_be_reached_is_an_error_not_an_empty_list(kafka: LocalKafka) -> None:
    from wal.broker import free_port

    nowhere = f"127.0.0.1:{free_port()}"
    with ReaderRegistry(nowhere, "some.wal", timeout_s=2) as registry:
        with pytest.raises(RegistryError):
            registry.list()
        with pytest.raises(RegistryError):
            registry.record(feed("a", 1))


@pytest.mark.slow
def test_what_compaction_keeps_lists_the_same_readers(kafka: LocalKafka) -> None:
    """The broker's log cleaner really compacts the registry (short segments, a dirty ratio of
    ~0), and the listing after it is the listing before it: the last record per reader, the
    removed one gone."""
    topic = wal_topic(kafka, partitions=1)
    name = readers_topic(topic)
    with ReaderRegistry(kafka.bootstrap_servers, topic, timeout_s=20) as registry:
        registry.record(feed("keep", 0))
        admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
        settings = {"segment.ms": "100", "min.cleanable.dirty.ratio": "0.01", "delete.retention.ms": "100",
                    "min.compaction.lag.ms": "0"}
        alter = ConfigResource(ResourceType.TOPIC, name, incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in settings.items()])
        for future in admin.incremental_alter_configs([alter]).values():
            future.result(30)
        for i in range(1, 30):
            registry.record(feed("keep", i))
            registry.record(feed("gone", i))
        registry.remove("gone")
        before = registry.list()
        assert [(r.name, dict(r.positions)) for r in before.readers] == [("keep", {0: 29})]

        def compacted() -> list[tuple[int, bytes | None]]:
            time.sleep(0.2)
            registry.record(feed("roller", 1))  # a record after segment.ms rolls the segment
            held = raw_records(kafka, name)
            if len([k for _, k in held if k == b"keep"]) != 1:
                raise NotYet(f"{len(held)} records, not compacted yet")
            return held

        wait_until(compacted, 90, interval_s=1, what="the log cleaner to compact the readers topic")
        after = registry.list()
        assert [(r.name, dict(r.positions)) for r in after.readers if r.name != "roller"] == [("keep", {0: 29})]
        assert after.malformed == ()
