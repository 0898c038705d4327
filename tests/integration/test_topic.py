"""The WAL topic (wal/topic.py): created to keep every record, checked when it exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from tests.conftest import unique
from tests.integration.store_process import REPO
from wal import TopicMismatchError, ensure_wal_topic
from wal.broker import LocalKafka, free_port


def _configs(bootstrap: str, topic: str) -> dict[str, str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    (future,) = admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)]).values()
    return {name: entry.value for name, entry in future.result(10).items()}


def _partitions(bootstrap: str, topic: str) -> int:
    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    return len(meta.topics[topic].partitions)


def test_a_new_wal_topic_keeps_every_record_and_a_second_call_only_checks(kafka: LocalKafka) -> None:
    topic = unique("wal-topic")
    assert ensure_wal_topic(kafka.bootstrap_servers, topic, 3) is True
    assert ensure_wal_topic(kafka.bootstrap_servers, topic, 3) is False
    configs = _configs(kafka.bootstrap_servers, topic)
    assert configs["retention.ms"] == "-1"
    assert configs["retention.bytes"] == "-1"
    assert configs["cleanup.policy"] == "delete"
    assert configs["unclean.leader.election.enable"] == "false"
    assert configs["min.insync.replicas"] == "1"  # one broker here
    assert _partitions(kafka.bootstrap_servers, topic) == 3


def test_an_existing_topic_with_finite_retention_is_made_to_keep_everything(kafka: LocalKafka) -> None:
    topic = unique("wal-topic")
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    (future,) = admin.create_topics([NewTopic(topic, 2, replication_factor=1,
                                              config={"retention.ms": "3600000"})]).values()
    future.result(30)
    assert ensure_wal_topic(kafka.bootstrap_servers, topic, 2) is False
    configs = _configs(kafka.bootstrap_servers, topic)
    assert configs["retention.ms"] == "-1"
    assert configs["retention.bytes"] == "-1"


def test_a_wrong_partition_count_is_refused_and_the_topic_left_alone(kafka: LocalKafka) -> None:
    topic = unique("wal-topic")
    ensure_wal_topic(kafka.bootstrap_servers, topic, 2)
    with pytest.raises(TopicMismatchError, match="has 2 partitions but the cluster has 4 shards"):
        ensure_wal_topic(kafka.bootstrap_servers, topic, 4)
    assert _partitions(kafka.bootstrap_servers, topic) == 2


def test_serve_exits_with_a_clear_message_when_the_shard_count_changed(kafka: LocalKafka, tmp_path: Path) -> None:
    cluster = unique("c")
    ensure_wal_topic(kafka.bootstrap_servers, f"{cluster}.wal", 2)
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.server", "--kafka", kafka.bootstrap_servers, "--data-dir",
         str(tmp_path / "data"), "--listen", f"127.0.0.1:{free_port()}", "--cluster", cluster, "--shards", "4",
         "--node-id", "n1"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "has 2 partitions but the cluster has 4 shards" in done.stderr
    assert "Traceback" not in done.stderr
