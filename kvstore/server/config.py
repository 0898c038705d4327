"""A node's configuration (`kvstore serve` flags and KVSTORE_* variables) and the part of it
each shard replica runs with. Plain values, validated once at startup."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import wal.writer
from kvstore import limits


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


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    cluster: str
    topic: str
    shard: int
    bootstrap_servers: str
    node_id: str
    data_dir: Path
    transaction_timeout_ms: int = 60_000
    call_timeout_s: float = 10.0
    bootstrap_timeout_s: float = 120.0
    linger_ms: float = limits.BATCH_LINGER_MS
    max_batch_records: int = limits.MAX_BATCH_RECORDS
    max_batch_bytes: int = limits.MAX_BATCH_BYTES
    max_record_bytes: int = wal.writer.MAX_RECORD_BYTES_DEFAULT
    max_pending_writes: int = limits.MAX_PENDING_WRITES_PER_SHARD
    barrier_timeout_s: float = 10.0
    # Snapshots to load when this replica is empty or below the WAL's log start (None: replay only).
    snapshot_dir: str | None = None
