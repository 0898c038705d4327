"""A store node: its configuration, the WAL topic, and one replica per shard.

In this version every node leads every shard it is configured to lead (one node per cluster);
leadership through a consumer group comes with the cluster issue. The node owns no protocol
logic: replicas do (kvstore.replica), the WAL does (wal/).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from kvstore import limits
from kvstore.metrics import Metrics
from kvstore.replica import ReplicaConfig, Role, ShardReplica
from kvstore.sharding import shard_of

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    node_id: str = "node-1"
    listen: str = "127.0.0.1:50051"
    advertise: str = ""  # the address clients should use; defaults to `listen`
    data_dir: Path = Path(".data/node-1")
    kafka: str = "127.0.0.1:9092"
    cluster: str = "kvstore"
    shards: int = 4
    topic: str = ""  # defaults to "<cluster>.wal"
    metrics_port: int = 0  # 0 = no metrics endpoint
    transaction_timeout_ms: int = 60_000
    replication_factor: int = 0  # 0 = min(3, number of brokers)
    max_pending_writes: int = limits.MAX_PENDING_WRITES_PER_SHARD
    # False: a read replica that only follows (stale reads, scans, watches); writes are refused.
    lead: bool = True

    @property
    def wal_topic(self) -> str:
        return self.topic or f"{self.cluster}.wal"

    @property
    def address(self) -> str:
        return self.advertise or self.listen

    @staticmethod
    def from_env(**overrides: object) -> NodeConfig:
        """Defaults <- KVSTORE_* environment <- explicit overrides (flags)."""
        env: dict[str, object] = {}
        for field in dataclasses.fields(NodeConfig):
            raw = os.environ.get(f"KVSTORE_{field.name.upper()}")
            if raw is not None:
                env[field.name] = _convert(field.type, raw)
        values = {**env, **{k: v for k, v in overrides.items() if v is not None}}
        config = NodeConfig(**values)  # type: ignore[arg-type]
        config.validate()
        return config

    def validate(self) -> None:
        if self.shards < 1 or self.shards > 1024:
            raise ValueError(f"--shards must be within 1..1024, got {self.shards}")
        if not self.cluster or "." in self.cluster:
            raise ValueError(f"--cluster must be non-empty and contain no dot, got {self.cluster!r}")
        if self.transaction_timeout_ms < 1000:
            raise ValueError("--transaction-timeout-ms must be at least 1000")
        if not 1 <= self.max_pending_writes <= 1_000_000:
            raise ValueError(f"--max-pending-writes must be within 1..1000000, got {self.max_pending_writes}")


def _convert(kind: object, raw: str) -> object:
    if kind in (int, "int"):
        return int(raw)
    if kind in (Path, "Path"):
        return Path(raw)
    if kind in (bool, "bool"):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return raw


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.replicas: dict[int, ShardReplica] = {}

    async def start(self) -> None:
        await asyncio.to_thread(self._ensure_topic)
        for shard in range(self.config.shards):
            replica = ShardReplica(ReplicaConfig(
                cluster=self.config.cluster, topic=self.config.wal_topic, shard=shard,
                bootstrap_servers=self.config.kafka, node_id=self.config.node_id,
                data_dir=self.config.data_dir, transaction_timeout_ms=self.config.transaction_timeout_ms,
                max_pending_writes=self.config.max_pending_writes),
                self.metrics)
            self.replicas[shard] = replica
            replica.start(lead=self.config.lead)

    async def stop(self) -> None:
        await asyncio.gather(*(replica.stop() for replica in self.replicas.values()))

    def shard_for(self, key: bytes) -> int:
        return shard_of(key, self.config.shards)

    def replica(self, shard: int) -> ShardReplica:
        return self.replicas[shard]

    def serving(self) -> bool:
        """Healthy once every shard has bootstrapped (leader) or caught up (follower)."""
        if not self.replicas:
            return False
        if self.config.lead:
            return all(r.role is Role.LEADER for r in self.replicas.values())
        return all(r.caught_up for r in self.replicas.values())

    def leader_address(self, shard: int) -> str:
        return self.config.address if self.replicas[shard].role is Role.LEADER else ""

    def _ensure_topic(self) -> None:
        """Create the WAL topic with one partition per shard, or check that it has that many."""
        admin = AdminClient({"bootstrap.servers": self.config.kafka})
        topic = self.config.wal_topic
        meta = admin.list_topics(timeout=30)
        existing = meta.topics.get(topic)
        if existing is not None and existing.error is None:
            partitions = len(existing.partitions)
            if partitions != self.config.shards:
                raise ValueError(f"WAL topic {topic} has {partitions} partitions but --shards is "
                                 f"{self.config.shards}; the shard count is fixed when the cluster is created")
            return
        rf = self.config.replication_factor or min(3, len(meta.brokers))
        futures = admin.create_topics([NewTopic(topic, self.config.shards, replication_factor=rf)])
        for future in futures.values():
            try:
                future.result(30)
            except KafkaException as exc:
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise
        log.info("created WAL topic %s (%d partitions, rf %d)", topic, self.config.shards, rf)
