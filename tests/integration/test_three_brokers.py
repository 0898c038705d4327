"""The three-broker variant (RF 3, min.insync.replicas 2): the guard survives losing a broker, and a
topic just created is waited for. A store cluster on three brokers under broker kills, pauses and
partitions is the robustness campaign's (tests/robustness, docs/robustness.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from confluent_kafka.admin import AdminClient

from tests.conftest import unique
from tests.integration.helpers import payloads, replay_all, writer
from tests.waiting import wait_until
from wal import WalError
from wal.broker import QUICK_JVM_FLAGS, LocalKafka
from wal.topic import ensure_side_topic, ensure_wal_topic, placement_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """One three-broker cluster for the module (it takes a while to start); each test brings
    back the broker it killed."""
    kafka = LocalKafka(tmp_path_factory.mktemp("kafka3"), nodes=3, heap_mb=384, jvm_flags=QUICK_JVM_FLAGS)
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


def test_a_topic_just_created_is_waited_for_not_taken_for_missing(cluster: LocalKafka) -> None:
    """Found by the robustness campaign (docs/robustness.md): a node that had just created the WAL
    topic exited at once, because the broker it asked next had not heard of the topic yet and the
    placement log is created next to the WAL's. Now a topic just created is waited for (bounded)."""
    for i in range(6):
        topic = unique("wal-fresh")
        assert ensure_wal_topic(cluster.node_bootstrap(i % 3), topic, partitions=3)
        # Straight away, through another broker: its metadata may still lag the controller's.
        assert ensure_side_topic(cluster.node_bootstrap((i + 1) % 3), topic, placement_topic(topic), "placement",
                                 compacted=False)
        assert not ensure_wal_topic(cluster.node_bootstrap((i + 2) % 3), topic, partitions=3)  # found, as made


def test_a_broker_is_serving_only_once_it_answers_itself(cluster: LocalKafka) -> None:
    """The robustness campaign takes its next broker down only once every broker serves again
    (`serving`): the others' metadata lists a killed broker until its session times out."""
    assert all(cluster.serving(n) for n in range(3))
    cluster.kill_node(2)
    assert not cluster.serving(2)
    cluster.start_node(2, wait=True)
    wait_until(lambda: cluster.serving(2), 60, interval_s=0.5, what="broker 3 serving again")


def test_a_restarted_broker_is_in_sync_only_once_it_rejoined_every_isr(cluster: LocalKafka) -> None:
    """The campaign's lane 0 waits for `in_sync`, not only `serving`: the fifth long run killed a
    broker while another, answering requests, was still fenced, and partitions had no leader for
    five minutes. Killed, a broker drops out of the ISRs (the others' view says so); restarted,
    the cluster is in sync again only once every partition has all its replicas in sync."""
    topic = unique("wal-isr")
    cluster.create_topic(topic, partitions=2)
    wait_until(cluster.in_sync, 60, interval_s=0.5, what="every partition in sync before the kill")
    assert cluster.under_replicated() == []
    cluster.kill_node(2)
    assert not cluster.in_sync()
    # Fenced once its 3 s session ends, then removed from every ISR, in the others' view.
    wait_until(lambda: {f"{topic}-0", f"{topic}-1"} <= set(cluster.under_replicated() or []), 60,
               interval_s=0.5, what=f"{topic}'s partitions under-replicated without broker 3")
    cluster.start_node(2, wait=True)
    wait_until(cluster.in_sync, 120, interval_s=0.5, what="every partition in sync after the restart")
    assert cluster.startup_over(2)  # "Kafka Server started" in its log, since this start
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers})
    for partition in admin.list_topics(topic, timeout=10).topics[topic].partitions.values():
        assert sorted(partition.isrs) == sorted(partition.replicas) == [1, 2, 3], partition
