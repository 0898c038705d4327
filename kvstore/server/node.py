"""A store node: the WAL topic, one replica per shard, and its leadership.

Every node holds a replica of every shard. The consumer group (kvstore.server.leadership) tells which
shards this node leads; the other replicas follow as standbys (`standby`), so a takeover
replays only a short tail. The node owns no protocol logic: replicas do (kvstore.server.replica),
the WAL does (wal/).
"""

from __future__ import annotations

import asyncio
import functools
import logging

import wal
from kvstore.core.role import Role
from kvstore.core.sharding import shard_of
from kvstore.server.config import NodeConfig, ReplicaConfig
from kvstore.server.leadership import Leadership
from kvstore.server.metrics import Metrics
from kvstore.server.replica import ShardReplica

log = logging.getLogger(__name__)

ENDS_REFRESH_S = 1.0
RESIGN_TIMEOUT_S = 15.0  # a batch in flight gets this long to finish when a shard is handed over


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.replicas: dict[int, ShardReplica] = {}
        self.leadership: Leadership | None = None
        self._ends_task: asyncio.Task[None] | None = None
        self.address = config.address

    async def start(self, address: str | None = None) -> None:
        """Start the replicas (all following), then join the leadership group, advertising
        `address` (the bound one when the configured port was 0)."""
        self.address = self.config.advertise or address or self.config.listen
        await asyncio.to_thread(self._ensure_topic)
        for shard in range(self.config.shards):
            replica = ShardReplica(ReplicaConfig(
                cluster=self.config.cluster, topic=self.config.wal_topic, shard=shard,
                bootstrap_servers=self.config.kafka, node_id=self.config.node_id,
                data_dir=self.config.data_dir, transaction_timeout_ms=self.config.transaction_timeout_ms,
                max_pending_writes=self.config.max_pending_writes,
                snapshot_dir=self.config.snapshot_dir or None, kafka_security=self.config.kafka_security),
                self.metrics)
            self.replicas[shard] = replica
            replica.leader_hint = functools.partial(self.leader_address, shard)
            replica.start(lead=False, standby=self.config.standby or not self.config.lead)
        if self.config.lead:
            self.leadership = Leadership(
                bootstrap_servers=self.config.kafka, group=self.config.leader_group, topic=self.config.wal_topic,
                node_id=self.config.node_id, address=self.address, session_timeout_ms=self.config.session_timeout_ms,
                replicas=self.replicas, resign_timeout_s=RESIGN_TIMEOUT_S, metrics=self.metrics,
                security=self.config.kafka_security)
            self.leadership.start()
            for replica in self.replicas.values():
                replica.on_unable_to_lead = self.leadership.set_unable
        self._ends_task = asyncio.create_task(self._refresh_ends(), name="partition-ends")

    async def _refresh_ends(self) -> None:
        """Keep every replica's last known high watermark fresh (for lag, metrics and the shard
        map), one query at a time so a slow broker cannot tie up the worker threads."""
        while True:
            for shard, replica in list(self.replicas.items()):
                try:
                    end = await asyncio.to_thread(replica.ends.high_watermark, self.config.wal_topic, shard)
                except Exception as exc:  # a broker is down or moving: keep the last value
                    log.debug("shard %d: high watermark: %s", shard, exc)
                    continue
                replica.end_offset = max(replica.end_offset, end)
            await asyncio.sleep(ENDS_REFRESH_S)

    async def stop(self) -> None:
        """Hand leadership over first (batches in flight finish, the group reassigns at once),
        then stop the replicas."""
        if self._ends_task is not None:
            self._ends_task.cancel()
        if self.leadership is not None:
            await self.leadership.leave()
        await asyncio.gather(*(replica.stop() for replica in self.replicas.values()))

    def shard_for(self, key: bytes) -> int:
        return shard_of(key, self.config.shards)

    def replica(self, shard: int) -> ShardReplica:
        return self.replicas[shard]

    def serving(self) -> bool:
        """Healthy once every replica caught up and every shard the group gave us leads."""
        if not self.replicas or not all(r.caught_up for r in self.replicas.values()):
            return False
        if self.leadership is None:
            return True
        if not self.leadership.joined:
            return False
        return all(self.replicas[s].role is Role.LEADING for s in self.leadership.assigned if s in self.replicas)

    def leader_address(self, shard: int) -> str:
        """Where shard's leader is, as far as this node knows ("" if nobody right now)."""
        if self.replicas[shard].role is Role.LEADING:
            return self.address
        if self.leadership is None:
            return ""
        owner = self.leadership.owner(shard)
        return owner.address if owner is not None and owner.address != self.address else ""

    def _ensure_topic(self) -> None:
        wal.ensure_wal_topic(self.config.kafka, self.config.wal_topic, self.config.shards,
                             self.config.replication_factor or None, security=self.config.kafka_security)
