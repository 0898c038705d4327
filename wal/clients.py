"""librdkafka client settings and the few raw queries the WAL needs, in one place.

Everything that talks to librdkafka lives in `wal/`; `kvstore/` only sees the WAL's API. Every
client of the WAL is configured from `client_config`, so its security settings (`ClientSecurity`:
SASL credentials of the principal the broker's ACLs know) come from this one place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

# ---- who a client is to the brokers --------------------------------------------------------------

PLAINTEXT = "PLAINTEXT"
SASL_PLAINTEXT = "SASL_PLAINTEXT"
SECURITY_PROTOCOLS = (PLAINTEXT, SASL_PLAINTEXT, "SASL_SSL", "SSL")
SCRAM_SHA_512 = "SCRAM-SHA-512"
SASL_MECHANISMS = (SCRAM_SHA_512, "SCRAM-SHA-256", "PLAIN")


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """How a client connects and, under SASL, who it says it is; the broker's ACLs decide what
    that principal may do (`wal.acl`). The default is what the local broker offers by default:
    the plaintext listener, no authentication, every client anonymous.

    One value per process role (a node, a pipeline command), handed to every client that role
    creates, so that no client of the WAL can be built without it (`client_config`)."""

    protocol: str = PLAINTEXT
    mechanism: str = ""
    username: str = ""
    password: str = dataclasses.field(default="", repr=False)  # never in a log line or a repr

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError for a combination that cannot work (`security_problem`)."""
        problem = security_problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def principal(self) -> str:
        """The principal the broker's authorizer sees (what ACLs name)."""
        return f"User:{self.username}" if self.sasl else "User:ANONYMOUS"


def security_problem(security: ClientSecurity) -> str:
    """Why a combination cannot work ("" if it can). Credentials on a listener that does not
    authenticate are refused too: they would be silently ignored, and the client would connect
    as ANONYMOUS, which is not what whoever configured them meant."""
    if security.protocol not in SECURITY_PROTOCOLS:
        return f"Kafka security protocol must be one of {', '.join(SECURITY_PROTOCOLS)}, got {security.protocol!r}"
    if not security.sasl:
        if security.mechanism or security.username or security.password:
            return f"SASL credentials given, but the Kafka security protocol is {security.protocol}"
        return ""
    if security.mechanism not in SASL_MECHANISMS:
        return f"SASL mechanism must be one of {', '.join(SASL_MECHANISMS)}, got {security.mechanism!r}"
    if not security.username or not security.password:
        return f"{security.protocol} needs a Kafka username and password"
    return ""


def security_from(protocol: str = "", mechanism: str = "", username: str = "", password: str = "") -> ClientSecurity:
    """The security a node or a command was configured with: a username alone implies SASL
    (SASL_PLAINTEXT, SCRAM-SHA-512) unless the protocol and mechanism say otherwise. Raises
    ValueError for a combination that cannot work (`security_problem`)."""
    protocol = protocol.strip().upper() or (SASL_PLAINTEXT if username else PLAINTEXT)
    sasl = protocol.startswith("SASL_")
    mechanism = mechanism.strip().upper() or (SCRAM_SHA_512 if sasl else "")
    return ClientSecurity(protocol, mechanism, username, password)


def read_password(path: str) -> str:
    """A password file's content without its line end. ValueError if unreadable or empty: a
    missing secret must stop the program, not make it log in with an empty password."""
    try:
        with open(path, encoding="utf-8") as file:
            password = file.read().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"Kafka password file {path}: {exc.strerror or exc}") from exc
    if not password:
        raise ValueError(f"Kafka password file {path} is empty")
    return password


def security_settings(security: ClientSecurity) -> dict[str, str]:
    """librdkafka's settings for `security` (nothing for the plaintext default)."""
    if security.protocol == PLAINTEXT:
        return {}
    settings = {"security.protocol": security.protocol.lower()}
    if security.sasl:
        settings.update({"sasl.mechanism": security.mechanism, "sasl.username": security.username,
                         "sasl.password": security.password})
    return settings


def java_security_settings(security: ClientSecurity) -> dict[str, str]:
    """The Java client's settings for `security` (Spark's Kafka source takes them prefixed with
    `kafka.`). The password goes into a JAAS line, quoted: backslash and quote are escaped."""
    if security.protocol == PLAINTEXT:
        return {}
    settings = {"security.protocol": security.protocol}
    if security.sasl:
        module = ("org.apache.kafka.common.security.plain.PlainLoginModule" if security.mechanism == "PLAIN"
                  else "org.apache.kafka.common.security.scram.ScramLoginModule")
        settings.update({"sasl.mechanism": security.mechanism,
                         "sasl.jaas.config": f"{module} required username={_jaas_quote(security.username)} "
                                             f"password={_jaas_quote(security.password)};"})
    return settings


def _jaas_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def client_config(bootstrap_servers: str, security: ClientSecurity | None = None,
                  **settings: Any) -> dict[str, Any]:
    """The base of every librdkafka client of the WAL (producer, consumer, admin): the brokers
    and the security settings, plus `settings` (dotted names as keyword arguments cannot be
    written: pass them with `**{"client.id": ...}`)."""
    config: dict[str, Any] = {"bootstrap.servers": bootstrap_servers}
    config.update(security_settings(security or ClientSecurity()))
    config.update(settings)
    return config


# ---- the clients ---------------------------------------------------------------------------------


def shard_transactional_id_prefix(topic: str) -> str:
    """What every shard's transactional id of `topic` starts with (the ACLs grant this prefix)."""
    assert topic and topic.strip() == topic, f"topic must be non-empty and unpadded: {topic!r}"
    return f"{topic}.shard-"


def shard_transactional_id(topic: str, shard: int) -> str:
    """W4: one transactional id per WAL partition, so that a new leader fences the old one.

    Derived from the WAL topic, which names the cluster by default (`<cluster>.wal`), and from
    nothing else: two deployments that share a topic (under other cluster names, an explicit
    `--topic`) write the same partitions, so they must share the ids and fence each other, and
    one cluster's writers of two topics must not fence each other."""
    assert shard >= 0, f"shard must be >= 0: {shard}"
    return f"{shard_transactional_id_prefix(topic)}{shard}"


def placement_transactional_id(topic: str) -> str:
    """W4 for the placement log of `topic` (wal.topic.placement_topic): one id, so that a new
    placement controller fences the old one."""
    assert topic and topic.strip() == topic, f"topic must be non-empty and unpadded: {topic!r}"
    return f"{topic}.placement"


def producer_config(
    bootstrap_servers: str,
    transactional_id: str,
    transaction_timeout_ms: int,
    overrides: Mapping[str, Any] | None = None,
    security: ClientSecurity | None = None,
) -> dict[str, Any]:
    """A transactional (hence idempotent, acks=all) producer for one shard."""
    config = client_config(bootstrap_servers, security)
    config.update({
        "transactional.id": transactional_id,
        # The broker aborts a transaction left open longer than this (a stalled leader), which
        # also fences the stalled producer. Keep it above the worst batch time + a broker bounce.
        "transaction.timeout.ms": transaction_timeout_ms,
        "enable.idempotence": True,
        "acks": "all",
        # flush() sends at once; a short linger only helps produce() calls coalesce.
        "linger.ms": 2,
        "client.id": f"wal-writer-{transactional_id}",
    })
    config.update(overrides or {})
    return config


# The group id of every group-less reader: a random name under this prefix (`consumer_config`).
READER_GROUP_PREFIX = "wal-reader-"


def consumer_config(
    bootstrap_servers: str, isolation_level: str, overrides: Mapping[str, Any] | None = None,
    security: ClientSecurity | None = None,
) -> dict[str, Any]:
    """A group-less reader: partitions are assigned by hand, offsets are never committed.

    Every WAL reader (wal.replayer, wal.transactions) is built from this. The consumer-group
    member of wal.membership is not: it never fetches a record (it pauses every partition it
    is assigned and only uses the assignment), so its auto.offset.reset is irrelevant and it
    keeps librdkafka's default.
    """
    assert isolation_level in ("read_committed", "read_uncommitted"), isolation_level
    config = client_config(bootstrap_servers, security)
    config.update({
        # librdkafka wants a group id even for assign(); it never joins or commits.
        "group.id": f"{READER_GROUP_PREFIX}{uuid.uuid4().hex[:12]}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": isolation_level,
        "enable.partition.eof": True,
        # docs/design.md §4.1: never a silent jump. With "earliest" a position below the log start
        # (records truncated by retention or delete_records) would quietly continue at the log
        # start, skipping records the reader never applied; with "latest" a position above the
        # end (the WAL was recreated, an unclean leader election truncated it) would quietly
        # skip to the end. "error" makes librdkafka stop fetching the partition instead and
        # deliver a consumer error _AUTO_OFFSET_RESET, which the replayer raises as
        # wal.errors.OffsetOutOfRangeError for its caller to decide (rebuild, wait, re-seek).
        "auto.offset.reset": "error",
    })
    config.update(overrides or {})
    return config


def end_offsets(consumer: Consumer, topic: str, partition: int, timeout_s: float) -> tuple[int, int]:
    """(log start, end) as the consumer's isolation level sees it.

    librdkafka >= 1.7.1 honours isolation.level here: a read_committed consumer gets the last
    stable offset (LSO), a read_uncommitted one the high watermark. Raises KafkaException.
    """
    low, high = consumer.get_watermark_offsets(
        TopicPartition(topic, partition), timeout=timeout_s, cached=False
    )
    if low < 0 or high < 0:
        raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION, f"no offsets for {topic}[{partition}]"))
    return int(low), int(high)


def error_of(exc: KafkaException) -> KafkaError:
    """The KafkaError inside a KafkaException (confluent-kafka puts it in args[0])."""
    first = exc.args[0] if exc.args else None
    if isinstance(first, KafkaError):
        return first
    return KafkaError(KafkaError._FAIL, str(exc))


class PartitionEnds:
    """The ends of a partition: the log start, the high watermark (read_uncommitted), the LSO.

    Uses the admin ListOffsets API, which looks up the partition leader on every call, so the
    answer follows a leader change (a consumer's cached metadata for a partition it is not
    assigned can stay stale for a long time after the leader dies).
    """

    # A fresh admin client connects to every bootstrap broker and asks for metadata: renewed after
    # every failure, a node's read barriers and end reads against a Kafka that is down made a storm
    # of them that kept a recovering cluster starved (issue 22's campaign). At most one per interval.
    RENEW_MIN_INTERVAL_S = 5.0

    def __init__(self, bootstrap_servers: str, timeout_s: float, security: ClientSecurity | None = None) -> None:
        self._timeout_s = timeout_s
        self._bootstrap_servers = bootstrap_servers
        self._security = security
        self._admin = self._new_admin()
        self._renewed_at = time.monotonic()
        self.renewals = 0

    def _new_admin(self) -> AdminClient:
        return AdminClient(client_config(self._bootstrap_servers, self._security,
                                         **{"client.id": "wal-partition-ends"}))

    def _renew_admin(self) -> None:
        """Start over with fresh metadata, unless that was done less than RENEW_MIN_INTERVAL_S ago."""
        now = time.monotonic()
        if now - self._renewed_at < self.RENEW_MIN_INTERVAL_S:
            return
        self._renewed_at = now
        self.renewals += 1
        self._admin = self._new_admin()

    def high_watermark(self, topic: str, partition: int) -> int:
        return self._list_offset(topic, partition, OffsetSpec.latest(),  # type: ignore[no-untyped-call]
                                 IsolationLevel.READ_UNCOMMITTED)

    def stable_offset(self, topic: str, partition: int) -> int:
        return self._list_offset(topic, partition, OffsetSpec.latest(),  # type: ignore[no-untyped-call]
                                 IsolationLevel.READ_COMMITTED)

    def log_start(self, topic: str, partition: int) -> int:
        """The log start offset (low watermark): the first offset still in the partition.
        Records below it were deleted (retention, delete_records); it only grows."""
        return self._list_offset(topic, partition, OffsetSpec.earliest(),  # type: ignore[no-untyped-call]
                                 IsolationLevel.READ_UNCOMMITTED)

    def _list_offset(self, topic: str, partition: int, spec: OffsetSpec, isolation: IsolationLevel) -> int:
        tp = TopicPartition(topic, partition)
        futures = self._admin.list_offsets({tp: spec}, isolation_level=isolation,
                                           request_timeout=self._timeout_s)
        try:
            info = futures[tp].result(timeout=self._timeout_s + 1)
        except concurrent.futures.TimeoutError as exc:
            self._renew_admin()
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"list_offsets {topic}[{partition}]",
                                            retriable=True)) from exc
        except KafkaException:
            # The admin client does not refresh a stale leader epoch by itself after a broker
            # restart (FENCED_LEADER_EPOCH forever): start over with fresh metadata.
            self._renew_admin()
            raise
        if info.offset < 0:
            # Seen while partition leadership moves: the request "succeeds" with OFFSET_INVALID
            # (-1001). It is not an end; make it a retriable error so callers try again.
            self._renew_admin()
            raise KafkaException(KafkaError(KafkaError._STATE, f"list_offsets {topic}[{partition}] returned no "
                                            f"offset ({info.offset}) during a leader change", retriable=True))
        return int(info.offset)

    def settled_end(self, topic: str, partition: int, timeout_s: float) -> int:
        """The high watermark at a moment when no transaction is open on the partition.

        Commit and abort markers are written after commit/abort_transaction return, so right
        after our own batch the high watermark still lacks its marker; only when LSO == HW is
        the high watermark the offset the next record will get. Raises a retriable
        KafkaException(_TIMED_OUT) if some transaction stays open longer than `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            # LSO first: HW only grows, so LSO(t1) == HW(t2) for t1 < t2 proves that at t1
            # nothing was open and nothing has been appended since.
            stable = self.stable_offset(topic, partition)
            high = self.high_watermark(topic, partition)
            if stable == high:
                return high
            if time.monotonic() >= deadline:
                raise KafkaException(KafkaError(
                    KafkaError._TIMED_OUT,
                    f"{topic}[{partition}]: a transaction stays open (LSO {stable} < HW {high})",
                    retriable=True))
            time.sleep(0.02)

    def close(self) -> None:
        """Nothing to release: the admin client is dropped with this object."""
