"""The conditional-publish write-ahead log over Kafka (KIP-27 emulated; docs/design.md §4).

Knows nothing of keys and values: it appends opaque payloads to one shard's partition at
expected offsets, with one writer per shard, and replays them under the acceptance rule.

The names below load lazily (PEP 562): `import wal.guard` or `import wal.offsets` must not pull
in librdkafka, so that the store's pure core and the simulation can use the log's pure parts
(the guard, the record rule, the offsets rule) without a Kafka client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for type checkers and readers
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

_HOME = {
    "shard_transactional_id": "wal.clients",
    **dict.fromkeys(("BatchAbortedError", "FencedError", "InvalidBatchError", "OffsetMismatchError",
                     "OffsetOutOfRangeError", "UnavailableError", "UnknownOutcomeError", "WalError",
                     "WalTimeoutError", "WriterFatalError"), "wal.errors"),
    "AppendResult": "wal.guard",
    **dict.fromkeys(("Reader", "ReaderList", "ReaderRegistry", "RegistryError"), "wal.readers"),
    **dict.fromkeys(("AcceptedRecord", "WriterIdentity"), "wal.record"),
    **dict.fromkeys(("Replayer", "ReplayStats"), "wal.replayer"),
    **dict.fromkeys(("TopicMismatchError", "delete_below", "ensure_readers_topic", "ensure_wal_topic",
                     "partition_count", "readers_topic"), "wal.topic"),
    **dict.fromkeys(("ShardWriter", "WriterConfig"), "wal.writer"),
}

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
assert sorted(__all__) == sorted(_HOME), "every lazy name is exported, and only those"


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'wal' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})
