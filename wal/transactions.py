"""Operator views of a shard's transactions (seed 004): what is open, since when; force-fence.

A transaction open on a partition holds its last stable offset (LSO) below the high watermark
(HW), and with it every read_committed reader (followers, bootstraps, Spark). The broker aborts
it after `transaction.timeout.ms`; `force_fence` does not wait: a fresh `init_transactions` on
the shard's transactional id aborts it now and fences its producer (KIP-939's remedy).

Both work from the broker's side only, so they see a stuck transaction whatever its writer
is doing (dead, paused, partitioned away).
"""

from __future__ import annotations

import dataclasses
import time

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from wal.clients import ClientSecurity, PartitionEnds, consumer_config
from wal.record import WriterIdentity
from wal.writer import ShardWriter, WriterConfig


@dataclasses.dataclass(frozen=True)
class OpenTransaction:
    partition: int
    first_offset: int  # the LSO: first record of the oldest open transaction
    end_offset: int  # the HW
    started_ms: int  # broker timestamp of that record (ms since the epoch); 0 if unreadable

    def age_ms(self, now_ms: int | None = None) -> int:
        if self.started_ms <= 0:
            return 0
        return max(0, (now_ms if now_ms is not None else int(time.time() * 1000)) - self.started_ms)


def open_transaction(ends: PartitionEnds, bootstrap_servers: str, topic: str, partition: int,
                     timeout_s: float, security: ClientSecurity | None = None) -> OpenTransaction | None:
    """The partition's oldest open transaction, or None if LSO == HW. Raises KafkaException."""
    stable = ends.stable_offset(topic, partition)
    high = ends.high_watermark(topic, partition)
    if stable >= high:
        return None
    return OpenTransaction(partition, stable, high, _timestamp_at(bootstrap_servers, topic, partition, stable,
                                                                  timeout_s, security))


def _timestamp_at(bootstrap_servers: str, topic: str, partition: int, offset: int, timeout_s: float,
                  security: ClientSecurity | None) -> int:
    """Broker timestamp of the record at `offset`, read uncommitted; 0 if it cannot be read."""
    consumer = Consumer(consumer_config(bootstrap_servers, "read_uncommitted", security=security))
    try:
        consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._AUTO_OFFSET_RESET:
                    return 0  # the offset left the log (auto.offset.reset=error): nothing to read
                continue
            _kind, timestamp = message.timestamp()
            return int(timestamp) if message.offset() == offset else 0
        return 0
    except KafkaException:
        return 0
    finally:
        consumer.close()


def force_fence(config: WriterConfig) -> int:
    """`init_transactions` on the shard's transactional id, as an operator; returns the settled
    partition end. The current writer (if any) is fenced: its next call fails as fenced."""
    writer = ShardWriter(dataclasses.replace(config, writer=WriterIdentity("admin-fence", 0)))
    try:
        return writer.fence()
    finally:
        writer.close()
