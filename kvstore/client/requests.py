"""What a client sends, built and checked before anything goes on the wire: keys and values as
bytes, consistency names, a Txn's compares and operations (and the one-shard rule they must
keep), request ids and first-attempt times of writes, scans with their per-shard minimum
revisions. Pure: a request that cannot succeed is refused here, with a message that names the
problem, instead of as a bare INVALID_ARGUMENT from a server.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, get_args

from kvstore import limits
from kvstore.client.errors import InvalidArgument
from kvstore.core.sharding import shard_of
from kvstore.v1 import kv_pb2

BytesLike = bytes | str
Consistency = Literal["linearizable", "leader-local", "stale"]
CONSISTENCIES: tuple[str, ...] = get_args(Consistency)
CompareOp = Literal["==", "!=", ">", "<"]
COMPARE_OPS: tuple[str, ...] = get_args(CompareOp)

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


def consistency_pb(consistency: str) -> kv_pb2.Consistency:
    """The wire value of a consistency name; an unknown name is refused before anything is sent."""
    try:
        return _CONSISTENCY_PB[consistency]
    except KeyError:
        raise InvalidArgument(
            f"consistency must be one of {', '.join(CONSISTENCIES)}: {consistency!r}"
        ) from None


def make_request_id(request_id: str | None) -> str:
    """A caller's id is kept (so a caller can retry across processes); otherwise a fresh one."""
    if request_id is None:
        return uuid.uuid4().hex
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgument("request_id must be a non-empty string (or None for a generated one)")
    return request_id


def make_first_attempt_unix_ms(given: int | None, request_id: str | None) -> int:
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


# ---- each call's request, built alike by the synchronous and the asyncio client -------------------


def get_request(key: BytesLike, consistency: str, min_revision: int | None) -> tuple[bytes, kv_pb2.GetRequest]:
    """A Get of `key` at `consistency` (`min_revision`: of the key's shard)."""
    k = to_bytes(key)
    read = kv_pb2.ReadOptions(consistency=consistency_pb(consistency))
    if min_revision is not None:
        read.min_revision = min_revision
    return k, kv_pb2.GetRequest(key=k, read=read)


def put_request(key: BytesLike, value: BytesLike, request_id: str | None,
                first_attempt_unix_ms: int | None) -> tuple[bytes, kv_pb2.PutRequest]:
    """A Put with its request id and first-attempt time, fixed for every retry."""
    k, rid = to_bytes(key), make_request_id(request_id)
    first_ms = make_first_attempt_unix_ms(first_attempt_unix_ms, request_id)
    return k, kv_pb2.PutRequest(key=k, value=to_bytes(value, "value"), request_id=rid, first_attempt_unix_ms=first_ms)


def delete_request(key: BytesLike, request_id: str | None,
                   first_attempt_unix_ms: int | None) -> tuple[bytes, kv_pb2.DeleteRequest]:
    k, rid = to_bytes(key), make_request_id(request_id)
    first_ms = make_first_attempt_unix_ms(first_attempt_unix_ms, request_id)
    return k, kv_pb2.DeleteRequest(key=k, request_id=rid, first_attempt_unix_ms=first_ms)


def watch_request(key: BytesLike, prefix: BytesLike, start_revision: int | None,
                  start_revisions: Mapping[int, int] | None) -> tuple[bytes | None, kv_pb2.WatchRequest]:
    """A Watch of `key` or of `prefix`; the key (None for a prefix) routes it."""
    k, p = to_bytes(key), to_bytes(prefix, "prefix")
    if bool(k) == bool(p):
        raise InvalidArgument("watch needs exactly one of key or prefix")
    if start_revision is not None and start_revisions:
        raise InvalidArgument("give start_revision or start_revisions, not both")
    # Progress events keep a resume position current on a busy shard whose watched keys are quiet
    # (`kvstore.client.watch.WatchResume.progress`); the clients consume them, never yield them.
    request = kv_pb2.WatchRequest(key=k, prefix=p, progress_notify=True)
    if start_revision is not None:
        request.start_revision = start_revision
    for shard, revision in sorted((start_revisions or {}).items()):
        request.start_revisions.append(kv_pb2.ShardRevision(shard=shard, revision=revision))
    return k or None, request


def scan_request(
    start: BytesLike, end: BytesLike, prefix: BytesLike, limit: int, consistency: str, keys_only: bool,
    min_revisions: Mapping[int, int] | None = None,
) -> kv_pb2.ScanRequest:
    """A scan of `[start, end)` or of `prefix`; `min_revisions` (shard -> revision) as in
    `shard_revisions`."""
    s, e, p = to_bytes(start, "start"), to_bytes(end, "end"), to_bytes(prefix, "prefix")
    if p and (s or e):
        raise InvalidArgument("scan takes either a prefix or a start/end range, not both")
    if limit < 0:
        raise InvalidArgument(f"scan limit must not be negative: {limit}")
    read = kv_pb2.ReadOptions(consistency=consistency_pb(consistency))
    return kv_pb2.ScanRequest(start=s, end=e, prefix=p, limit=limit, read=read, keys_only=keys_only,
                              min_revisions=shard_revisions(min_revisions or {}))


def shard_revisions(min_revisions: Mapping[int, int]) -> list[kv_pb2.ShardRevision]:
    """A read's minimum revision per shard (shard -> revision), in shard order.

    A revision is an offset in one shard's WAL partition, so a read that spans shards names the
    shard of each minimum: typically `revisions_of(...)` of the caller's own writes
    (read-your-writes on a stale scan).
    """
    out: list[kv_pb2.ShardRevision] = []
    for shard, revision in min_revisions.items():
        for what, number in (("shard", shard), ("revision", revision)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                raise InvalidArgument(f"min_revisions: a {what} must be an integer >= 0, got {number!r}")
        out.append(kv_pb2.ShardRevision(shard=shard, revision=revision))
    return sorted(out, key=lambda item: item.shard)


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


def txn_request(compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op],
                first_attempt_unix_ms: int) -> kv_pb2.TxnRequest:
    """A Txn without its request id: a cross-shard one that aborts is sent again under a fresh id."""
    return kv_pb2.TxnRequest(compares=[c.to_pb() for c in compares], success=[o.to_pb() for o in success],
                             failure=[o.to_pb() for o in failure], first_attempt_unix_ms=first_attempt_unix_ms)


def txn_keys(compares: Iterable[Compare], success: Iterable[Op], failure: Iterable[Op]) -> list[bytes]:
    """Every key a Txn touches, in first-seen order, without duplicates."""
    keys = itertools.chain((c.key for c in compares), (o.key for o in success), (o.key for o in failure))
    return list(dict.fromkeys(keys))


def txn_shard(
    compares: Iterable[Compare], success: Iterable[Op], failure: Iterable[Op], shard_count: int
) -> int | None:
    """The shard a Txn is sent to (None for a Txn without keys): its keys' one shard, or, for a
    Txn whose keys span shards, the lowest of them: its coordinator shard (docs/design.md §10),
    whose leader then drives the transaction with one hop less."""
    shards = {shard_of(key, shard_count) for key in txn_keys(compares, success, failure)}
    return min(shards) if shards else None


def txn_route_key(
    compares: Iterable[Compare], success: Iterable[Op], failure: Iterable[Op], shard_count: int | None
) -> bytes | None:
    """A key of the shard the Txn is sent to (`txn_shard`); without a shard count, its first key."""
    keys = txn_keys(compares, success, failure)
    if not keys or shard_count is None:
        return keys[0] if keys else None
    coordinator = min(shard_of(key, shard_count) for key in keys)
    return next(key for key in keys if shard_of(key, shard_count) == coordinator)


def show_key(key: bytes) -> str:
    text = key.decode("utf-8", "backslashreplace")
    return repr(text if len(text) <= 40 else text[:37] + "...")


def part_request_id(request_id: str, shard: int) -> str:
    """The id of one shard's part of a batch: the batch's id and the shard, so a retry of the
    same batch (same id, same operations) sends every part under the id it had before."""
    return f"{request_id}/{shard}"


def batch_parts(ops: Iterable[Op], shard_count: int, request_id: str,
                first_attempt_unix_ms: int) -> dict[int, kv_pb2.ShardMutations]:
    """Split puts and deletes by shard (`crc32(key) mod shard_count`), keeping their order, into
    the parts of a WriteBatch, each under its own request id. Refuses what the server would
    refuse, before anything is sent."""
    parts: dict[int, kv_pb2.ShardMutations] = {}
    for op in ops:
        if not isinstance(op, Op) or op.kind == "get":
            raise InvalidArgument(f"a batch takes Op.put and Op.delete only, not {op!r}")
        shard = shard_of(op.key, shard_count)
        part = parts.get(shard)
        if part is None:
            rid = part_request_id(request_id, shard)
            if len(rid.encode()) > limits.MAX_REQUEST_ID_BYTES:
                raise InvalidArgument(f"request_id {request_id!r} is too long for a batch: its parts' ids "
                                      f"(id/shard) must fit MAX_REQUEST_ID_BYTES ({limits.MAX_REQUEST_ID_BYTES})")
            part = parts[shard] = kv_pb2.ShardMutations(shard=shard, request_id=rid,
                                                         first_attempt_unix_ms=first_attempt_unix_ms)
        if op.kind == "put":
            part.mutations.add(key=op.key, value=op.value)
        else:
            part.mutations.add(key=op.key, delete=True)
    if not parts:
        raise InvalidArgument("a batch needs at least one put or delete")
    for shard, part in parts.items():
        if len(part.mutations) > limits.MAX_BATCH_MUTATIONS:
            raise InvalidArgument(f"{len(part.mutations)} mutations for shard {shard}; limit MAX_BATCH_MUTATIONS "
                                  f"is {limits.MAX_BATCH_MUTATIONS} per shard and batch (use a BatchingWriter)")
    return parts
