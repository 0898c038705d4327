"""Who still reads the WAL, and from where: a registry of readers in a compacted topic next to it.

Deleting WAL records (Kafka DeleteRecords, `wal.topic.delete_below`) is forever. A reader that
keeps its own position (a change feed's checkpoint, any job that resumes where it stopped) loses
the records it has not read yet for good if they are deleted under it. So such a reader records
here, per partition, the *next offset it still needs*; whoever deletes reads the registry first
and stops below the oldest position (`kvstore wal truncate`).

A position may lag behind the reader (it only protects more), never run ahead of it: a reader
records an offset only once it can never need anything below it again (for a streaming query,
the end of a batch once that batch is committed, not once it is planned: a planned batch is
re-run from its start after a crash).

Why a compacted Kafka topic (`<wal topic>.readers`, `wal.topic.ensure_readers_topic`): it lives
where the WAL lives, as durable, under the same logins and ACLs, readable by anyone who may
truncate, with no other store to run. Compaction keeps the last record per reader (the key is
its name) forever, and a tombstone (a record without a value) removes one. One partition: the
registry is small (a record per reader) and always read whole. Its absence means "no readers".

A record that cannot be read (not JSON, wrong fields, key and name apart) is skipped, counted
and reported with its offset, never a failure of whoever lists the registry: a registry nobody
can list would block truncation for good, or invite `--force`. A reader whose record is
malformed is therefore not protected; `ReaderList.malformed` says so to the operator.

Knows nothing of keys and values: a reader is a name, a kind, a place and offsets.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from wal.clients import ClientSecurity, client_config, consumer_config
from wal.errors import UnavailableError, WalError
from wal.topic import ensure_readers_topic, readers_topic

log = logging.getLogger(__name__)

FORMAT = 1
MAX_NAME_CHARS = 1_000  # a reader's name is the record's key: a path or URI, not a document
MAX_RECORD_BYTES = 512 * 1024  # far above a record of 10 000 partitions; below Kafka's 1 MiB default
MAX_READERS = 10_000  # live readers a listing holds; beyond that something registers in a loop
POLL_S = 0.2


class RegistryError(WalError):
    """The registry could not be read or written; the message says which limit or reason."""


@dataclasses.dataclass(frozen=True)
class Reader:
    """One reader: `positions[p]` is the next offset of WAL partition p it still needs (it has
    read, or never needs, everything below). A partition it does not list it does not hold."""

    name: str  # unique per reader, stable across its runs (e.g. derived from its checkpoint)
    kind: str  # what it is, for people ("change-feed", ...)
    where: str  # where its output goes, for people
    positions: Mapping[int, int]
    updated_unix_ms: int

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise ValueError(problem)

    def encode(self) -> bytes:
        body = {"format": FORMAT, "name": self.name, "kind": self.kind, "where": self.where,
                "positions": {str(p): o for p, o in sorted(self.positions.items())},
                "updated_unix_ms": self.updated_unix_ms}
        value = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        if len(value) > MAX_RECORD_BYTES:
            raise ValueError(f"reader {self.name!r}: its record is {len(value)} bytes, over MAX_RECORD_BYTES "
                             f"({MAX_RECORD_BYTES})")
        return value


def _problem(reader: Reader) -> str:
    if not isinstance(reader.name, str) or not reader.name or len(reader.name) > MAX_NAME_CHARS:
        return f"a reader's name must be 1 to {MAX_NAME_CHARS} characters (MAX_NAME_CHARS), got {reader.name!r:.80}"
    if not isinstance(reader.kind, str) or not isinstance(reader.where, str):
        return f"reader {reader.name!r}: kind and where must be strings"
    if not _is_int(reader.updated_unix_ms) or reader.updated_unix_ms < 0:
        return f"reader {reader.name!r}: updated_unix_ms must be an integer >= 0, got {reader.updated_unix_ms!r}"
    for partition, offset in reader.positions.items():
        if not _is_int(partition) or not _is_int(offset) or partition < 0 or offset < 0:
            return f"reader {reader.name!r}: positions must map partitions >= 0 to offsets >= 0, got " \
                   f"{partition!r}: {offset!r}"
    return ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode(key: bytes, value: bytes) -> Reader:
    """The reader a registry record holds. Raises ValueError saying what is wrong with it."""
    try:
        name = key.decode("utf-8")
        body = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not UTF-8 JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError(f"not a JSON object: {type(body).__name__}")
    if body.get("format") != FORMAT:
        raise ValueError(f"format {body.get('format')!r}, this version reads {FORMAT}")
    if body.get("name") != name:
        raise ValueError(f"the record's key {name!r:.80} is not its name {body.get('name')!r:.80}")
    positions = body.get("positions")
    if not isinstance(positions, dict):
        raise ValueError("positions is not an object")
    parsed: dict[int, int] = {}
    for partition, offset in positions.items():
        if not (isinstance(partition, str) and partition.isascii() and partition.isdigit() and len(partition) <= 9):
            raise ValueError(f"partition {partition!r:.40} is not a decimal number")
        parsed[int(partition)] = offset
    try:
        kind, where, updated_unix_ms = body["kind"], body["where"], body["updated_unix_ms"]
    except KeyError as exc:
        raise ValueError(f"no field {exc}") from None
    return Reader(name, kind, where, parsed, updated_unix_ms)


@dataclasses.dataclass(frozen=True)
class Malformed:
    offset: int  # in the registry topic
    key: str  # as far as it can be shown
    why: str


@dataclasses.dataclass(frozen=True)
class ReaderList:
    readers: tuple[Reader, ...]  # by name
    malformed: tuple[Malformed, ...]  # skipped records whose key has no readable record after them

    def by_name(self) -> dict[str, Reader]:
        return {r.name: r for r in self.readers}


def latest(records: Iterable[tuple[int, bytes | None, bytes | None]]) -> ReaderList:
    """What the registry holds after `records` (offset, key, value) in offset order, as
    compaction would keep it: the last record per key wins, a tombstone (value None) removes the
    key. A malformed record is skipped, as if never written (the key's earlier record, if any,
    still stands), and listed unless a later record of its key replaced it. Pure."""
    readers: dict[bytes, Reader] = {}
    malformed: dict[bytes, Malformed] = {}
    keyless: list[Malformed] = []
    for offset, key, value in records:
        if key is None:
            keyless.append(Malformed(offset, "", "no key"))
            continue
        shown = key.decode("utf-8", "replace")[:200]
        if value is None:
            readers.pop(key, None)
            malformed.pop(key, None)
            continue
        try:
            reader = decode(key, value)
        except ValueError as exc:
            malformed[key] = Malformed(offset, shown, str(exc))
            continue
        malformed.pop(key, None)
        readers[key] = reader
        if len(readers) > MAX_READERS:
            raise RegistryError(f"more than {MAX_READERS} readers registered (MAX_READERS): something registers "
                                "in a loop; remove the stale ones")
    return ReaderList(tuple(sorted(readers.values(), key=lambda r: r.name)),
                      tuple(sorted([*malformed.values(), *keyless], key=lambda m: m.offset)))


class ReaderRegistry:
    """The readers registry of one WAL topic. `record` and `remove` create the topic on first use
    and wait (bounded by `timeout_s`) until the brokers acknowledged the record on every in-sync
    replica; `list` reads the topic whole (bounded too). Not thread-safe: one per thread."""

    def __init__(self, bootstrap_servers: str, wal_topic: str, *, security: ClientSecurity | None = None,
                 timeout_s: float = 30.0) -> None:
        assert timeout_s > 0
        self.wal_topic = wal_topic
        self.topic = readers_topic(wal_topic)
        self._bootstrap_servers = bootstrap_servers
        self._security = security
        self._timeout_s = timeout_s
        self._producer: Producer | None = None

    def record(self, reader: Reader) -> None:
        """Register `reader` or replace its previous record. Raises RegistryError if it was not
        acknowledged within the bound (it may still land: recording is idempotent)."""
        self._send(reader.name, reader.encode())

    def remove(self, name: str) -> None:
        """Deregister `name` (a tombstone). Its positions no longer hold truncation back."""
        self._send(name, None)

    def list(self) -> ReaderList:
        """Every registered reader (`latest`), read up to the topic's end as of this call.
        No topic: no readers. Raises RegistryError when it cannot be read within the bound
        (never "no readers" for a registry that exists but cannot be read)."""
        deadline = time.monotonic() + self._timeout_s
        consumer = Consumer(consumer_config(self._bootstrap_servers, "read_committed", {
            "client.id": "wal-readers-list", "auto.offset.reset": "earliest"}, self._security))
        try:
            if not self._exists(consumer):
                return ReaderList((), ())
            tp = TopicPartition(self.topic, 0)
            low, high = consumer.get_watermark_offsets(tp, timeout=self._timeout_s, cached=False)
            if high <= low:
                return ReaderList((), ())
            consumer.assign([TopicPartition(self.topic, 0, low)])
            records: list[tuple[int, bytes | None, bytes | None]] = []
            position = low
            while position < high:
                if time.monotonic() > deadline:
                    raise RegistryError(f"reading {self.topic}: at offset {position} of {high} after "
                                        f"{self._timeout_s:.0f} s (the bound)")
                message = consumer.poll(POLL_S)
                if message is None:
                    continue
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        position = max(position, int(message.offset() or 0))
                        continue
                    raise RegistryError(f"reading {self.topic}: {error}")
                offset = int(message.offset() or 0)
                records.append((offset, _bytes(message.key()), _bytes(message.value())))
                position = offset + 1
            return latest(records)
        except KafkaException as exc:
            raise RegistryError(f"reading {self.topic}: {exc.args[0]}") from exc
        finally:
            consumer.close()

    def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(self._timeout_s)

    def __enter__(self) -> ReaderRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _exists(self, consumer: Consumer) -> bool:
        meta = consumer.list_topics(self.topic, timeout=self._timeout_s)
        described = meta.topics.get(self.topic)
        if described is None:
            return False
        if described.error is not None:
            if described.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                return False
            raise RegistryError(f"{self.topic}: {described.error}")
        return bool(described.partitions)

    def _send(self, name: str, value: bytes | None) -> None:
        if not name or len(name) > MAX_NAME_CHARS:
            raise ValueError(f"a reader's name must be 1 to {MAX_NAME_CHARS} characters (MAX_NAME_CHARS)")
        producer = self._ensure_producer()
        reports: list[KafkaError | None] = []

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            reports.append(err)

        try:
            producer.produce(self.topic, value, key=name.encode(), partition=0, on_delivery=on_delivery)
        except (KafkaException, BufferError) as exc:
            raise RegistryError(f"{self.topic}: cannot send the record of reader {name!r}: {exc}") from exc
        producer.flush(self._timeout_s)
        if not reports:
            raise RegistryError(f"{self.topic}: the record of reader {name!r} was not acknowledged within "
                                f"{self._timeout_s:.0f} s (the bound)")
        if reports[0] is not None:
            raise RegistryError(f"{self.topic}: the record of reader {name!r} was refused: {reports[0]}")

    def _ensure_producer(self) -> Producer:
        if self._producer is None:
            try:
                ensure_readers_topic(self._bootstrap_servers, self.wal_topic, self._timeout_s,
                                     security=self._security)
            except UnavailableError as exc:
                raise RegistryError(str(exc)) from exc
            self._producer = Producer(client_config(self._bootstrap_servers, self._security, **{
                "client.id": "wal-readers",
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 0,
                # The record is given up after the bound instead of retried for librdkafka's default
                # 5 minutes: the caller hears of it, and a late delivery is harmless (idempotent).
                "message.timeout.ms": max(1000, int(self._timeout_s * 1000)),
            }))
        return self._producer


def _bytes(value: Any) -> bytes | None:
    if value is None:
        return None
    return bytes(value) if not isinstance(value, bytes) else value
