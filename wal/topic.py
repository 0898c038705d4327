"""The WAL topic: one partition per shard, every record kept, no unclean leader election.

The WAL is the store's source of truth: a new replica, a rebuilt store (missing or corrupt
LevelDB) and every Spark job replay a partition from offset 0. A broker's default retention
(7 days) would silently delete the records they need, so the topic keeps everything
(`retention.ms` and `retention.bytes` -1) until snapshots exist to truncate below (docs/design.md
§8). An unclean leader election could lose acknowledged batches, so it is off, and
`min.insync.replicas` makes acks=all mean "on more than one broker" when there are three.

`ensure_wal_topic` creates the topic or checks an existing one; an existing topic whose
retention is finite (e.g. created by hand, or by an older version) is altered to keep
everything, loudly, since leaving it would lose data later.

Next to the WAL, `<wal topic>.readers` holds the registry of who still reads it (`wal.readers`),
created on first use by `ensure_readers_topic`.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
    TopicMetadata,
)

from wal.clients import ClientSecurity, client_config
from wal.errors import UnavailableError, WalError

log = logging.getLogger(__name__)

MAX_REPLICATION_FACTOR = 3
KEEP_FOREVER = "-1"
RACE_RETRIES = 5  # creations lost to another node's before giving up
RACE_BACKOFF_S = 0.5
VISIBLE_POLL_S = 0.1  # how often a topic just created is looked for in the metadata
RETENTION_SETTINGS = ("retention.ms", "retention.bytes")


class TopicMismatchError(WalError):
    """The WAL topic exists but cannot be this cluster's: its partition count is not the shard
    count, which is fixed when the cluster is created (keys would map to other shards)."""


def min_insync_replicas(replication_factor: int) -> int:
    """Two copies before an ack once there are three replicas (one broker may be down); with
    fewer, requiring all of them would stop writes whenever one broker restarts."""
    assert replication_factor >= 1
    return max(1, min(2, replication_factor - 1))


def wal_topic_config(replication_factor: int) -> dict[str, str]:
    return {
        "cleanup.policy": "delete",
        "retention.ms": KEEP_FOREVER,
        "retention.bytes": KEEP_FOREVER,
        "unclean.leader.election.enable": "false",
        "min.insync.replicas": str(min_insync_replicas(replication_factor)),
    }


def ensure_wal_topic(bootstrap_servers: str, topic: str, partitions: int, replication_factor: int | None = None,
                     timeout_s: float = 30.0, *, security: ClientSecurity | None = None, _raced: int = 0) -> bool:
    """Create the WAL topic with one partition per shard, or check the existing one.

    Returns True if it was created here. `replication_factor` defaults to the number of
    brokers, at most 3. Raises TopicMismatchError for a wrong partition count and
    UnavailableError when the brokers cannot be asked or refuse.
    """
    assert partitions >= 1, f"a WAL needs at least one partition, got {partitions}"
    admin = AdminClient(client_config(bootstrap_servers, security, **{"client.id": "wal-topic"}))
    try:
        meta = admin.list_topics(timeout=timeout_s)
        existing = meta.topics.get(topic)
        if existing is not None and existing.error is None:
            if len(existing.partitions) != partitions:
                raise TopicMismatchError(
                    f"WAL topic {topic} has {len(existing.partitions)} partitions but the cluster has {partitions} "
                    "shards; the shard count is fixed when the cluster is created")
            _keep_everything(admin, topic, timeout_s)
            return False
        rf = replication_factor or min(MAX_REPLICATION_FACTOR, len(meta.brokers))
        if rf > len(meta.brokers):
            raise UnavailableError(f"WAL topic {topic}: replication factor {rf} needs {rf} brokers, "
                                   f"{len(meta.brokers)} are up")
        futures = admin.create_topics([NewTopic(topic, partitions, replication_factor=rf,
                                                config=wal_topic_config(rf))], request_timeout=timeout_s)
        for future in futures.values():
            try:
                future.result(timeout_s)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
                # Another node created it between our look and our create: check theirs, once
                # the metadata shows it (bounded: a topic that keeps "existing" unseen is an error).
                if _raced >= RACE_RETRIES:
                    raise
                time.sleep(RACE_BACKOFF_S)
                return ensure_wal_topic(bootstrap_servers, topic, partitions, replication_factor, timeout_s,
                                        security=security, _raced=_raced + 1)
        log.info("created WAL topic %s (%d partitions, replication factor %d, min.insync.replicas %d, "
                 "retention unlimited)", topic, partitions, rf, min_insync_replicas(rf))
        _wait_visible(admin, topic, timeout_s)
        return True
    except KafkaException as exc:
        raise UnavailableError(f"WAL topic {topic}: {exc.args[0]}") from exc


def _wait_visible(admin: AdminClient, topic: str, timeout_s: float) -> TopicMetadata:
    """The metadata of `topic` once a broker shows it with every partition led. A topic just
    created is known to the controller first: with three brokers, the next metadata request may
    go to one that has not heard of it yet, and "not found" there means "not yet" (found by the
    robustness campaign: a node exited at its first start, right after creating the WAL topic).
    Bounded by `timeout_s`, then UnavailableError."""
    deadline = time.monotonic() + timeout_s
    last = "not found"
    while True:
        described = admin.list_topics(topic=topic, timeout=max(0.1, deadline - time.monotonic())).topics.get(topic)
        if described is not None and described.error is None and described.partitions and all(
                p.leader >= 0 for p in described.partitions.values()):
            return described
        last = str(described.error) if described is not None and described.error is not None else (
            "a partition has no leader" if described is not None and described.partitions else "not found")
        if time.monotonic() >= deadline:
            raise UnavailableError(f"topic {topic}: {last} after {timeout_s:.0f} s")
        time.sleep(VISIBLE_POLL_S)


def _keep_everything(admin: AdminClient, topic: str, timeout_s: float) -> None:
    resource = ConfigResource(ResourceType.TOPIC, topic)
    (described,) = admin.describe_configs([resource], request_timeout=timeout_s).values()
    entries = described.result(timeout_s)
    finite = {name: entries[name].value for name in RETENTION_SETTINGS
              if name in entries and entries[name].value != KEEP_FOREVER}
    if not finite:
        return
    log.warning("WAL topic %s had a finite retention %s: every record is needed to rebuild a replica, "
                "setting it to unlimited", topic, finite)
    alter = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry(name, KEEP_FOREVER, incremental_operation=AlterConfigOpType.SET) for name in finite])
    for future in admin.incremental_alter_configs([alter], request_timeout=timeout_s).values():
        future.result(timeout_s)


# ---- the readers registry's topic (wal.readers) ----------------------------------------------------

READERS_SUFFIX = ".readers"


def readers_topic(wal_topic: str) -> str:
    """The registry of a WAL's readers sits next to it, named after it: whoever can name the WAL
    finds it, and two WALs never share one."""
    assert wal_topic and wal_topic.strip() == wal_topic, f"topic must be non-empty and unpadded: {wal_topic!r}"
    return f"{wal_topic}{READERS_SUFFIX}"


def readers_topic_config(replication_factor: int) -> dict[str, str]:
    """Compacted, so the last record per reader is kept forever and a tombstone removes one;
    never deleted by age or size (a quiet reader must not vanish and stop protecting its
    records); as durable as the WAL."""
    return {**wal_topic_config(replication_factor), "cleanup.policy": "compact"}


def ensure_readers_topic(bootstrap_servers: str, wal_topic: str, timeout_s: float = 30.0, *,
                         security: ClientSecurity | None = None) -> bool:
    """Create the readers topic of `wal_topic` (one partition, `readers_topic_config`, the WAL's
    replication factor) unless it exists; True if it was created here. An existing one is taken
    as it is: its creator (this function) set it up. Raises UnavailableError when the WAL topic
    does not exist or the brokers cannot be asked or refuse."""
    return ensure_side_topic(bootstrap_servers, wal_topic, readers_topic(wal_topic), "readers", timeout_s,
                             security=security)


PLACEMENT_SUFFIX = ".placement"


def placement_topic(wal_topic: str) -> str:
    """The placement log of the store that writes `wal_topic` (one partition, kept whole like the
    WAL: it is appended through the same guard, so compaction would break its offsets)."""
    assert wal_topic and wal_topic.strip() == wal_topic, f"topic must be non-empty and unpadded: {wal_topic!r}"
    return f"{wal_topic}{PLACEMENT_SUFFIX}"


def ensure_placement_topic(bootstrap_servers: str, wal_topic: str, timeout_s: float = 30.0, *,
                           security: ClientSecurity | None = None) -> bool:
    """Create the placement log of `wal_topic` unless it exists; True if created here."""
    return ensure_side_topic(bootstrap_servers, wal_topic, placement_topic(wal_topic), "placement", timeout_s,
                             security=security, compacted=False)


def ensure_side_topic(bootstrap_servers: str, wal_topic: str, name: str, what: str, timeout_s: float = 30.0, *,
                      security: ClientSecurity | None = None, compacted: bool = True) -> bool:
    """Create the one-partition topic `name` next to `wal_topic` (`readers_topic_config`, or the
    WAL's own config unless `compacted`; the WAL's replication factor) unless it exists; True if it
    was created here. Raises UnavailableError when the WAL topic does not exist or the brokers
    cannot be asked or refuse."""
    admin = AdminClient(client_config(bootstrap_servers, security, **{"client.id": f"wal-{what}-topic"}))
    try:
        meta = admin.list_topics(timeout=timeout_s)
        existing = meta.topics.get(name)
        if existing is not None and existing.error is None:
            return False
        try:
            wal = _wait_visible(admin, wal_topic, timeout_s)
        except UnavailableError as exc:
            raise UnavailableError(f"{exc}; the WAL's {what} topic {name} is created next to it") from None
        rf = max(len(p.replicas) for p in wal.partitions.values())
        config = readers_topic_config(rf) if compacted else wal_topic_config(rf)
        futures = admin.create_topics([NewTopic(name, 1, replication_factor=rf, config=config)],
                                      request_timeout=timeout_s)
        for future in futures.values():
            try:
                future.result(timeout_s)
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    return False  # someone else created it meanwhile
                raise
        log.info("created WAL %s topic %s (%s, replication factor %d)", what, name,
                 "compacted" if compacted else "kept whole", rf)
        return True
    except KafkaException as exc:
        raise UnavailableError(f"WAL {what} topic {name}: {exc.args[0]}") from exc


def partition_count(bootstrap_servers: str, topic: str, timeout_s: float = 30.0, *,
                    security: ClientSecurity | None = None) -> int:
    """How many partitions (shards) the WAL topic has. Raises UnavailableError if it does not
    exist or the brokers cannot be asked."""
    admin = AdminClient(client_config(bootstrap_servers, security, **{"client.id": "wal-topic"}))
    try:
        meta = admin.list_topics(topic=topic, timeout=timeout_s)
    except KafkaException as exc:
        raise UnavailableError(f"WAL topic {topic}: {exc.args[0]}") from exc
    described = meta.topics.get(topic)
    if described is None or described.error is not None or not described.partitions:
        why = described.error if described is not None else "not found"
        raise UnavailableError(f"WAL topic {topic} on {bootstrap_servers}: {why}")
    return len(described.partitions)


def delete_below(bootstrap_servers: str, topic: str, offsets: dict[int, int],
                 timeout_s: float = 30.0, *, security: ClientSecurity | None = None) -> dict[int, int]:
    """Delete every record below `offsets[partition]` (Kafka DeleteRecords; KIP-107) and return
    each partition's new log start. The only way records leave the WAL (retention is off): the
    caller decides what is safe to drop (`kvstore wal truncate`: below a snapshot's cut).

    A partition whose log start is already at or above the offset is left alone by the broker
    (its log start never moves back). Raises UnavailableError if any partition failed; the
    others may have been truncated by then (each is independent and idempotent: run it again).
    """
    assert offsets and all(o >= 0 for o in offsets.values()), f"bad truncation offsets {offsets}"
    admin = AdminClient(client_config(bootstrap_servers, security, **{"client.id": "wal-truncate"}))
    futures = admin.delete_records([TopicPartition(topic, p, o) for p, o in sorted(offsets.items())],
                                   request_timeout=timeout_s, operation_timeout=timeout_s)
    out: dict[int, int] = {}
    failures: list[str] = []
    for tp, future in futures.items():
        try:
            out[tp.partition] = int(future.result(timeout=timeout_s + 1).low_watermark)
        except KafkaException as exc:
            failures.append(f"{topic}[{tp.partition}] below {tp.offset}: {exc.args[0]}")
    if failures:
        raise UnavailableError("delete_records failed: " + "; ".join(failures))
    return out
