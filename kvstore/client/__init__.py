"""A typed, synchronous client for the store's gRPC API (`kvstore.v1`).

What it adds on top of the generated stubs, and why:

* **Routing.** Writes and linearizable reads must reach the leader of the key's shard
  (DESIGN.md §5). The client caches the shard map (`Cluster.ShardMap`) and sends each
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
    code: a dropped connection (UNAVAILABLE "Socket closed"), a failed connect, CANCELLED,
    INTERNAL, a bare UNKNOWN, DEADLINE_EXCEEDED (the per-attempt cap or the call's deadline
    cutting an attempt short), an untagged RESOURCE_EXHAUSTED (the client does not guess from
    gRPC's wording which of these happened before the request left). Such attempts are retried
    with the same id; the exception carries `request_id` and `first_attempt_unix_ms` to retry
    with later. Once one attempt was unknown, the call never ends in a definite error;
  - `RequestExpired`: the store refused a retry whose id is older than its horizon; this retry
    did nothing, the original attempt's outcome is unknown and cannot be learnt from the store;
  - any other `KvError` is definite, nothing of the write committed: every attempt was refused
    with the `none` tag (or gRPC refused to send it: "Sent message larger than max"), or none was
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

The metadata keys come from `kvstore.errors`, the server's single definition of the contract.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, get_args

import grpc
from google.protobuf.message import Message

from kvstore.core.sharding import shard_of
from kvstore.errors import (
    LEADER_HINT_KEY,
    OUTCOME_KEY,
    OUTCOME_NONE,
    OUTCOME_UNKNOWN,
    REASON_KEY,
    REASON_REQUEST_ID_EXPIRED,
    SHARD_KEY,
)
from kvstore.limits import GRPC_MAX_MESSAGE_BYTES
from kvstore.v1 import cluster_pb2, cluster_pb2_grpc, kv_pb2, kv_pb2_grpc

__all__ = [
    "Cancelled",
    "Client",
    "Compare",
    "Consistency",
    "CrossShardTxn",
    "DeadlineExceeded",
    "DeleteResult",
    "GetResult",
    "InvalidArgument",
    "KeyValue",
    "KvError",
    "NotLeader",
    "Op",
    "Overloaded",
    "PutResult",
    "ReadHeader",
    "RequestExpired",
    "RetryAction",
    "ScanPage",
    "ShardInfo",
    "ShardMap",
    "TxnResult",
    "Unavailable",
    "UnknownOutcome",
    "Watch",
    "WatchEvent",
    "backoff_delay",
    "error_from_rpc",
    "error_from_status",
    "retry_action",
    "to_bytes",
    "txn_keys",
    "txn_shard",
    "write_attempt_is_definite",
]

BytesLike = bytes | str
Consistency = Literal["linearizable", "leader-local", "stale"]
CONSISTENCIES: tuple[str, ...] = get_args(Consistency)
CompareOp = Literal["==", "!=", ">", "<"]
COMPARE_OPS: tuple[str, ...] = get_args(CompareOp)

DEFAULT_MAX_BACKOFF_S = 1.0
# Channels are cheap but not free (a socket and a poller each); the set of addresses a client
# talks to is the cluster's nodes, so a small bound only matters against a misbehaving server
# that hints ever-new addresses.
DEFAULT_MAX_CHANNELS = 64
# One endpoint may be black-holed; fetching the map from it must not eat the whole deadline
# before the next endpoint is tried. ShardMap is answered locally by any node, so this is ample.
MAP_FETCH_TIMEOUT_S = 2.0
MAX_ENDPOINTS = 64  # seeds plus the nodes learned from shard maps
# A healthy node answers well within this (a commit takes milliseconds; a takeover answers
# UNAVAILABLE at once). Longer means it is paused or cut off: try another one.
DEFAULT_ATTEMPT_TIMEOUT_S = 5.0
_CLUSTER_METHODS = frozenset({"ShardMap", "ListTransactions", "FenceShard"})
_JITTER = random.Random()

_CONSISTENCY_PB: dict[str, kv_pb2.Consistency] = {
    "linearizable": kv_pb2.CONSISTENCY_LINEARIZABLE,
    "leader-local": kv_pb2.CONSISTENCY_LEADER_LOCAL,
    "stale": kv_pb2.CONSISTENCY_STALE,
}
_OP_PB: dict[str, kv_pb2.Compare.Op] = {
    "==": kv_pb2.Compare.OP_EQUAL,
    "!=": kv_pb2.Compare.OP_NOT_EQUAL,
    ">": kv_pb2.Compare.OP_GREATER,
    "<": kv_pb2.Compare.OP_LESS,
}


def to_bytes(data: BytesLike, what: str = "key") -> bytes:
    """Keys and values are bytes on the wire; a str is taken as UTF-8 text."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode("utf-8")
    raise InvalidArgument(f"{what} must be bytes or str, not {type(data).__name__}")


# --------------------------------------------------------------------------------------------
# Errors


class KvError(Exception):
    """Base of every error the client raises; `message` is the server's own text.

    `request_id` and `first_attempt_unix_ms` are set for writes: after an `UnknownOutcome` the
    caller may retry with both (`put(..., request_id=e.request_id,
    first_attempt_unix_ms=e.first_attempt_unix_ms)`) and the store applies the write at most
    once, or says `RequestExpired` when it can no longer tell.
    """

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        metadata: Mapping[str, str] | None = None,
        target: str | None = None,
        request_id: str | None = None,
        attempts: int = 1,
        first_attempt_unix_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.metadata: Mapping[str, str] = dict(metadata or {})
        self.target = target
        self.request_id = request_id
        self.attempts = attempts
        self.first_attempt_unix_ms = first_attempt_unix_ms

    def __str__(self) -> str:
        suffix = f" (after {self.attempts} attempts)" if self.attempts > 1 else ""
        return f"{self.message}{suffix}"


class InvalidArgument(KvError, ValueError):
    """The request is malformed or breaks a limit; retrying it cannot succeed."""


class CrossShardTxn(InvalidArgument):
    """A Txn whose keys map to more than one shard; refused before anything is sent."""


class NotLeader(KvError):
    """The node does not lead the key's shard; `leader_hint` is where to go, if it knows."""

    @property
    def leader_hint(self) -> str | None:
        return self.metadata.get(LEADER_HINT_KEY) or None

    @property
    def shard(self) -> int | None:
        raw = self.metadata.get(SHARD_KEY)
        return int(raw) if raw and raw.isdigit() else None


class Unavailable(KvError):
    """No node could serve the request right now (down, bootstrapping, leader changing)."""


class UnknownOutcome(KvError):
    """W7: the write may or may not have committed; retry with the same `request_id` (and
    `first_attempt_unix_ms`), which the store applies at most once. `code` is the code of the
    attempt whose outcome was unknown (UNKNOWN, or e.g. UNAVAILABLE for a dropped connection)."""


class RequestExpired(KvError):
    """The store refused a retry whose request id is older than its request-id horizon: it may
    have forgotten the id, so applying the retry could apply the write twice. This retry did
    nothing; whether the original attempt committed is unknown and the store can no longer tell
    (read the data to find out). Never retried: the same id would be refused again."""


class Overloaded(KvError):
    """A bounded server queue was full; nothing was done."""


class DeadlineExceeded(KvError):
    """The call's deadline passed. For a write this is definite: no attempt was sent, or every
    one was refused with `kvstore-outcome: none`; a deadline that cut an attempt of a write
    short is an `UnknownOutcome` instead."""


class Cancelled(KvError):
    """The call was cancelled (e.g. the client was closed under it)."""


def _metadata_dict(raw: Iterable[Any] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in raw or ():
        key, value = item[0], item[1]
        out[str(key).lower()] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return out


def write_attempt_is_definite(code: grpc.StatusCode, details: str, metadata: Mapping[str, str]) -> bool:
    """Whether a failed attempt of a write certainly committed nothing (DESIGN.md §3, W7).

    Only the server knows, and it says so with `kvstore-outcome: none`. Anything else (a dropped
    connection, a cancellation, a deadline, a proxy's or the runtime's error) may have happened
    after the server queued the write. The one exception is gRPC refusing a message for its
    size before any handler ran: the client's "Sent message larger than max" (it never left)
    and the server runtime's "SERVER: Received message larger than max". A response too large
    for the client ("CLIENT: Received ...", or an unprefixed "Received ..." from an older
    runtime that does not say which side) came after the handler ran: not definite.
    """
    if metadata.get(OUTCOME_KEY) == OUTCOME_NONE:
        return True
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and (
        "Sent message larger than max" in details or "SERVER: Received message larger than max" in details
    )


def error_from_status(
    code: grpc.StatusCode,
    details: str,
    metadata: Mapping[str, str],
    *,
    target: str | None = None,
    request_id: str | None = None,
    write: bool = False,
) -> KvError:
    """The client's one mapping from a gRPC status (plus `kvstore-*` metadata) to an exception.

    `write`: the attempt was a Put, Delete or Txn, for which an error that is not definite
    (`write_attempt_is_definite`) is an `UnknownOutcome` whatever its code. A read changes
    nothing, so it is mapped by its code alone."""
    kwargs: dict[str, Any] = {"code": code, "metadata": metadata, "target": target, "request_id": request_id}
    message = details or code.name
    if code == grpc.StatusCode.FAILED_PRECONDITION and metadata.get(REASON_KEY) == REASON_REQUEST_ID_EXPIRED:
        return RequestExpired(_expired_message(details, request_id), **kwargs)
    if write and not write_attempt_is_definite(code, details, metadata):
        return UnknownOutcome(message, **kwargs)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message, **kwargs)
    if code == grpc.StatusCode.FAILED_PRECONDITION and (LEADER_HINT_KEY in metadata or SHARD_KEY in metadata):
        return NotLeader(message, **kwargs)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(message, **kwargs)
    if code == grpc.StatusCode.UNKNOWN and metadata.get(OUTCOME_KEY) == OUTCOME_UNKNOWN:
        return UnknownOutcome(message, **kwargs)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if _is_grpc_size_limit(details):
            return InvalidArgument(message, **kwargs)
        return Overloaded(message, **kwargs)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message, **kwargs)
    if code == grpc.StatusCode.CANCELLED:
        return Cancelled(message, **kwargs)
    return KvError(message, **kwargs)


def _expired_message(details: str, request_id: str | None) -> str:
    # Whatever the server's wording, the caller must read that the outcome is unknown, not that
    # the write failed: the first attempt may well have committed.
    which = f"request id {request_id}" if request_id else "the request id"
    reason = f" ({details})" if details else ""
    return (f"{which} expired: it is older than the store's request-id horizon, so this retry was refused and "
            f"not applied; whether the original attempt committed is unknown and the store can no longer "
            f"tell{reason}")


def _is_grpc_size_limit(details: str) -> bool:
    # gRPC itself reports an oversized message as RESOURCE_EXHAUSTED; that is a broken limit,
    # not a full queue, and retrying it would only send the same bytes again. (For a write only
    # the sizes gRPC refused before a handler ran are definite: `write_attempt_is_definite`.)
    return "larger than max" in details


def error_from_rpc(
    exc: Any, *, target: str | None = None, request_id: str | None = None, write: bool = False
) -> KvError:
    """Map a `grpc.RpcError` (anything with code/details/trailing_metadata) to a `KvError`."""
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    trailing = exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else None
    return error_from_status(
        code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN,
        str(details or ""),
        _metadata_dict(trailing),
        target=target,
        request_id=request_id,
        write=write,
    )


class RetryAction(enum.Enum):
    """What the retry loop does after an attempt failed."""

    FAIL = "fail"  # raise now: retrying cannot help (or could do harm)
    REDIRECT = "redirect"  # go to the leader hint at once
    REROUTE = "reroute"  # refresh the shard map, try the next endpoint, back off
    BACKOFF = "backoff"  # same target, after a backoff


def retry_action(error: KvError) -> RetryAction:
    """Classify a failed attempt. Pure: the retry policy in one place, table-tested."""
    if isinstance(error, NotLeader):
        return RetryAction.REDIRECT if error.leader_hint else RetryAction.REROUTE
    if isinstance(error, Unavailable | UnknownOutcome):
        # An unknown outcome usually means the leader lost its shard (or its connection)
        # mid-commit: look again. The retry carries the same request id.
        return RetryAction.REROUTE
    if isinstance(error, Overloaded):
        return RetryAction.BACKOFF
    return RetryAction.FAIL


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Delay before attempt `attempt + 1`: exponential, capped, with "equal jitter".

    Half of the delay is fixed so retries still spread out in time; the other half is random so
    clients that failed together do not come back together.
    """
    ceiling = min(cap_s, base_s * 2.0 ** max(0, attempt - 1))
    half = ceiling / 2
    return half + (rng or _JITTER).uniform(0.0, half)


# --------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    version: int  # writes since the key was (re)created; 1 after the first put
    mod_revision: int  # WAL offset of the last write
    create_revision: int  # WAL offset of the write that created it

    @classmethod
    def from_pb(cls, kv: kv_pb2.KeyValue) -> KeyValue:
        return cls(kv.key, kv.value, kv.version, kv.mod_revision, kv.create_revision)


@dataclasses.dataclass(frozen=True, slots=True)
class ReadHeader:
    """Where a read was served and how fresh it was (everything below `applied_revision`)."""

    shard: int
    applied_revision: int
    served_by: str

    @classmethod
    def from_pb(cls, header: kv_pb2.ReadHeader) -> ReadHeader:
        return cls(header.shard, header.applied_revision, header.served_by)


@dataclasses.dataclass(frozen=True, slots=True)
class GetResult:
    """`header` is None inside a Txn, which reads the state its compares saw."""

    key: bytes
    found: bool
    kv: KeyValue | None
    header: ReadHeader | None

    @property
    def value(self) -> bytes | None:
        return self.kv.value if self.kv is not None else None

    @classmethod
    def from_pb(cls, key: bytes, resp: kv_pb2.GetResponse) -> GetResult:
        kv = KeyValue.from_pb(resp.kv) if resp.found else None
        header = ReadHeader.from_pb(resp.header) if resp.HasField("header") else None
        return cls(key, resp.found, kv, header)


@dataclasses.dataclass(frozen=True, slots=True)
class PutResult:
    """`revision` is a token: a later read with `min_revision=revision` sees this write."""

    key: bytes
    shard: int
    revision: int
    version: int
    replayed: bool  # True when the store answered a retry with the original result
    request_id: str

    @classmethod
    def from_pb(cls, key: bytes, resp: kv_pb2.PutResponse, request_id: str) -> PutResult:
        r = resp.result
        return cls(key, r.shard, r.revision, resp.version, r.replayed, request_id)


@dataclasses.dataclass(frozen=True, slots=True)
class DeleteResult:
    key: bytes
    shard: int
    revision: int
    deleted: bool  # False when the key did not exist
    replayed: bool
    request_id: str

    @classmethod
    def from_pb(cls, key: bytes, resp: kv_pb2.DeleteResponse, request_id: str) -> DeleteResult:
        r = resp.result
        return cls(key, r.shard, r.revision, resp.deleted, r.replayed, request_id)


TxnOpResult = PutResult | DeleteResult | GetResult


@dataclasses.dataclass(frozen=True, slots=True)
class TxnResult:
    """`succeeded` says which branch ran; `results` has one entry per op of that branch."""

    succeeded: bool
    shard: int
    revision: int | None  # None when the branch that ran wrote nothing
    replayed: bool
    results: tuple[TxnOpResult, ...]
    request_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class ScanPage:
    kvs: tuple[KeyValue, ...]
    next_page_token: bytes  # empty when there is nothing more
    headers: tuple[ReadHeader, ...]

    @property
    def more(self) -> bool:
        return bool(self.next_page_token)


@dataclasses.dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["put", "delete", "unknown"]
    kv: KeyValue  # for deletes: key and mod_revision only
    shard: int

    @classmethod
    def from_pb(cls, ev: kv_pb2.WatchEvent) -> WatchEvent:
        kind: Literal["put", "delete", "unknown"] = (
            "put" if ev.type == kv_pb2.WatchEvent.TYPE_PUT
            else "delete" if ev.type == kv_pb2.WatchEvent.TYPE_DELETE
            else "unknown"
        )
        return cls(kind, KeyValue.from_pb(ev.kv), ev.shard)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardInfo:
    shard: int
    leader: str  # gRPC address; empty when the shard has no leader right now
    term: int
    applied_offset: int
    end_offset: int
    lag: int
    open_txn_age_ms: int
    leader_id: str = ""  # node id of the leader (or of the node taking over)
    leader_ready: bool = False  # False while the assigned node fences and bootstraps


@dataclasses.dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    address: str
    leads: tuple[int, ...]
    pid: int
    can_lead: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ShardMap:
    shard_count: int
    topic: str
    served_by: str
    shards: tuple[ShardInfo, ...]
    nodes: tuple[NodeInfo, ...] = ()

    def node(self, node_id: str) -> NodeInfo | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def leader_of(self, shard: int) -> str:
        """The leader's address, or "" when unknown."""
        for info in self.shards:
            if info.shard == shard:
                return info.leader
        return ""

    @classmethod
    def from_pb(cls, resp: cluster_pb2.ShardMapResponse) -> ShardMap:
        shards = tuple(
            ShardInfo(s.shard, s.leader, s.term, s.applied_offset, s.end_offset, s.lag, s.open_txn_age_ms,
                      s.leader_id, s.leader_ready)
            for s in resp.shards
        )
        nodes = tuple(NodeInfo(n.node_id, n.address, tuple(n.leads), n.pid, n.can_lead) for n in resp.nodes)
        return cls(resp.shard_count, resp.topic, resp.served_by, shards, nodes)


@dataclasses.dataclass(frozen=True, slots=True)
class TransactionInfo:
    shard: int
    first_offset: int
    end_offset: int
    age_ms: int
    leader_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class FenceResult:
    shard: int
    end_offset: int
    notified: str  # the leader node told to check, "" if none


# --------------------------------------------------------------------------------------------
# Txn building blocks


@dataclasses.dataclass(frozen=True, slots=True)
class Compare:
    """One guard of a Txn. Build with `Compare.version(k, "==", 0)` and friends.

    A missing key has version 0 and mod_revision 0; `value(k, "!=", x)` holds for it.
    """

    key: bytes
    target: Literal["version", "value", "exists", "mod_revision"]
    op: CompareOp
    operand: int | bytes | bool

    def __post_init__(self) -> None:
        if self.op not in COMPARE_OPS:
            raise InvalidArgument(f"compare operator must be one of {', '.join(COMPARE_OPS)}: {self.op!r}")

    @classmethod
    def version(cls, key: BytesLike, op: CompareOp, version: int) -> Compare:
        """`version(k, "==", 0)` is "k does not exist"."""
        return cls(to_bytes(key), "version", op, int(version))

    @classmethod
    def value(cls, key: BytesLike, op: CompareOp, value: BytesLike) -> Compare:
        return cls(to_bytes(key), "value", op, to_bytes(value, "value"))

    @classmethod
    def exists(cls, key: BytesLike, exists: bool = True) -> Compare:
        return cls(to_bytes(key), "exists", "==", bool(exists))

    @classmethod
    def mod_revision(cls, key: BytesLike, op: CompareOp, revision: int) -> Compare:
        return cls(to_bytes(key), "mod_revision", op, int(revision))

    def to_pb(self) -> kv_pb2.Compare:
        pb = kv_pb2.Compare(key=self.key, op=_OP_PB[self.op])
        if self.target == "version":
            pb.target, pb.version = kv_pb2.Compare.TARGET_VERSION, int(self.operand)
        elif self.target == "mod_revision":
            pb.target, pb.mod_revision = kv_pb2.Compare.TARGET_MOD_REVISION, int(self.operand)
        elif self.target == "exists":
            pb.target, pb.exists = kv_pb2.Compare.TARGET_EXISTS, bool(self.operand)
        else:
            assert isinstance(self.operand, bytes), "a value compare needs a bytes operand"
            pb.target, pb.value = kv_pb2.Compare.TARGET_VALUE, self.operand
        return pb


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One operation of a Txn branch: `Op.put(k, v)`, `Op.delete(k)`, `Op.get(k)`."""

    kind: Literal["put", "delete", "get"]
    key: bytes
    value: bytes = b""

    @classmethod
    def put(cls, key: BytesLike, value: BytesLike) -> Op:
        return cls("put", to_bytes(key), to_bytes(value, "value"))

    @classmethod
    def delete(cls, key: BytesLike) -> Op:
        return cls("delete", to_bytes(key))

    @classmethod
    def get(cls, key: BytesLike) -> Op:
        """Reads the state the compares saw, i.e. before this Txn's own writes."""
        return cls("get", to_bytes(key))

    def to_pb(self) -> kv_pb2.TxnOp:
        if self.kind == "put":
            return kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=self.key, value=self.value))
        if self.kind == "delete":
            return kv_pb2.TxnOp(delete=kv_pb2.DeleteRequest(key=self.key))
        return kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=self.key))


def txn_keys(compares: Iterable[Compare], success: Iterable[Op], failure: Iterable[Op]) -> list[bytes]:
    """Every key a Txn touches, in first-seen order, without duplicates."""
    keys = itertools.chain((c.key for c in compares), (o.key for o in success), (o.key for o in failure))
    return list(dict.fromkeys(keys))


def txn_shard(
    compares: Iterable[Compare], success: Iterable[Op], failure: Iterable[Op], shard_count: int
) -> int | None:
    """The one shard a Txn's keys live on (None for a Txn without keys).

    A Txn is atomic only within a shard (one WAL partition), so keys on different shards are
    refused here, with the offending keys named, instead of as a bare INVALID_ARGUMENT later.
    """
    by_shard: dict[int, list[bytes]] = {}
    for key in txn_keys(compares, success, failure):
        by_shard.setdefault(shard_of(key, shard_count), []).append(key)
    if len(by_shard) > 1:
        detail = "; ".join(
            f"shard {s}: {', '.join(_show_key(k) for k in keys)}" for s, keys in sorted(by_shard.items())
        )
        raise CrossShardTxn(f"a txn must stay within one shard, but its keys span {len(by_shard)} shards ({detail})")
    return next(iter(by_shard), None)


def _show_key(key: bytes) -> str:
    text = key.decode("utf-8", "backslashreplace")
    return repr(text if len(text) <= 40 else text[:37] + "...")


# --------------------------------------------------------------------------------------------
# Client

R = TypeVar("R", bound=Message)


@dataclasses.dataclass(slots=True)
class _Conn:
    channel: Any
    kv: Any
    cluster: Any


class Client:
    """A connection to a kvstore cluster; thread-safe, use one per process.

    `endpoints` are seed addresses ("host:port"); the client learns the leaders from the shard
    map. `timeout_s` is the default deadline of every call (retries included), overridable per
    call; `max_attempts` bounds the tries of one call; `backoff_s` is the first backoff, doubled
    per attempt up to `max_backoff_s`. `attempt_timeout_s` caps one attempt, so a node that
    stopped answering (a paused process, a black hole) costs that much, not the whole deadline:
    the attempt counts as "outcome unknown" and is retried elsewhere with the same request id.

    Writes (`put`, `delete`, `txn`) return only once committed, raise `UnknownOutcome` when any
    attempt may have committed (retry later with its `request_id` and `first_attempt_unix_ms`),
    `RequestExpired` when the store refused such a retry as too old (outcome unknown for good),
    and any other `KvError` only when nothing of the write committed (see the module docstring).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 5.0,
        max_attempts: int = 6,
        backoff_s: float = 0.05,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        max_channels: int = DEFAULT_MAX_CHANNELS,
        attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S,
    ) -> None:
        if isinstance(endpoints, str):  # a str is a Sequence[str] of characters: accept "a:1,b:2"
            endpoints = endpoints.split(",")
        self._endpoints = tuple(dict.fromkeys(e.strip() for e in endpoints if e.strip()))
        if not self._endpoints:
            raise InvalidArgument("at least one endpoint is needed")
        if timeout_s <= 0 or max_attempts < 1 or backoff_s < 0 or max_backoff_s < 0 or max_channels < 1:
            raise InvalidArgument("timeout_s must be > 0, max_attempts and max_channels >= 1, backoffs >= 0")
        self._timeout_s = timeout_s
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._max_channels = max_channels
        if attempt_timeout_s <= 0:
            raise InvalidArgument(f"attempt_timeout_s must be > 0: {attempt_timeout_s}")
        self._attempt_timeout_s = attempt_timeout_s
        self._lock = threading.Lock()
        self._conns: collections.OrderedDict[str, _Conn] = collections.OrderedDict()
        self._map: ShardMap | None = None
        self._shard_count: int | None = None  # fixed at cluster creation: survives map refreshes
        self._cursor = 0  # index into endpoints of the node used for "any node" requests
        self._closed = False
        # Seams for tests: no real sleeping, deterministic jitter.
        self._sleep: Callable[[float], None] = time.sleep
        self._rng = random.Random()

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close every channel; calls in flight (and watches) end with `Cancelled`."""
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            conn.channel.close()

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self._endpoints

    # -- the API -----------------------------------------------------------------------------

    def get(
        self,
        key: BytesLike,
        consistency: Consistency = "linearizable",
        min_revision: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> GetResult:
        """Read one key. `stale` may be served by any node; `min_revision` makes it wait for it."""
        k = to_bytes(key)
        read = kv_pb2.ReadOptions(consistency=_consistency(consistency))
        if min_revision is not None:
            read.min_revision = min_revision
        resp = self._call(
            "Get", kv_pb2.GetRequest(key=k, read=read), kv_pb2.GetResponse,
            key=None if consistency == "stale" else k, timeout_s=timeout_s,
        )
        return GetResult.from_pb(k, resp)

    def put(
        self,
        key: BytesLike,
        value: BytesLike,
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
        first_attempt_unix_ms: int | None = None,
    ) -> PutResult:
        """Write one key; answered once its WAL batch committed.

        To finish a write that ended in `UnknownOutcome` (say, in another process), pass its
        `request_id` and `first_attempt_unix_ms`: the store applies it at most once, and refuses
        it with `RequestExpired` if it is older than what the store remembers. Without
        `first_attempt_unix_ms` the first attempt is now, which is right only for a new id."""
        k, rid = to_bytes(key), _request_id(request_id)
        first_ms = _first_attempt_unix_ms(first_attempt_unix_ms, request_id)
        request = kv_pb2.PutRequest(key=k, value=to_bytes(value, "value"), request_id=rid,
                                    first_attempt_unix_ms=first_ms)
        resp = self._call("Put", request, kv_pb2.PutResponse, key=k, timeout_s=timeout_s, request_id=rid,
                          write=True, first_attempt_unix_ms=first_ms)
        return PutResult.from_pb(k, resp, rid)

    def delete(
        self,
        key: BytesLike,
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
        first_attempt_unix_ms: int | None = None,
    ) -> DeleteResult:
        """Delete one key (not an error if it does not exist); ids and outcomes as in `put`."""
        k, rid = to_bytes(key), _request_id(request_id)
        first_ms = _first_attempt_unix_ms(first_attempt_unix_ms, request_id)
        request = kv_pb2.DeleteRequest(key=k, request_id=rid, first_attempt_unix_ms=first_ms)
        resp = self._call("Delete", request, kv_pb2.DeleteResponse, key=k, timeout_s=timeout_s, request_id=rid,
                          write=True, first_attempt_unix_ms=first_ms)
        return DeleteResult.from_pb(k, resp, rid)

    def txn(
        self,
        compares: Sequence[Compare] = (),
        success: Sequence[Op] = (),
        failure: Sequence[Op] = (),
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
        first_attempt_unix_ms: int | None = None,
    ) -> TxnResult:
        """Run `success` if every compare holds, else `failure`, atomically, within one shard.

        Raises `CrossShardTxn` before sending when the keys span shards. Ids and outcomes as in
        `put` (a Txn is a write, even when its branch only reads).
        """
        rid = _request_id(request_id)
        first_ms = _first_attempt_unix_ms(first_attempt_unix_ms, request_id)
        deadline = self._deadline(timeout_s)
        keys = txn_keys(compares, success, failure)
        shard_count = self._known_shard_count(deadline)
        if shard_count is not None:
            txn_shard(compares, success, failure, shard_count)
        # else: no node answered the map; the server applies the same check.
        request = kv_pb2.TxnRequest(
            compares=[c.to_pb() for c in compares],
            success=[o.to_pb() for o in success],
            failure=[o.to_pb() for o in failure],
            request_id=rid,
            first_attempt_unix_ms=first_ms,
        )
        resp = self._call(
            "Txn", request, kv_pb2.TxnResponse, key=keys[0] if keys else None, deadline=deadline, request_id=rid,
            write=True, first_attempt_unix_ms=first_ms,
        )
        branch = success if resp.succeeded else failure
        results = tuple(_txn_op_result(op, r, rid) for op, r in zip(branch, resp.results, strict=False))
        w = resp.result
        revision = w.revision if w.HasField("revision") else None
        return TxnResult(resp.succeeded, w.shard, revision, w.replayed, results, rid)

    def scan(
        self,
        start: BytesLike = b"",
        end: BytesLike = b"",
        prefix: BytesLike = b"",
        limit: int = 0,
        consistency: Consistency = "linearizable",
        *,
        page_token: bytes = b"",
        keys_only: bool = False,
        timeout_s: float | None = None,
    ) -> ScanPage:
        """One page of `[start, end)` or of `prefix`, in key order across all shards.

        Any node can answer (it gathers from the shards itself). `limit` 0 = server default.
        """
        request = _scan_request(start, end, prefix, limit, consistency, keys_only)
        request.page_token = page_token
        resp = self._call("Scan", request, kv_pb2.ScanResponse, key=None, timeout_s=timeout_s)
        return ScanPage(
            tuple(KeyValue.from_pb(kv) for kv in resp.kvs),
            resp.next_page_token,
            tuple(ReadHeader.from_pb(h) for h in resp.headers),
        )

    def scan_all(
        self,
        start: BytesLike = b"",
        end: BytesLike = b"",
        prefix: BytesLike = b"",
        limit: int = 0,
        consistency: Consistency = "linearizable",
        *,
        keys_only: bool = False,
        timeout_s: float | None = None,
    ) -> Iterator[KeyValue]:
        """Every key of the range, page by page (`limit` is the page size); each page is a call
        with its own deadline, so a long scan is not cut off by one timeout."""
        _scan_request(start, end, prefix, limit, consistency, keys_only)  # fail early, before iterating
        token = b""
        while True:
            page = self.scan(
                start, end, prefix, limit, consistency, page_token=token, keys_only=keys_only, timeout_s=timeout_s
            )
            yield from page.kvs
            if not page.next_page_token:
                return
            token = page.next_page_token

    def watch(
        self,
        key: BytesLike = b"",
        prefix: BytesLike = b"",
        start_revision: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> Watch:
        """Changes to `key` (or every key under `prefix`) from `start_revision` on (None = from now).

        Returns an iterator of `WatchEvent`s; `cancel()` (or leaving its `with` block) ends it.
        The stream itself has no deadline unless `timeout_s` is given: it is meant to last.
        """
        k, p = to_bytes(key), to_bytes(prefix, "prefix")
        if bool(k) == bool(p):
            raise InvalidArgument("watch needs exactly one of key or prefix")
        request = kv_pb2.WatchRequest(key=k, prefix=p)
        if start_revision is not None:
            request.start_revision = start_revision
        return Watch(self, request, k or None, timeout_s)

    def shard_map(self, *, timeout_s: float | None = None) -> ShardMap:
        """Fetch the current shard map from any endpoint (and refresh the routing cache)."""
        deadline = self._deadline(timeout_s)
        # With several endpoints, one black-holed node must not eat the whole deadline.
        cap_s = MAP_FETCH_TIMEOUT_S if len(self._endpoints) > 1 else None
        last: KvError | None = None
        attempts = 0
        while attempts < self._max_attempts:
            for _ in range(len(self._endpoints)):
                if attempts >= self._max_attempts or deadline - time.monotonic() <= 0:
                    break
                attempts += 1
                try:
                    return self._fetch_map(self._any_endpoint(), deadline, cap_s, full=True)
                except KvError as error:
                    last = error
                    self._rotate()
                    # A deadline here is the per-endpoint cap (a node not answering): next one.
                    if retry_action(error) is RetryAction.FAIL and not isinstance(error, DeadlineExceeded):
                        raise
            if attempts >= self._max_attempts or deadline - time.monotonic() <= 0:
                break
            self._sleep_backoff(attempts, deadline)
        raise self._give_up(last, attempts, None)

    def list_transactions(self, older_than_ms: int = 0, *, timeout_s: float | None = None) -> list[TransactionInfo]:
        """Shards whose WAL transaction has been open at least `older_than_ms` (seed 004)."""
        if older_than_ms < 0:
            raise InvalidArgument(f"older_than_ms must be >= 0: {older_than_ms}")
        resp = self._call("ListTransactions", cluster_pb2.ListTransactionsRequest(older_than_ms=older_than_ms),
                          cluster_pb2.ListTransactionsResponse, key=None, timeout_s=timeout_s)
        return [TransactionInfo(t.shard, t.first_offset, t.end_offset, t.age_ms, t.leader_id)
                for t in resp.transactions]

    def fence(self, shard: int, *, timeout_s: float | None = None) -> FenceResult:
        """Force-terminate `shard`'s transaction (a fresh init_transactions on its id). The live
        leader finds itself fenced, steps down, and leadership settles again by itself."""
        if shard < 0:
            raise InvalidArgument(f"shard must be >= 0: {shard}")
        resp = self._call("FenceShard", cluster_pb2.FenceShardRequest(shard=shard), cluster_pb2.FenceShardResponse,
                          key=None, timeout_s=timeout_s)
        return FenceResult(resp.shard, resp.end_offset, resp.notified)

    # -- internals: routing ------------------------------------------------------------------

    def _deadline(self, timeout_s: float | None) -> float:
        t = self._timeout_s if timeout_s is None else timeout_s
        if t <= 0:
            raise InvalidArgument(f"timeout must be positive: {t}")
        return time.monotonic() + t

    def _any_endpoint(self) -> str:
        with self._lock:
            return self._endpoints[self._cursor % len(self._endpoints)]

    def _rotate(self, failed: str | None = None) -> None:
        """Move "any node" on to the next endpoint (if `failed` was the current one)."""
        with self._lock:
            current = self._endpoints[self._cursor % len(self._endpoints)]
            if failed is None or failed == current:
                self._cursor += 1

    def _invalidate_map(self) -> None:
        with self._lock:
            self._map = None

    def _fetch_map(self, target: str, deadline: float, cap_s: float | None, *, full: bool = False) -> ShardMap:
        """`full`: the merged map (every node asked: terms, offsets, nodes). Routing needs only
        the answering node's own view (leaders from the consumer group), which is cheap."""
        remaining = deadline - time.monotonic()
        timeout = min(remaining, cap_s) if cap_s is not None else remaining
        try:
            resp = self._invoke(target, "ShardMap", cluster_pb2.ShardMapRequest(local_only=not full),
                                max(timeout, 0.001))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, target=target) from None
        if not isinstance(resp, cluster_pb2.ShardMapResponse):
            raise KvError(f"unexpected response from {target}: {type(resp).__name__}", target=target)
        smap = ShardMap.from_pb(resp)
        if smap.shard_count > 0:
            with self._lock:
                self._map = smap
                self._shard_count = smap.shard_count
                # Learn the other nodes, so that losing every seed endpoint does not lose the
                # cluster (bounded: a map cannot grow the list without limit).
                seen = [n.address for n in smap.nodes] + [s.leader for s in smap.shards]
                learned = list(dict.fromkeys(a for a in seen if a and a not in self._endpoints))
                room = MAX_ENDPOINTS - len(self._endpoints)
                if learned and room > 0:
                    self._endpoints = self._endpoints + tuple(learned[:room])
        return smap

    def _cached_map(self, deadline: float) -> ShardMap | None:
        """The cached map, fetched (one try per endpoint) if there is none; None if none answered."""
        with self._lock:
            if self._map is not None:
                return self._map
        for _ in range(len(self._endpoints)):
            if deadline - time.monotonic() <= 0:
                return None
            target = self._any_endpoint()
            try:
                smap = self._fetch_map(target, deadline, MAP_FETCH_TIMEOUT_S)
            except KvError:
                self._rotate(target)
                continue
            return smap if smap.shard_count > 0 else None
        return None

    def _known_shard_count(self, deadline: float) -> int | None:
        with self._lock:
            if self._shard_count is not None:
                return self._shard_count
        smap = self._cached_map(deadline)
        return smap.shard_count if smap is not None else None

    def _route(self, key: bytes | None, deadline: float) -> str:
        """The leader of `key`'s shard when known; otherwise any endpoint (which will hint)."""
        if key is None:
            return self._any_endpoint()
        smap = self._cached_map(deadline)
        if smap is None:
            return self._any_endpoint()
        return smap.leader_of(shard_of(key, smap.shard_count)) or self._any_endpoint()

    # -- internals: calls and retries --------------------------------------------------------

    def _conn(self, target: str) -> _Conn:
        with self._lock:
            if self._closed:
                raise KvError("the client is closed", target=target)
            conn = self._conns.get(target)
            if conn is not None:
                self._conns.move_to_end(target)
                return conn
            channel = grpc.insecure_channel(
                target,
                options=[
                    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
                ],
            )
            kv_stub: Any = kv_pb2_grpc.KVStub
            cluster_stub: Any = cluster_pb2_grpc.ClusterStub
            conn = _Conn(channel, kv_stub(channel), cluster_stub(channel))
            self._conns[target] = conn
            evicted = self._conns.popitem(last=False)[1] if len(self._conns) > self._max_channels else None
        if evicted is not None:
            evicted.channel.close()
        return conn

    def _invoke(self, target: str, method: str, request: Message, timeout: float) -> Message:
        """One attempt: one RPC to one node. Raises `grpc.RpcError`. (The seam unit tests replace.)"""
        conn = self._conn(target)
        stub = conn.cluster if method in _CLUSTER_METHODS else conn.kv
        response: Message = getattr(stub, method)(request, timeout=timeout)
        return response

    def _sleep_backoff(self, attempt: int, deadline: float) -> None:
        delay = backoff_delay(attempt, self._backoff_s, self._max_backoff_s, self._rng)
        delay = min(delay, max(0.0, deadline - time.monotonic()))
        if delay > 0:
            self._sleep(delay)

    def _give_up(self, last: KvError | None, attempts: int, request_id: str | None) -> KvError:
        if last is None:
            return DeadlineExceeded("deadline exceeded before any attempt", request_id=request_id)
        last.attempts = max(attempts, 1)
        return last

    def _call(
        self,
        method: str,
        request: Message,
        response_type: type[R],
        *,
        key: bytes | None,
        timeout_s: float | None = None,
        deadline: float | None = None,
        request_id: str | None = None,
        write: bool = False,
        first_attempt_unix_ms: int | None = None,
    ) -> R:
        """Run one request with routing and bounded retries; the request (and so its request
        id and first-attempt time) is the same object on every attempt.

        `write`: a Put, Delete or Txn, whose errors are classified for W7 (module docstring);
        an error it raises carries `request_id` and `first_attempt_unix_ms` to retry with."""
        try:
            return self._attempts(method, request, response_type, key=key, timeout_s=timeout_s, deadline=deadline,
                                  request_id=request_id, write=write)
        except KvError as error:
            if write:
                error.request_id = request_id
                error.first_attempt_unix_ms = first_attempt_unix_ms
            raise

    def _attempts(
        self,
        method: str,
        request: Message,
        response_type: type[R],
        *,
        key: bytes | None,
        timeout_s: float | None,
        deadline: float | None,
        request_id: str | None,
        write: bool,
    ) -> R:
        if deadline is None:
            deadline = self._deadline(timeout_s)
        hint: str | None = None
        last: KvError | None = None
        unknown: UnknownOutcome | None = None  # an earlier attempt may have committed (W7)
        attempt = 0
        while attempt < self._max_attempts:
            if deadline - time.monotonic() <= 0:
                break
            attempt += 1
            target = hint or self._route(key, deadline)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            capped = remaining > self._attempt_timeout_s
            try:
                response = self._invoke(target, method, request, min(remaining, self._attempt_timeout_s))
            except grpc.RpcError as exc:
                error = error_from_rpc(exc, target=target, request_id=request_id, write=write)
                if capped and error.code == grpc.StatusCode.DEADLINE_EXCEEDED and \
                        isinstance(error, DeadlineExceeded | UnknownOutcome):
                    # Our per-attempt cap, not the caller's deadline: the node is not answering.
                    # A write may have committed there (W7); the retry carries the same id.
                    error = UnknownOutcome(f"{target} did not answer within {self._attempt_timeout_s}s",
                                           code=grpc.StatusCode.DEADLINE_EXCEEDED, target=target,
                                           request_id=request_id)
            except KvError as closed:  # the client was closed under the call: nothing sent this time
                closed.attempts = attempt
                raise _keep_unknown(closed, unknown, write=write) from None
            else:
                if not isinstance(response, response_type):
                    raise KvError(f"unexpected response from {target}: {type(response).__name__}", target=target)
                return response
            if isinstance(error, UnknownOutcome):
                unknown = error
            action = retry_action(error)
            if action is RetryAction.FAIL:
                error.attempts = attempt
                raise _keep_unknown(error, unknown, write=write)
            last = error
            if attempt >= self._max_attempts:
                break
            if action is RetryAction.REDIRECT:
                assert isinstance(error, NotLeader)
                self._invalidate_map()
                new_hint = error.leader_hint
                if new_hint and new_hint != target:
                    hint = new_hint
                    continue  # a fresh node: no reason to wait
                hint = None
            elif action is RetryAction.REROUTE:
                self._invalidate_map()
                self._rotate(target)
                hint = None
            # BACKOFF: keep the target (and any hint).
            self._sleep_backoff(attempt, deadline)
        if last is not None and deadline - time.monotonic() <= 0:
            if write and unknown is not None:
                # W7: the deadline ends the retries, not the uncertainty of the unknown attempt.
                then = "" if last is unknown else f"; the retries then failed: {last.message}"
                raise UnknownOutcome(
                    f"deadline exceeded, outcome unknown: {unknown.message}{then}", code=unknown.code,
                    metadata=unknown.metadata, target=unknown.target, request_id=request_id, attempts=attempt,
                )
            raise DeadlineExceeded(
                f"deadline exceeded; last error: {last.message}",
                code=grpc.StatusCode.DEADLINE_EXCEEDED, target=last.target, request_id=request_id, attempts=attempt,
            )
        raise _keep_unknown(self._give_up(last, attempt, request_id), unknown, write=write)


def _keep_unknown(error: KvError, unknown: UnknownOutcome | None, *, write: bool = False) -> KvError:
    """W7 for the caller: once an attempt's outcome was unknown, a later "nothing was done"
    (unavailable, not leader, overloaded, invalid, a deadline, ...) says nothing about that
    attempt, so the call as a whole still has an unknown outcome and must not look like a clean
    failure. `RequestExpired` already says the outcome is unknown (and that retrying is futile):
    it is kept. Reads keep their older rule, which also let InvalidArgument and DeadlineExceeded
    through (a read has no outcome to hide)."""
    if unknown is None or isinstance(error, UnknownOutcome | RequestExpired):
        return error
    if not write and isinstance(error, InvalidArgument | DeadlineExceeded):
        return error
    return UnknownOutcome(
        f"{unknown.message}; the retries then failed: {error.message}",
        code=unknown.code, metadata=unknown.metadata, target=unknown.target, request_id=error.request_id,
        attempts=error.attempts,
    )


def _consistency(consistency: str) -> kv_pb2.Consistency:
    try:
        return _CONSISTENCY_PB[consistency]
    except KeyError:
        raise InvalidArgument(
            f"consistency must be one of {', '.join(CONSISTENCIES)}: {consistency!r}"
        ) from None


def _request_id(request_id: str | None) -> str:
    """A caller's id is kept (so a caller can retry across processes); otherwise a fresh one."""
    if request_id is None:
        return uuid.uuid4().hex
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgument("request_id must be a non-empty string (or None for a generated one)")
    return request_id


def _first_attempt_unix_ms(given: int | None, request_id: str | None) -> int:
    """The wall-clock time (Unix ms) of a write's first attempt: the caller's, when it retries
    an earlier request id, else now. Fixed when the request is built, so every retry of this
    call sends the same value and the store can tell a retry older than its horizon."""
    if given is None:
        return int(time.time() * 1000)
    if isinstance(given, bool) or not isinstance(given, int) or given <= 0:
        raise InvalidArgument(f"first_attempt_unix_ms must be a positive integer (Unix ms): {given!r}")
    if request_id is None:
        # A fresh id has no earlier attempt; an old time would only get it refused as expired.
        raise InvalidArgument("first_attempt_unix_ms is for retrying an earlier request: give its request_id too")
    return given


def _scan_request(
    start: BytesLike, end: BytesLike, prefix: BytesLike, limit: int, consistency: str, keys_only: bool
) -> kv_pb2.ScanRequest:
    s, e, p = to_bytes(start, "start"), to_bytes(end, "end"), to_bytes(prefix, "prefix")
    if p and (s or e):
        raise InvalidArgument("scan takes either a prefix or a start/end range, not both")
    if limit < 0:
        raise InvalidArgument(f"scan limit must not be negative: {limit}")
    read = kv_pb2.ReadOptions(consistency=_consistency(consistency))
    return kv_pb2.ScanRequest(start=s, end=e, prefix=p, limit=limit, read=read, keys_only=keys_only)


def _txn_op_result(op: Op, result: kv_pb2.TxnOpResult, request_id: str) -> TxnOpResult:
    kind = result.WhichOneof("result")
    if kind == "put":
        return PutResult.from_pb(op.key, result.put, request_id)
    if kind == "delete":
        return DeleteResult.from_pb(op.key, result.delete, request_id)
    if kind == "get":
        return GetResult.from_pb(op.key, result.get)
    raise KvError(f"txn result without an operation for {_show_key(op.key)}")


class Watch(Iterator[WatchEvent]):
    """A running watch: iterate for events; `cancel()` ends it (from any thread).

    Until the first event arrives a failed stream is reopened like any call (bounded attempts,
    leader hints, next endpoint): nothing was delivered, so nothing can be lost or repeated.
    After that an error is raised to the caller, who knows the last revision it saw and can
    watch again from there; the client cannot, because `start_revision` applies to every shard
    of a prefix watch alike.
    """

    def __init__(self, client: Client, request: kv_pb2.WatchRequest, key: bytes | None, timeout_s: float | None):
        self._client = client
        self._request = request
        self._key = key
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._cancelled = False
        self._delivered = False
        self._attempts = 0
        self._hint: str | None = None
        self._stream: Any = None
        self._target = ""
        self._open()

    def _open(self) -> None:
        deadline = time.monotonic() + (self._timeout_s if self._timeout_s is not None else self._client._timeout_s)
        self._attempts += 1
        target = self._hint or self._client._route(self._key, deadline)
        conn = self._client._conn(target)
        with self._lock:
            if self._cancelled:
                return
            self._target = target
            self._stream = conn.kv.Watch(self._request, timeout=self._timeout_s)

    def __iter__(self) -> Watch:
        return self

    def __next__(self) -> WatchEvent:
        while True:
            with self._lock:
                stream = self._stream
                if self._cancelled or stream is None:
                    raise StopIteration
            try:
                event = next(stream)
            except StopIteration:
                raise
            except grpc.RpcError as exc:
                if self._cancelled:
                    raise StopIteration from None
                error = error_from_rpc(exc, target=self._target)
                self._retry_or_raise(error)
                continue
            self._delivered = True
            if not isinstance(event, kv_pb2.WatchEvent):
                raise KvError(f"unexpected watch message: {type(event).__name__}", target=self._target)
            return WatchEvent.from_pb(event)

    def _retry_or_raise(self, error: KvError) -> None:
        action = retry_action(error)
        if self._delivered or action is RetryAction.FAIL or self._attempts >= self._client._max_attempts:
            error.attempts = self._attempts
            raise error
        if action is RetryAction.REDIRECT and isinstance(error, NotLeader) and error.leader_hint != self._target:
            self._hint = error.leader_hint
        else:
            self._hint = None
            self._client._invalidate_map()
            self._client._rotate(self._target)
            self._client._sleep_backoff(self._attempts, time.monotonic() + self._client._max_backoff_s)
        self._open()

    def cancel(self) -> None:
        """End the watch; a thread blocked in `next()` gets StopIteration."""
        with self._lock:
            self._cancelled = True
            stream = self._stream
        if stream is not None:
            stream.cancel()

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()
