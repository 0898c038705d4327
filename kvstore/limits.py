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
# One shard's part of a WriteBatch (one WAL record). The part's bytes are bounded by
# MAX_REQUEST_BYTES and by the WAL's record limit; this bounds the work of one record.
MAX_BATCH_MUTATIONS = 10_000
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

# ---- the request-id (dedupe) table: DESIGN.md §3, "kept for a documented horizon" ----------------
# Every replica forgets a request id at the same WAL entry, by time and by count, from the leader
# times stamped in the entries (WalEntry.leader_unix_ms), never from its own clock. Changing any of
# these two changes which ids a replica remembers: do it with a kvstore.server.storage FORMAT_VERSION bump
# so that every store is rebuilt under the new rule.
#
# Time bound. A retry is refused ("expired, outcome unknown") once its first attempt is older than
# this. Clients retry automatically within their call deadline (seconds); a person whose CLI call
# ended in "unknown outcome" may come back minutes later, after a coffee or a failover. An hour
# covers both with a wide margin; past it a person should read the key, not blindly replay a write.
# The table's size is set by the count bound below, so a longer horizon costs no storage on a busy
# shard, and on a quiet one at most an hour of its writes.
REQUEST_ID_HORIZON_MS = 60 * 60 * 1_000
# Count bound: the storage ceiling. An id costs two rows, its answer (the id, <= MAX_REQUEST_ID_BYTES,
# 16 bytes of revision and time, the stored response, usually < 100 bytes) and its place in commit
# order (the id and 16 bytes): at most ~40 MB per shard, ~15 MB with uuid4-hex ids. A Txn response
# is larger: ~25 bytes per operation plus the values it read, so 100k ids of 128-put Txns (what
# `kvstore load` sends) take ~300 MB per shard; bytes are bounded only through MAX_REQUEST_BYTES.
# The horizon is therefore min(REQUEST_ID_HORIZON_MS, MAX_REQUEST_IDS / id'd writes per second):
# above ~28 writes/s with request ids per shard, the count bound forgets first, and retries are
# refused sooner (by the evicted-through rule, kvstore.core.request_horizon), never applied twice.
MAX_REQUEST_IDS = 100_000
# How far apart two clocks may be: a client's (first_attempt_unix_ms) and a leader's, or two
# successive leaders'. NTP keeps hosts within milliseconds; ten seconds also covers a badly synced
# host or a VM that was paused. The refusal rule widens every comparison by this much, so a larger
# value refuses more fresh requests near an eviction, a smaller one risks a second apply.
MAX_CLOCK_SKEW_MS = 10_000
assert 0 < MAX_CLOCK_SKEW_MS < REQUEST_ID_HORIZON_MS, "the skew margin must not swallow the horizon"
