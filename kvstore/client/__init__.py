"""A typed, synchronous client for the store's gRPC API (`kvstore.v1`).

What it adds on top of the generated stubs, and why:

* **Routing.** Writes and linearizable reads must reach the leader of the key's shard
  (docs/design.md §6). The client caches the shard map (`ClusterService.ShardMap`) and sends each
  single-key request to `shard_of(key, shard_count)`'s leader; a node that is not the leader
  answers FAILED_PRECONDITION with `kvstore-leader-hint` and the client goes there and refreshes
  the map. Stale reads, scans and prefix watches may be served by any node.
* **Retries that never duplicate a write, and an honest outcome (W7).** Every write (Put,
  Delete, Txn) carries a request id (a fresh uuid4 hex unless the caller gives one) and
  `first_attempt_unix_ms` (wall-clock time, set once when the request is built unless the caller
  gives the original one); both are the same on every retry, so the store applies the write at
  most once and refuses a retry older than its request-id horizon instead of applying it twice.
  Only the server can say that nothing of a write happened, and it says so with trailing
  metadata `kvstore-outcome: none` (`kvstore.errors`). So a write call ends in one of four ways:

  - it returns: the write committed, once (`replayed` says an earlier attempt did it);
  - `UnknownOutcome`: some attempt may have committed. That is an attempt the server answered
    with `kvstore-outcome: unknown`, or one that failed *without* the `none` tag, whatever the
    code: a dropped connection (UNAVAILABLE "Socket closed"), CANCELLED, INTERNAL, a bare
    UNKNOWN, DEADLINE_EXCEEDED (the per-attempt cap or the call's deadline cutting an attempt
    short), an untagged RESOURCE_EXHAUSTED. Such attempts are retried
    with the same id; the exception carries `request_id` and `first_attempt_unix_ms` to retry
    with later. Once one attempt was unknown, the call never ends in a definite error;
  - `RequestExpired`: the store refused a retry whose id is older than its horizon; this retry
    did nothing, the original attempt's outcome is unknown and cannot be learnt from the store;
  - `Unreachable`: no attempt reached a server, so nothing was sent and nothing committed:
    gRPC itself reported every attempt as never sent (no connection to send it on: connections
    refused, a failed TLS handshake; or a name that did not resolve; `errors.never_sent`);
  - any other `KvError` is definite, nothing of the write committed: every attempt was refused
    with outcome `none` (ErrorInfo, or the `kvstore-outcome` trailer of an older server), the
    client refused the request itself before sending it (above MAX_REQUEST_BYTES), or none was
    sent before the deadline (`DeadlineExceeded`).

  After a definite refusal the client goes to the hinted leader (not-leader), to another node
  (UNAVAILABLE) or backs off (RESOURCE_EXHAUSTED); INVALID_ARGUMENT, request-id-expired and any
  other definite error are raised at once. Reads (Get, Scan, Watch, ShardMap, admin calls)
  change nothing, so they are classified by code alone: UNAVAILABLE, RESOURCE_EXHAUSTED,
  not-leader and `kvstore-outcome: unknown` are retried, anything else is raised. Attempts are
  bounded by `max_attempts` and by the call's deadline, with capped exponential backoff and
  jitter so a crowd of clients does not retry in lockstep.
* **One deadline per call.** `timeout_s` bounds the whole call, retries and backoff included;
  each attempt gets what is left.
* **Plain results and one exception hierarchy** (`KvError`), so callers never touch protobuf
  messages or `grpc.RpcError`.
* **Revisions name their shard.** A revision is an offset in one shard's WAL partition. A get
  reads one shard and takes one `min_revision`; a scan spans shards and takes `min_revisions`
  (shard -> revision, e.g. `revisions_of(...)` of the caller's writes).
* **Watches that are registered when they return** (the server's `created` event; `watch`).
* **TLS and credentials** (`ClientSecurity`: the CA, a client certificate, a bearer token; by
  default from KVSTORE_CA, KVSTORE_CERT, KVSTORE_KEY, KVSTORE_TOKEN, KVSTORE_TOKEN_FILE). A node
  that refuses them answers UNAUTHENTICATED or PERMISSION_DENIED (`Unauthenticated`,
  `PermissionDenied`: definite, never retried).

The package, by concept: `errors` (the hierarchy and the status mapping), `requests` (building
and checking what is sent: bytes, compares, ops, request ids), `results` (what comes back),
`retry` (the pure retry policy), `transport` (channels, routing, one attempt), `security` (TLS
and credentials), `client` (`Client`: the calls and the retry loops, `write_batch` included),
`batch_rounds` (a batch's rounds as a machine without I/O), `admin` (the operators' calls as
data), `batch_buffer` and `batching` (`BatchingWriter`: single writes from many threads sent as
batches), `watch` (`Watch`), `aio` (`AsyncClient`, `AsyncBatchingWriter`: the same over asyncio,
driving the same pure parts). Everything public is re-exported here: `from kvstore.client import
Client, KvError, ...`. Only gRPC and protobuf are needed (the base install): nothing here imports
the server, the WAL, Kafka or LevelDB.

The metadata keys come from `kvstore.errors`, the server's single definition of the contract.
"""

from kvstore.client.batching import BatchingWriter
from kvstore.client.client import Client
from kvstore.client.errors import (
    BatchIncomplete,
    Cancelled,
    Compacted,
    CrossShardTxn,
    DeadlineExceeded,
    InvalidArgument,
    KvError,
    NotLeader,
    Overloaded,
    PermissionDenied,
    PlacementChanged,
    PlacementRefused,
    RequestExpired,
    TxnAborted,
    TxnConflict,
    Unauthenticated,
    Unavailable,
    UnknownOutcome,
    Unreachable,
    error_from_rpc,
    error_from_status,
    write_attempt_is_definite,
)
from kvstore.client.moves import MoveProgress, PlacementChange, ShardMove
from kvstore.client.requests import (
    COMPARE_OPS,
    CONSISTENCIES,
    BytesLike,
    Compare,
    CompareOp,
    Consistency,
    Op,
    to_bytes,
    txn_keys,
    txn_route_key,
    txn_shard,
)
from kvstore.client.results import (
    BatchResult,
    DeleteResult,
    FenceResult,
    GetResult,
    KeyValue,
    NodeInfo,
    PlacementLog,
    PlacementLogEntry,
    PreparedTxn,
    PutResult,
    ReadHeader,
    ReplicaInfo,
    ScanPage,
    ShardInfo,
    ShardMap,
    ShardWrite,
    TransactionInfo,
    TxnOpResult,
    TxnResolution,
    TxnResult,
    WatchEvent,
    revisions_of,
)
from kvstore.client.retry import (
    DEFAULT_ATTEMPT_TIMEOUT_S,
    DEFAULT_MAX_BACKOFF_S,
    RetryAction,
    backoff_delay,
    retry_action,
)
from kvstore.client.security import ClientSecurity
from kvstore.client.transport import DEFAULT_MAX_CHANNELS, MAP_FETCH_TIMEOUT_S, MAX_ENDPOINTS
from kvstore.client.watch import Watch

__all__ = [
    "COMPARE_OPS",
    "CONSISTENCIES",
    "DEFAULT_ATTEMPT_TIMEOUT_S",
    "DEFAULT_MAX_BACKOFF_S",
    "DEFAULT_MAX_CHANNELS",
    "MAP_FETCH_TIMEOUT_S",
    "MAX_ENDPOINTS",
    "BatchIncomplete",
    "BatchResult",
    "BatchingWriter",
    "BytesLike",
    "Cancelled",
    "Client",
    "ClientSecurity",
    "Compacted",
    "Compare",
    "CompareOp",
    "Consistency",
    "CrossShardTxn",
    "DeadlineExceeded",
    "DeleteResult",
    "FenceResult",
    "GetResult",
    "InvalidArgument",
    "KeyValue",
    "KvError",
    "MoveProgress",
    "NodeInfo",
    "NotLeader",
    "Op",
    "Overloaded",
    "PermissionDenied",
    "PlacementChange",
    "PlacementChanged",
    "PlacementLog",
    "PlacementLogEntry",
    "PlacementRefused",
    "PreparedTxn",
    "PutResult",
    "ReadHeader",
    "ReplicaInfo",
    "RequestExpired",
    "RetryAction",
    "ScanPage",
    "ShardInfo",
    "ShardMap",
    "ShardMove",
    "ShardWrite",
    "TransactionInfo",
    "TxnAborted",
    "TxnConflict",
    "TxnOpResult",
    "TxnResolution",
    "TxnResult",
    "Unauthenticated",
    "Unavailable",
    "UnknownOutcome",
    "Unreachable",
    "Watch",
    "WatchEvent",
    "backoff_delay",
    "error_from_rpc",
    "error_from_status",
    "retry_action",
    "revisions_of",
    "to_bytes",
    "txn_keys",
    "txn_route_key",
    "txn_shard",
    "write_attempt_is_definite",
]
