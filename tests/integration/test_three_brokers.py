"""The three-broker variant (RF 3, min.insync.replicas 2): the guard survives losing a broker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from tests.integration.helpers import payloads, replay_all, writer
from wal import WalError
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalKafka]:
    kafka = LocalKafka(tmp_path / "kafka3", nodes=3, heap_mb=384)
    kafka.start(timeout_s=120)
    try:
        yield kafka
    finally:
        kafka.stop()


def test_appends_survive_killing_the_partition_leader(cluster: LocalKafka) -> None:
    topic = "wal-rf3"
    cluster.create_topic(topic, partitions=1)
    meta = AdminClient({"bootstrap.servers": cluster.bootstrap_servers}).list_topics(topic, timeout=10)
    partition = meta.topics[topic].partitions[0]
    assert len(partition.replicas) == 3
    w = writer(cluster.bootstrap_servers, topic, call_timeout_s=10.0, retry_limit=6)
    committed: list[bytes] = []
    for i in range(5):
        w.append([f"before-{i}".encode()])
        committed.append(f"before-{i}".encode())

    cluster.kill_node(partition.leader - 1)  # node ids are 1-based

    for i in range(5):
        payload = f"after-{i}".encode()
        for _attempt in range(10):  # bounded: leader election takes a few seconds
            try:
                w.append([payload])
                committed.append(payload)
                break
            except WalError as exc:
                assert exc.retriable, f"non-retriable error after losing one broker: {exc!r}"
        else:
            pytest.fail(f"{payload!r} never committed with two of three brokers up")

    records, _ = replay_all(cluster.bootstrap_servers, topic, timeout_s=60)
    visible = payloads(records)
    assert [p for p in visible if p in committed] == committed
    assert len(visible) == len(set(visible)), "a batch is visible twice"
    w.close()
