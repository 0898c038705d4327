"""The three-broker variant (RF 3, min.insync.replicas 2): the guard survives losing a broker."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from kvstore.dev import demo
from tests.integration.helpers import payloads, replay_all, writer
from tests.integration.test_cluster import SHARDS, Cluster, run_and_verify
from tests.waiting import wait_until
from wal import WalError
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """One three-broker cluster for the module (it takes a while to start); each test brings
    back the broker it killed."""
    kafka = LocalKafka(tmp_path_factory.mktemp("kafka3"), nodes=3, heap_mb=384)
    kafka.start(timeout_s=120)
    try:
        yield kafka
    finally:
        kafka.stop()


def test_appends_survive_killing_the_partition_leader(cluster: LocalKafka) -> None:
    topic = "wal-rf3"
    cluster.create_topic(topic, partitions=1)
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers})
    # Another broker's metadata may still lag the controller's.
    partition = wait_until(lambda: admin.list_topics(topic, timeout=10).topics[topic].partitions.get(0), 30,
                           interval_s=0.1, what=f"partition 0 of {topic} in the metadata")
    assert len(partition.replicas) == 3
    w = writer(cluster.bootstrap_servers, topic, call_timeout_s=10.0, retry_limit=6)
    committed: list[bytes] = []
    for i in range(5):
        w.append([f"before-{i}".encode()])
        committed.append(f"before-{i}".encode())

    victim = partition.leader - 1  # node ids are 1-based
    cluster.kill_node(victim)

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
    cluster.start_node(victim, wait=True)


def test_store_cluster_keeps_writing_when_a_broker_dies(cluster: LocalKafka, tmp_path: Path) -> None:
    """Three store nodes on three brokers (RF 3, min ISR 2): kill the broker that leads the most
    WAL partitions under load; writes go on, nothing acknowledged is lost, replicas converge."""
    nodes = Cluster(cluster.bootstrap_servers, tmp_path / "nodes").start()
    victim: int | None = None
    try:
        workload = demo.Workload(nodes.endpoints, SHARDS).start()
        wait_until(lambda: len(workload.acks) >= 50, 60, what="the workload to be writing (50 acknowledged)")
        meta = AdminClient({"bootstrap.servers": cluster.bootstrap_servers}).list_topics(f"{nodes.name}.wal",
                                                                                         timeout=10)
        leaders = Counter(p.leader for p in meta.topics[f"{nodes.name}.wal"].partitions.values())
        victim = leaders.most_common(1)[0][0] - 1
        cluster.kill_node(victim)
        before = len(workload.acks)
        # Partition leaders move in seconds.
        wait_until(lambda: len(workload.acks) >= before + 50, 60, interval_s=0.5,
                   what=f"50 more acknowledged writes after losing one broker of three (had {before})")
        run_and_verify(nodes, workload)
    finally:
        nodes.stop()
        if victim is not None:
            cluster.start_node(victim, wait=True)
