"""The client's errors: one hierarchy (`KvError`) and its one mapping from a gRPC status.

Callers never see `grpc.RpcError`: every failure is a `KvError` subclass that says what the
caller may do next. The mapping reads the `kvstore-*` trailing metadata the server attaches
(`kvstore.errors`, the server's single definition of the contract); for a write, only an error
the server marked as definite ("nothing was queued") is a failure, anything else is an unknown
outcome (DESIGN.md §3, W7). Pure: no I/O, table-tested.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import grpc

from kvstore.errors import (
    LEADER_HINT_KEY,
    OUTCOME_KEY,
    OUTCOME_NONE,
    OUTCOME_UNKNOWN,
    REASON_KEY,
    REASON_REQUEST_ID_EXPIRED,
    SHARD_KEY,
)


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


class BatchIncomplete(KvError):
    """Some parts of a batch did not commit (`Client.write_batch`): `committed` holds the parts
    that did (shard -> `ShardWrite`), `errors` why each other part did not (shard -> `KvError`,
    classified exactly as a Put's). `unknown` is true when any of them may still have committed
    (`UnknownOutcome`, `RequestExpired`). Sending the same operations again with the same
    `request_id` and `first_attempt_unix_ms` is safe: committed parts answer as replays."""

    def __init__(self, message: str, *, committed: Mapping[int, Any], errors: Mapping[int, KvError],
                 request_id: str, first_attempt_unix_ms: int) -> None:
        super().__init__(message, request_id=request_id, first_attempt_unix_ms=first_attempt_unix_ms)
        self.committed = dict(committed)
        self.errors = dict(errors)

    @property
    def unknown(self) -> bool:
        return any(isinstance(e, UnknownOutcome | RequestExpired) for e in self.errors.values())


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


def metadata_dict(raw: Iterable[Any] | None) -> dict[str, str]:
    """gRPC metadata (pairs, values str or bytes) as one dict with lower-case keys, so that the
    mapping below reads `kvstore-*` keys the same whatever the runtime handed over."""
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


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The gRPC code of its number (a batch part's error carries the number); UNKNOWN if none."""
    return _STATUS_CODES.get(number, grpc.StatusCode.UNKNOWN)


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
        metadata_dict(trailing),
        target=target,
        request_id=request_id,
        write=write,
    )
