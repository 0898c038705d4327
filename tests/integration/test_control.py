"""The WAL's control topic (`wal.control`) on a real broker: a write creates a compacted topic next
to the WAL, a reader sees the last value per key and tombstones, another reader started later sees
the same, and records it cannot use are counted and skipped, never a failure."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from tests.conftest import unique
from tests.waiting import wait_until
from wal import control
from wal.broker import LocalKafka
from wal.errors import UnavailableError
from wal.topic import control_topic

pytestmark = pytest.mark.kafka


def read_until(log: control.ControlLog, expected: dict[str, bytes]) -> None:
    def there() -> bool:
        log.poll(0.2)
        return dict(log.entries) == expected

    wait_until(there, 30, interval_s=0.05, what=f"control entries {expected}")


def test_the_last_value_per_key_wins_and_a_tombstone_removes(kafka: LocalKafka) -> None:
    wal = unique("cwal")
    kafka.create_topic(wal, partitions=2)
    log = control.ControlLog(kafka.bootstrap_servers, wal)
    try:
        assert not log.poll(0.2) and log.entries == {}  # no topic yet: empty
        first = control.write(kafka.bootstrap_servers, wal, "placement/drain/n1", b"1")
        control.write(kafka.bootstrap_servers, wal, "placement/pin/3", b'["n2"]')
        control.write(kafka.bootstrap_servers, wal, "placement/pin/3", b'["n4"]')
        read_until(log, {"placement/drain/n1": b"1", "placement/pin/3": b'["n4"]'})
        assert log.position >= first + 3
        wait_until(lambda: log.poll(0.2) or log.reached_end, 30, interval_s=0.05, what="the end of the topic")
        control.write(kafka.bootstrap_servers, wal, "placement/drain/n1", None)
        read_until(log, {"placement/pin/3": b'["n4"]'})
        later = control.ControlLog(kafka.bootstrap_servers, wal)  # a node started afterwards
        try:
            read_until(later, {"placement/pin/3": b'["n4"]'})
        finally:
            later.close()
    finally:
        log.close()
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    resource = ConfigResource(ResourceType.TOPIC, control_topic(wal))
    configs = admin.describe_configs([resource])[resource].result(10)
    assert configs["cleanup.policy"].value == "compact"
    assert not control.ensure_control_topic(kafka.bootstrap_servers, wal)  # exists: left as it is


def test_records_it_cannot_use_are_counted_and_skipped(kafka: LocalKafka) -> None:
    wal = unique("cwal")
    kafka.create_topic(wal, partitions=1)
    control.write(kafka.bootstrap_servers, wal, "good", b"v")
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    reports: list[KafkaError | None] = []

    def produce(key: bytes, value: bytes) -> None:
        producer.produce(control_topic(wal), value, key=key, partition=0,
                         on_delivery=lambda err, _msg: reports.append(err))
        assert producer.flush(10) == 0

    produce(b"\xff\xfe", b"not UTF-8 key")
    produce(b"k" * (control.MAX_KEY_BYTES + 1), b"key too long")
    produce(b"big", b"x" * (control.MAX_VALUE_BYTES + 1))
    produce(b"after", b"ok")
    assert reports == [None] * 4
    log = control.ControlLog(kafka.bootstrap_servers, wal)
    try:
        read_until(log, {"good": b"v", "after": b"ok"})
        assert log.malformed == 3
    finally:
        log.close()


def test_bounds_and_an_unreachable_broker_are_clear_errors(kafka: LocalKafka) -> None:
    wal = unique("cwal")
    kafka.create_topic(wal, partitions=1)
    with pytest.raises(ValueError, match="control key"):
        control.write(kafka.bootstrap_servers, wal, "", b"v")
    with pytest.raises(ValueError, match="MAX_VALUE_BYTES"):
        control.write(kafka.bootstrap_servers, wal, "k", b"x" * (control.MAX_VALUE_BYTES + 1))
    with pytest.raises(UnavailableError):
        control.write("127.0.0.1:1", wal, "k", b"v", timeout_s=1)
