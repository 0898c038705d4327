"""Documented limits of the store. Every queue and batch is bounded; README.md lists these.

A request that breaks a limit gets INVALID_ARGUMENT naming it; a full queue RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

MAX_KEY_BYTES = 4_096
# A WAL record must stay below the broker's message.max.bytes (1 MiB) with its envelope and the
# stored response, so a value is bounded well below it.
MAX_VALUE_BYTES = 900_000
MAX_REQUEST_BYTES = 1_000_000  # a whole request (a Txn with all its operations)
MAX_REQUEST_ID_BYTES = 128
MAX_TXN_OPS = 128  # compares + success ops + failure ops
DEFAULT_SCAN_LIMIT = 100
MAX_SCAN_LIMIT = 1_000
MAX_PENDING_WRITES_PER_SHARD = 10_000  # the group-commit queue; beyond it: RESOURCE_EXHAUSTED
MAX_BATCH_RECORDS = 1_000  # one WAL transaction
MAX_BATCH_BYTES = 4 * 1024 * 1024
BATCH_LINGER_MS = 2
MAX_WATCHERS = 1_024
WATCH_QUEUE_EVENTS = 10_000  # per watcher; a watcher that falls this far behind is cut off
# gRPC's own cap, a little above MAX_REQUEST_BYTES so that our check (with a clear message) runs.
GRPC_MAX_MESSAGE_BYTES = 2 * 1024 * 1024
