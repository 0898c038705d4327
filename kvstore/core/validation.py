"""Request validation against the documented limits (kvstore.limits); pure.

Every check raises InvalidRequestError with a message that names the limit, so a client can
tell what to change. Nothing here touches state.
"""

from __future__ import annotations

from kvstore import limits
from kvstore.core.sharding import shard_of
from kvstore.core.state import TXN_ID_PREFIX
from kvstore.errors import InvalidRequestError
from kvstore.v1 import kv_pb2


def check_key(key: bytes, what: str = "key", field: str = "") -> None:
    """`what` names the key in the message; `field` is its path in the request (BadRequest),
    `what` when not given."""
    if not key:
        raise InvalidRequestError(f"{what} must not be empty", field=field or what)
    if len(key) > limits.MAX_KEY_BYTES:
        raise InvalidRequestError(f"{what} has {len(key)} bytes; limit MAX_KEY_BYTES is {limits.MAX_KEY_BYTES}",
                                  field=field or what, limit="MAX_KEY_BYTES")


def check_value(value: bytes, field: str = "value") -> None:
    if len(value) > limits.MAX_VALUE_BYTES:
        raise InvalidRequestError(
            f"value has {len(value)} bytes; limit MAX_VALUE_BYTES is {limits.MAX_VALUE_BYTES}",
            field=field, limit="MAX_VALUE_BYTES")


def check_request_id(request_id: str, field: str = "request_id") -> None:
    if len(request_id.encode()) > limits.MAX_REQUEST_ID_BYTES:
        raise InvalidRequestError(f"request_id has {len(request_id.encode())} bytes; "
                                  f"limit MAX_REQUEST_ID_BYTES is {limits.MAX_REQUEST_ID_BYTES}",
                                  field=field, limit="MAX_REQUEST_ID_BYTES")
    if request_id.startswith(TXN_ID_PREFIX):
        # The store's own ids for a cross-shard transaction's records (kvstore.core.state): a
        # client's request under one could replay, or be taken for, a transaction's record.
        raise InvalidRequestError(f"request ids starting with {TXN_ID_PREFIX!r} are reserved for the store's "
                                  "cross-shard transactions", field=field)


def check_size(size: int) -> None:
    if size > limits.MAX_REQUEST_BYTES:
        raise InvalidRequestError(f"request has {size} bytes; limit MAX_REQUEST_BYTES is {limits.MAX_REQUEST_BYTES}",
                                  limit="MAX_REQUEST_BYTES")


def check_put(req: kv_pb2.PutRequest) -> None:
    check_key(req.key)
    check_value(req.value)
    check_request_id(req.request_id)


def check_delete(req: kv_pb2.DeleteRequest) -> None:
    check_key(req.key)
    check_request_id(req.request_id)


def txn_keys(req: kv_pb2.TxnRequest) -> list[bytes]:
    keys = [c.key for c in req.compares]
    for op in [*req.success, *req.failure]:
        kind = op.WhichOneof("op")
        if kind is None:
            raise InvalidRequestError("every Txn operation must be a put, delete or get")
        keys.append(getattr(op, kind).key)
    return keys


def check_txn(req: kv_pb2.TxnRequest, shard_count: int) -> tuple[int, ...]:
    """Validate a Txn and return its participants: the shards of its keys, ascending. One shard:
    the one-record path; more: a cross-shard transaction (docs/design.md §10)."""
    check_request_id(req.request_id)
    ops = len(req.compares) + len(req.success) + len(req.failure)
    if ops == 0:
        raise InvalidRequestError("a Txn needs at least one compare or operation")
    if ops > limits.MAX_TXN_OPS:
        raise InvalidRequestError(f"Txn has {ops} compares+operations; limit MAX_TXN_OPS is {limits.MAX_TXN_OPS}",
                                  limit="MAX_TXN_OPS")
    for compare in req.compares:
        check_key(compare.key, "compare key", "compares.key")
        if compare.target == kv_pb2.Compare.TARGET_UNSPECIFIED or compare.op == kv_pb2.Compare.OP_UNSPECIFIED:
            raise InvalidRequestError("every compare needs a target and an op")
        if compare.target in (kv_pb2.Compare.TARGET_EXISTS, kv_pb2.Compare.TARGET_VALUE) and compare.op in (
                kv_pb2.Compare.OP_GREATER, kv_pb2.Compare.OP_LESS):
            raise InvalidRequestError("exists and value compares support only == and !=")
    for op in [*req.success, *req.failure]:
        if op.WhichOneof("op") == "put":
            check_value(op.put.value, "put.value")
    keys = txn_keys(req)
    for key in keys:
        check_key(key, "Txn key", "key")
    check_size(req.ByteSize())
    return tuple(sorted({shard_of(key, shard_count) for key in keys}))


def check_write_batch(req: kv_pb2.WriteBatchRequest, shard_count: int) -> None:
    """Validate a WriteBatch as a whole: one broken part refuses the call, so nothing of a
    malformed batch is ever written (the parts are independent only once they are valid)."""
    if not req.shards:
        raise InvalidRequestError("a WriteBatch needs at least one part")
    seen: set[int] = set()
    for part in req.shards:
        shard = part.shard
        if shard >= shard_count:
            raise InvalidRequestError(f"shard {shard} does not exist; the cluster has {shard_count} shards",
                                      field="shards.shard")
        if shard in seen:
            raise InvalidRequestError(f"shard {shard} has two parts; a WriteBatch takes at most one part per shard")
        seen.add(shard)
        check_request_id(part.request_id, "shards.request_id")
        count = len(part.mutations)
        if count == 0:
            raise InvalidRequestError(f"the part for shard {shard} has no mutations")
        if count > limits.MAX_BATCH_MUTATIONS:
            raise InvalidRequestError(f"the part for shard {shard} has {count} mutations; "
                                      f"limit MAX_BATCH_MUTATIONS is {limits.MAX_BATCH_MUTATIONS}",
                                      field="shards.mutations", limit="MAX_BATCH_MUTATIONS")
        for mutation in part.mutations:  # a plain loop: this runs once per mutation
            key = mutation.key
            if not key or len(key) > limits.MAX_KEY_BYTES:
                check_key(key, "mutation key", "shards.mutations.key")
            if mutation.delete:
                if mutation.value:
                    raise InvalidRequestError(f"a delete carries no value (key {key!r})")
            elif len(mutation.value) > limits.MAX_VALUE_BYTES:
                check_value(mutation.value, "shards.mutations.value")
            if shard_of(key, shard_count) != shard:
                raise InvalidRequestError(f"key {key[:64]!r} belongs to shard {shard_of(key, shard_count)}, "
                                          f"not to shard {shard} (crc32(key) mod {shard_count})")
    check_size(req.ByteSize())


def scan_bounds(req: kv_pb2.ScanRequest) -> tuple[bytes, bytes | None, int]:
    """(start, end or None, limit) of a scan; a prefix becomes its [prefix, successor) range."""
    if req.prefix and (req.start or req.end):
        raise InvalidRequestError("give either prefix or start/end, not both")
    if req.limit > limits.MAX_SCAN_LIMIT:
        raise InvalidRequestError(f"scan limit {req.limit} exceeds MAX_SCAN_LIMIT {limits.MAX_SCAN_LIMIT}",
                                  field="limit", limit="MAX_SCAN_LIMIT")
    limit = req.limit or limits.DEFAULT_SCAN_LIMIT
    if req.prefix:
        return req.prefix, prefix_end(req.prefix), limit
    if req.end and req.end <= req.start:
        raise InvalidRequestError("scan end must be greater than start")
    return req.start, (req.end or None), limit


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key with `prefix`; None if there is none (all 0xff)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])
