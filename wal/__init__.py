"""The conditional-publish write-ahead log over Kafka (KIP-27 emulated; DESIGN.md §3).

Knows nothing of keys and values: it appends opaque payloads to one shard's partition at
expected offsets, with one writer per shard, and replays them under the acceptance rule.
"""

from wal.clients import shard_transactional_id
from wal.errors import (
    BatchAbortedError,
    FencedError,
    InvalidBatchError,
    OffsetMismatchError,
    OffsetOutOfRangeError,
    UnavailableError,
    UnknownOutcomeError,
    WalError,
    WalTimeoutError,
    WriterFatalError,
)
from wal.guard import AppendResult
from wal.readers import Reader, ReaderList, ReaderRegistry, RegistryError
from wal.record import AcceptedRecord, WriterIdentity
from wal.replayer import Replayer, ReplayStats
from wal.topic import (
    TopicMismatchError,
    delete_below,
    ensure_readers_topic,
    ensure_wal_topic,
    partition_count,
    readers_topic,
)
from wal.writer import ShardWriter, WriterConfig

__all__ = [
    "AcceptedRecord",
    "AppendResult",
    "BatchAbortedError",
    "FencedError",
    "InvalidBatchError",
    "OffsetMismatchError",
    "OffsetOutOfRangeError",
    "Reader",
    "ReaderList",
    "ReaderRegistry",
    "RegistryError",
    "ReplayStats",
    "Replayer",
    "ShardWriter",
    "TopicMismatchError",
    "UnavailableError",
    "UnknownOutcomeError",
    "WalError",
    "WalTimeoutError",
    "WriterConfig",
    "WriterFatalError",
    "WriterIdentity",
    "delete_below",
    "ensure_readers_topic",
    "ensure_wal_topic",
    "partition_count",
    "readers_topic",
    "shard_transactional_id",
]
