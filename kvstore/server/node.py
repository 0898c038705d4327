"""A store node: its configuration, the WAL topic, one replica per shard, and its leadership.

Every node holds a replica of every shard. The consumer group (kvstore.server.leadership) tells which
shards this node leads; the other replicas follow as standbys (`standby`), so a takeover
replays only a short tail. The node owns no protocol logic: replicas do (kvstore.server.replica),
the WAL does (wal/).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from pathlib import Path

import wal
from kvstore import limits
from kvstore.core.role import Role
from kvstore.core.sharding import shard_of
from kvstore.server.leadership import Leadership
from kvstore.server.metrics import Metrics
from kvstore.server.replica import ReplicaConfig, ShardReplica

log = logging.getLogger(__name__)

ENDS_REFRESH_S = 1.0
RESIGN_TIMEOUT_S = 15.0  # a batch in flight gets this long to finish when a shard is handed over


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
    # Loopback by default: the endpoint has no authentication. 0.0.0.0 in a container, for a
    # Prometheus on the same network.
    metrics_host: str = "127.0.0.1"
    transaction_timeout_ms: int = 60_000
    replication_factor: int = 0  # 0 = min(3, number of brokers)
    max_pending_writes: int = limits.MAX_PENDING_WRITES_PER_SHARD
    # False: a read replica that never joins the leadership group; it only follows (stale
    # reads, scans, watches) and refuses writes.
    lead: bool = True
    # Follow the shards this node does not lead (standby replicas: short takeovers). False
    # keeps them idle at their checkpoint; a takeover then replays everything since.
    standby: bool = True
    # Consumer-group session timeout: how long a crashed or paused node keeps its shards
    # before the group gives them away (the SIGKILL failover time is about this plus ~0.5 s).
    session_timeout_ms: int = 1500
    group: str = ""  # defaults to "<cluster>.leaders"
    # Where `kvstore snapshot create` writes (a path or URI pyarrow reads). A replica that is
    # empty, was wiped as suspect, or finds its checkpoint below the WAL's log start (truncated)
    # loads the newest usable snapshot from here and replays only the tail. "" = none.
    snapshot_dir: str = ""

    @property
    def wal_topic(self) -> str:
        return self.topic or f"{self.cluster}.wal"

    @property
    def leader_group(self) -> str:
        return self.group or f"{self.cluster}.leaders"

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
        if not 1000 <= self.session_timeout_ms <= 300_000:
            raise ValueError(f"--session-timeout-ms must be within 1000..300000 (and at least the broker's "
                             f"group.min.session.timeout.ms), got {self.session_timeout_ms}")
        if "@" in self.node_id or not self.node_id:
            raise ValueError(f"--node-id must be non-empty and contain no '@', got {self.node_id!r}")
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
                snapshot_dir=self.config.snapshot_dir or None),
                self.metrics)
            self.replicas[shard] = replica
            replica.leader_hint = functools.partial(self.leader_address, shard)
            replica.start(lead=False, standby=self.config.standby or not self.config.lead)
        if self.config.lead:
            self.leadership = Leadership(
                bootstrap_servers=self.config.kafka, group=self.config.leader_group, topic=self.config.wal_topic,
                node_id=self.config.node_id, address=self.address, session_timeout_ms=self.config.session_timeout_ms,
                replicas=self.replicas, resign_timeout_s=RESIGN_TIMEOUT_S, metrics=self.metrics)
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
                             self.config.replication_factor or None)
