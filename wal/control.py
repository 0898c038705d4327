"""The WAL's control topic: settings an operator gives the store that writes the WAL, kept next to
it (`<wal topic>.control`, compacted, one partition) as named entries, key -> bytes.

Why a topic: every node must see the same settings, they must outlive any node, and the store
already trusts Kafka with its log; nothing else to run or back up. Compaction keeps the last
record per key forever and a tombstone (no value) removes one. The store keeps its placement
overrides here (`kvstore drain`, `kvstore move`: kvstore.core.placement reads the entries).

`ControlLog` tails the topic and keeps the latest value per key. A record it cannot use (no key,
a key that is not UTF-8, beyond the bounds below) is skipped and counted (`malformed`), never a
failure: a hostile or broken record must not stop a node from placing shards. Knows nothing of
what the entries mean.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from wal.clients import ClientSecurity, client_config, consumer_config
from wal.errors import UnavailableError
from wal.topic import control_topic, ensure_side_topic

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 1_000
MAX_VALUE_BYTES = 64 * 1024
MAX_ENTRIES = 100_000  # live entries kept; beyond that something writes in a loop
POLL_S = 0.2
WRITE_TIMEOUT_S = 10.0


def ensure_control_topic(bootstrap_servers: str, wal_topic: str, timeout_s: float = 30.0, *,
                         security: ClientSecurity | None = None) -> bool:
    """Create the control topic of `wal_topic` unless it exists; True if created here."""
    return ensure_side_topic(bootstrap_servers, wal_topic, control_topic(wal_topic), "control", timeout_s,
                             security=security)


def write(bootstrap_servers: str, wal_topic: str, key: str, value: bytes | None, *,
          security: ClientSecurity | None = None, timeout_s: float = WRITE_TIMEOUT_S) -> int:
    """Set `key` to `value` (None: remove it) once every in-sync replica has it; returns the
    record's offset. Raises UnavailableError (nothing may have been written, or it may: setting
    the same value again is harmless) or ValueError for a key or value beyond the bounds."""
    raw_key = key.encode()
    if not key or len(raw_key) > MAX_KEY_BYTES:
        raise ValueError(f"control key must be 1..{MAX_KEY_BYTES} bytes: {key!r}")
    if value is not None and len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"control value for {key!r} is {len(value)} bytes, over MAX_VALUE_BYTES ({MAX_VALUE_BYTES})")
    ensure_control_topic(bootstrap_servers, wal_topic, timeout_s, security=security)
    producer = Producer(client_config(bootstrap_servers, security, **{
        "client.id": "wal-control", "enable.idempotence": True, "acks": "all",
        "message.timeout.ms": int(timeout_s * 1000)}))
    outcome: dict[str, object] = {}

    def delivered(err: KafkaError | None, msg: object) -> None:
        outcome["error"] = err
        outcome["offset"] = msg.offset() if err is None else -1  # type: ignore[attr-defined]

    topic = control_topic(wal_topic)
    try:
        producer.produce(topic, key=raw_key, value=value, on_delivery=delivered)
        producer.flush(timeout_s + 1)
    except (KafkaException, BufferError) as exc:
        raise UnavailableError(f"control topic {topic}: writing {key!r} failed: {exc}") from exc
    if "error" not in outcome:
        raise UnavailableError(f"control topic {topic}: writing {key!r} was not confirmed within {timeout_s:.0f} s")
    if outcome["error"] is not None:
        raise UnavailableError(f"control topic {topic}: writing {key!r} failed: {outcome['error']}")
    offset = outcome["offset"]
    assert isinstance(offset, int)
    return offset


class ControlLog:
    """The control topic as it stands: the latest value per key, kept up to date by `poll`.
    Thread-safe to read (`entries`) while one thread polls."""

    def __init__(self, bootstrap_servers: str, wal_topic: str, *, security: ClientSecurity | None = None) -> None:
        self.topic = control_topic(wal_topic)
        # "earliest", unlike every WAL reader ("error", docs/design.md §4.1): this topic is read
        # whole, from its first record on, and nobody's position in it matters. A log start above
        # 0 (records deleted by hand) means "read what is left", which is all there is to know.
        self._config = consumer_config(bootstrap_servers, "read_uncommitted",
                                       {"client.id": "wal-control-reader", "auto.offset.reset": "earliest"},
                                       security)
        self._consumer: Consumer | None = None
        self._entries: dict[str, bytes] = {}
        self._lock = threading.Lock()  # the entries
        self._io = threading.Lock()  # the consumer: a close never runs while a poll does
        self.malformed = 0
        self.position = 0  # next offset to read
        self.reached_end = False  # it read the topic to its end once: `entries` is what was there

    @property
    def entries(self) -> Mapping[str, bytes]:
        with self._lock:
            return dict(self._entries)

    def poll(self, timeout_s: float = POLL_S) -> bool:
        """Read what arrived (at most `timeout_s` of waiting); True if an entry changed. A topic
        that does not exist yet reads as empty. Raises nothing: a broker away keeps the last entries."""
        with self._io:
            return self._poll(timeout_s)

    def _poll(self, timeout_s: float) -> bool:
        consumer = self._consumer
        if consumer is None:
            consumer = self._consumer = Consumer(self._config)
            consumer.assign([TopicPartition(self.topic, 0, self.position)])
        changed = False
        try:
            messages = consumer.consume(num_messages=1000, timeout=timeout_s)
        except KafkaException as exc:
            log.debug("control topic %s: %s", self.topic, exc)
            return False
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    self.reached_end = True
                elif error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    log.debug("control topic %s: %s", self.topic, error)
                continue
            offset = message.offset()
            self.position = max(self.position, (offset if offset is not None else -1) + 1)
            changed |= self._take(message.key(), message.value(), offset)
        return changed

    def _take(self, raw_key: bytes | None, value: bytes | None, offset: int | None) -> bool:
        try:
            key = raw_key.decode() if raw_key is not None else ""
        except UnicodeDecodeError:
            key = ""
        if not key or len(raw_key or b"") > MAX_KEY_BYTES or (value is not None and len(value) > MAX_VALUE_BYTES):
            self.malformed += 1
            log.warning("control topic %s: skipped the record at offset %s (no usable key, or beyond the bounds)",
                        self.topic, offset)
            return False
        with self._lock:
            if value is None:
                return self._entries.pop(key, None) is not None
            if key not in self._entries and len(self._entries) >= MAX_ENTRIES:
                self.malformed += 1
                log.warning("control topic %s: %d entries already (MAX_ENTRIES); skipped %r", self.topic,
                            MAX_ENTRIES, key)
                return False
            previous = self._entries.get(key)
            self._entries[key] = value
            return previous != value

    def close(self) -> None:
        with self._io:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None
