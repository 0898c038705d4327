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
# Cross-shard transactions prepared at one shard and not resolved yet (docs/design.md §10): each
# holds locks and a row of the prepared table, which a replica keeps in memory. Beyond it a
# prepare is refused (RESOURCE_EXHAUSTED); in-doubt ones are resolved after TXN_IN_DOUBT_AFTER_MS.
MAX_PREPARED_TXNS = 10_000
# A prepare older than this (its leader time against the leader's clock) is in doubt: the
# participant's leader asks the coordinator for the decision, which writes an abort if there is
# none. Far above a healthy transaction's life (milliseconds), below a client's patience. The
# default of the node setting `txn_in_doubt_ms` (KVSTORE_TXN_IN_DOUBT_MS).
TXN_IN_DOUBT_AFTER_MS = 5_000
# A decision the coordinator shard has held this long (its driver died before every participant
# resolved, or a participant was away) is resolved again at every participant by the coordinator's
# leader, then forgotten: the default of the node setting `txn_finish_after_ms`.
TXN_FINISH_AFTER_MS = 10_000
# One shard's part of a WriteBatch (one WAL record). The part's bytes are bounded by
# MAX_REQUEST_BYTES and by the WAL's record limit; this bounds the work of one record.
MAX_BATCH_MUTATIONS = 10_000
DEFAULT_SCAN_LIMIT = 100
MAX_SCAN_LIMIT = 1_000
MAX_PENDING_WRITES_PER_SHARD = 10_000  # the group-commit queue; beyond it: RESOURCE_EXHAUSTED
# One WAL transaction (a group commit), the one source of these bounds: the planner
# (kvstore.core.batch) cuts batches by them and the WAL writer is configured with them.
MAX_BATCH_RECORDS = 1_000
MAX_BATCH_BYTES = 4 * 1024 * 1024
# One WAL record: Kafka's default message.max.bytes is 1 MiB per record batch; room is left for
# the envelope (wal.record) around the store's entry.
MAX_WAL_RECORD_BYTES = 1_000_000 - 1024
BATCH_LINGER_MS = 2
# A lone resolve or forget (no client waits on its answer) waits this long for company: the next
# transaction's prepare at the shard then shares its Kafka transaction instead of queueing behind
# it. Cut short by any other write; not taken with a parked write or a linearizable read in flight.
PATIENT_LINGER_MS = 10
MAX_WATCHERS = 1_024
WATCH_QUEUE_EVENTS = 10_000  # per watcher; a watcher that falls this far behind is cut off
WATCH_PROGRESS_MS = 10_000  # default: a progress event per shard at most this often (--watch-progress-ms)
# The size contract of a request, in two refusing zones (docs/limits.md, "Request sizes: two refusing zones"):
# - above MAX_REQUEST_BYTES, up to GRPC_MAX_MESSAGE_BYTES: the store refuses it (the interceptor,
#   before decoding): INVALID_ARGUMENT, ErrorInfo LIMIT_EXCEEDED with limit MAX_REQUEST_BYTES;
# - above GRPC_MAX_MESSAGE_BYTES: gRPC's transport refuses it (the node's receive cap) with
#   RESOURCE_EXHAUSTED and no ErrorInfo; the store's code never sees those bytes, so it cannot
#   say more. Nothing was queued, but a generic client cannot tell (no outcome "none"); the
#   Python client never sends one (it refuses anything above MAX_REQUEST_BYTES itself).
# Raising the cap would only move the transport's zone up: whatever the cap, a node must stop
# reading somewhere, and every call in flight may hold this much of a request in memory. 2 MiB (a
# little over twice MAX_REQUEST_BYTES) leaves the store's own refusal a whole megabyte of room; it
# is also the send cap of nodes and clients (the largest response), and what deployed clients were
# built with. The same value caps node-to-node calls (kvstore.server.peers).
# tests/integration/test_request_size.py pins both zones at their edges; the fuzz test accepts
# an answer without ErrorInfo only in the second (tests/fuzz/contract.py).
GRPC_MAX_MESSAGE_BYTES = 2 * 1024 * 1024
assert MAX_VALUE_BYTES < MAX_REQUEST_BYTES < GRPC_MAX_MESSAGE_BYTES, "the store's refusal needs a zone of its own"
# The size contract of a response: the cap above is also the node's send cap, and an answer above it
# would leave as gRPC's RESOURCE_EXHAUSTED "Sent message larger than max", no ErrorInfo, after the
# work was done (three 900 000-byte values in one Scan page did that). So every answer that gathers
# values is built within MAX_RESPONSE_BYTES, counting every field it carries:
# - a Scan page (and a scan part one node serves another, PeerService.ScanShards) ends early when
#   the next key would not fit, and says there is more exactly as at its `limit`; its first key is
#   always sent, so paging always progresses;
# - a Txn whose answer (its gets' values) would not fit is refused before anything is queued:
#   INVALID_ARGUMENT, ErrorInfo LIMIT_EXCEEDED, limit MAX_RESPONSE_BYTES. A Txn that writes is also
#   bounded by the WAL's record limit (~1 MB), since its answer is stored in its record for retries.
# Every other answer holds at most one value (Get, a Watch event) or no value at all.
# MAX_KEY_VALUE_BYTES is the largest key+value an answer carries with its protobuf framing (the
# three revisions, tags and lengths, a Txn get's wrappers); 64 bytes cover that with room. A single
# one always fits the budget (the first key of a page), and the budget plus one more of them plus
# framing still fits the send cap: even a page whose fixed part (one header per shard, the page
# token) took the budget would stay below it. 1 MiB pages cost a round trip per MiB of values.
MAX_KEY_VALUE_BYTES = MAX_KEY_BYTES + MAX_VALUE_BYTES + 64
MAX_RESPONSE_BYTES = 1024 * 1024
RESPONSE_FRAMING_BYTES = 64 * 1024  # gRPC's frame, a forwarded part's wrapper, a page token: with room
assert MAX_KEY_VALUE_BYTES <= MAX_RESPONSE_BYTES, "a page's first key must fit the response budget alone"
assert MAX_RESPONSE_BYTES + MAX_KEY_VALUE_BYTES + RESPONSE_FRAMING_BYTES <= GRPC_MAX_MESSAGE_BYTES, \
    "a response must stay below gRPC's send cap"

# ---- the request-id (dedupe) table: docs/design.md §4.1, "kept for a documented horizon" ----------------
# Every replica forgets a request id at the same WAL entry, by time and by count, from the leader
# times stamped in the entries (WalEntry.leader_unix_ms), never from its own clock. Changing any of
# these two changes which ids a replica remembers: do it with a kvstore.storage.shard_store FORMAT_VERSION bump
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
