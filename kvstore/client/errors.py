"""The client's errors: one hierarchy (`KvError`) and its one mapping from a gRPC status.

Callers never see `grpc.RpcError`: every failure is a `KvError` subclass that says what the
caller may do next. The mapping reads the rich status the server attaches (a google.rpc.Status in
`grpc-status-details-bin`: ErrorInfo's reason and metadata, RetryInfo, BadRequest; see
`kvstore.errors`, the server's single definition of the contract), and falls back to the
`kvstore-*` trailers of older servers. For a write, only an error the server marked as definite
(outcome "none": nothing was queued) is a failure, anything else is an unknown outcome
(docs/design.md §4, W7). Nothing here matches gRPC's English texts. Pure: no I/O, table-tested.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from kvstore.errors import (
    DOMAIN,
    INFO_LEADER,
    INFO_LOG_START,
    INFO_OUTCOME,
    INFO_SHARD,
    INFO_TXN_ID,
    LEADER_HINT_KEY,
    OUTCOME_KEY,
    OUTCOME_NONE,
    OUTCOME_UNKNOWN,
    REASON_KEY,
    REASON_REQUEST_ID_EXPIRED,
    SHARD_KEY,
    STATUS_DETAILS_KEY,
    Reason,
)


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorDetails:
    """What a google.rpc.Status in the trailers says, as far as the client uses it: the store's
    ErrorInfo (domain "kvstore"), RetryInfo and BadRequest. Empty when the server sent none (an
    older server, a proxy, gRPC's own errors)."""

    reason: str = ""
    info: Mapping[str, str] = dataclasses.field(default_factory=dict)
    retry_delay_s: float | None = None
    violations: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def parse(raw: bytes | None) -> ErrorDetails:
        """The details of a serialized google.rpc.Status; empty if it is absent or malformed
        (a client must not fail on a status it cannot read)."""
        if not raw:
            return NO_DETAILS
        try:
            status = status_pb2.Status.FromString(raw)
        except DecodeError:
            return NO_DETAILS
        reason, info, delay = "", {}, None
        violations: list[tuple[str, str]] = []
        for item in status.details:
            if item.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                error_info = error_details_pb2.ErrorInfo()
                item.Unpack(error_info)
                if error_info.domain == DOMAIN:
                    reason, info = error_info.reason, dict(error_info.metadata)
            elif item.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                item.Unpack(retry)
                delay = max(0.0, retry.retry_delay.ToMilliseconds() / 1000)
            elif item.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                item.Unpack(bad)
                violations.extend((v.field, v.description) for v in bad.field_violations)
        return ErrorDetails(reason, info, delay, tuple(violations))


NO_DETAILS = ErrorDetails()


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
        details: ErrorDetails = NO_DETAILS,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.metadata: Mapping[str, str] = dict(metadata or {})
        self.details = details
        self.target = target
        self.request_id = request_id
        self.attempts = attempts
        self.first_attempt_unix_ms = first_attempt_unix_ms

    def __str__(self) -> str:
        suffix = f" (after {self.attempts} attempts)" if self.attempts > 1 else ""
        return f"{self.message}{suffix}"

    @property
    def reason(self) -> str:
        """The server's ErrorInfo reason (`kvstore.errors.Reason`: NOT_LEADER, QUEUE_FULL,
        LIMIT_EXCEEDED, ...); "" when the server gave none."""
        return self.details.reason

    @property
    def retry_delay_s(self) -> float | None:
        """How long the server asked to wait before retrying (RetryInfo); None if it did not say."""
        return self.details.retry_delay_s

    @property
    def field_violations(self) -> tuple[tuple[str, str], ...]:
        """(field, what is wrong) for a malformed request (BadRequest)."""
        return self.details.violations


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
    """A Txn whose keys map to more than one shard, refused by a server older than cross-shard
    transactions (docs/design.md §10). This client no longer raises it itself; kept for callers
    that catch it."""


class NotLeader(KvError):
    """The node does not lead the key's shard; `leader_hint` is where to go, if it knows."""

    @property
    def leader_hint(self) -> str | None:
        return self.details.info.get(INFO_LEADER) or self.metadata.get(LEADER_HINT_KEY) or None

    @property
    def shard(self) -> int | None:
        raw = self.details.info.get(INFO_SHARD) or self.metadata.get(SHARD_KEY)
        return int(raw) if raw and raw.isdigit() else None


class Unavailable(KvError):
    """No node could serve the request right now (down, bootstrapping, leader changing)."""


class Unreachable(Unavailable):
    """No attempt of the request reached a server: every connection was refused, its address did
    not resolve, or its handshake failed, so gRPC never sent the request (`never_sent`). A write
    is then definitely not applied, unlike a connection dropped after sending (`UnknownOutcome`).
    An `Unavailable`: retried on another endpoint like one."""


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


class TxnConflict(KvError):
    """A key of the request is locked by a prepared cross-shard transaction (docs/design.md
    §10); nothing was done. Retried with backoff (a transaction holds its locks for a few appends);
    `txn_id` names the holder."""

    @property
    def txn_id(self) -> str | None:
        return self.details.info.get(INFO_TXN_ID) or None


class TxnAborted(KvError):
    """A cross-shard Txn was aborted (a key stayed locked, a shard was unavailable, a resolver
    gave up on it), and the abort is its request id's recorded outcome (docs/design.md §10, T5):
    nothing of it was applied, and no attempt with that id ever will be, earlier ones still
    running included. So it is definite even after an attempt whose outcome was unknown. A retry
    with the same id gets this answer again: the Txn must be sent with a new request id, which
    `Client.txn` does by itself when it chose the id. `txn_id` names the aborted transaction."""

    @property
    def txn_id(self) -> str | None:
        return self.details.info.get(INFO_TXN_ID) or None


class PlacementChanged(KvError):
    """A drain or move computed from an older placement epoch than the log's: nothing was
    recorded. Look at the shard map again and retry."""


class PlacementRefused(KvError):
    """A drain refused as the placement stands (it would leave a shard fewer than R nodes; the
    message names the shards): nothing was recorded. `force=True` overrides."""


class Compacted(KvError):
    """A Watch asked for history below a shard's log start: the WAL was truncated there (etcd's
    ErrCompacted). Nothing was started; read the current state, then watch from `log_start`."""

    @property
    def log_start(self) -> int | None:
        raw = self.details.info.get(INFO_LOG_START, "")
        return int(raw) if raw.isdigit() else None

    @property
    def shard(self) -> int | None:
        raw = self.details.info.get(INFO_SHARD) or self.metadata.get(SHARD_KEY)
        return int(raw) if raw and raw.isdigit() else None


class DeadlineExceeded(KvError):
    """The call's deadline passed. For a write this is definite: no attempt was sent, or every
    one was refused with `kvstore-outcome: none`; a deadline that cut an attempt of a write
    short is an `UnknownOutcome` instead."""


class Cancelled(KvError):
    """The call was cancelled (e.g. the client was closed under it)."""


class Unauthenticated(KvError):
    """The node did not accept the caller's credentials (none, or a token or certificate it does
    not know); nothing was done. Never retried: the same credentials fail again."""


class PermissionDenied(KvError):
    """The caller is known but its role does not allow the call (e.g. a `read` token writing);
    nothing was done. Never retried."""


def metadata_dict(raw: Iterable[Any] | None) -> dict[str, str]:
    """gRPC text metadata (pairs, values str or bytes) as one dict with lower-case keys, so that
    the mapping below reads `kvstore-*` keys the same whatever the runtime handed over. Binary
    entries (`-bin`) are left out: `details_of` reads the one the client uses."""
    out: dict[str, str] = {}
    for item in raw or ():
        key, value = str(item[0]).lower(), item[1]
        if key.endswith("-bin"):
            continue
        out[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return out


def details_of(raw: Iterable[Any] | None) -> ErrorDetails:
    """The rich status (`grpc-status-details-bin`) among trailing metadata, parsed."""
    for item in raw or ():
        if str(item[0]).lower() == STATUS_DETAILS_KEY and isinstance(item[1], bytes):
            return ErrorDetails.parse(item[1])
    return NO_DETAILS


# How gRPC's own core words a call that never left the client: the channel found no connection to
# pick (every address refused, or the handshake failed: "failed to connect to all addresses"), or
# the name did not resolve. Nothing was written to any transport, so no server saw the request.
# A connection that broke after sending says something else ("Socket closed", "Connection reset"):
# not one of these, so its write stays unknown.
_NEVER_SENT_PREFIXES = ("failed to connect to all addresses", "connections to all backends failing",
                        "errors resolving ", "DNS resolution failed", "Name resolution failure",
                        "empty address list")


def never_sent(code: grpc.StatusCode, details: str) -> bool:
    """Whether a failed attempt certainly never reached a server (gRPC's pick or name-resolution
    failure): a definite failure, even of a write."""
    return code == grpc.StatusCode.UNAVAILABLE and details.startswith(_NEVER_SENT_PREFIXES)


def write_attempt_is_definite(metadata: Mapping[str, str], details: ErrorDetails = NO_DETAILS) -> bool:
    """Whether a failed attempt of a write certainly committed nothing (docs/design.md §4.1, W7).

    Only the server knows, and it says so: ErrorInfo's outcome "none" (or the `kvstore-outcome:
    none` trailer of an older server). Anything else (a dropped connection, a cancellation, a
    deadline, a proxy's or the runtime's error, a message gRPC refused for its size) may have
    happened after the server queued the write. The client refuses a request above
    MAX_REQUEST_BYTES itself, before sending anything (`Client`), so no size error of gRPC's
    needs reading here.
    """
    outcome = details.info.get(INFO_OUTCOME) or metadata.get(OUTCOME_KEY)
    return outcome == OUTCOME_NONE


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
    rich: ErrorDetails = NO_DETAILS,
) -> KvError:
    """The client's one mapping from a gRPC status (its rich details `rich`, else the
    `kvstore-*` trailers of an older server) to an exception.

    `write`: the attempt was a Put, Delete or Txn, for which an error that is not definite
    (`write_attempt_is_definite`) is an `UnknownOutcome` whatever its code. A read changes
    nothing, so it is mapped by its code alone."""
    kwargs: dict[str, Any] = {"code": code, "metadata": metadata, "target": target, "request_id": request_id,
                              "details": rich}
    message = details or code.name
    reason = rich.reason
    if reason == Reason.REQUEST_ID_EXPIRED or (
            code == grpc.StatusCode.FAILED_PRECONDITION and metadata.get(REASON_KEY) == REASON_REQUEST_ID_EXPIRED):
        return RequestExpired(_expired_message(details, request_id), **kwargs)
    if reason == Reason.PLACEMENT_CHANGED:
        return PlacementChanged(message, **kwargs)
    if reason == Reason.PLACEMENT_REFUSED:
        return PlacementRefused(message, **kwargs)
    if never_sent(code, details) and not rich.reason and OUTCOME_KEY not in metadata:
        # gRPC's own words, with nothing of the store's: a status carrying the store's outcome
        # (relayed by a proxy, say) is read by that outcome instead, below.
        return Unreachable(message, **kwargs)
    if write and not write_attempt_is_definite(metadata, rich):
        return UnknownOutcome(message, **kwargs)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message, **kwargs)
    if reason == Reason.NOT_LEADER or (
            code == grpc.StatusCode.FAILED_PRECONDITION and (LEADER_HINT_KEY in metadata or SHARD_KEY in metadata)):
        return NotLeader(message, **kwargs)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(message, **kwargs)
    if reason == Reason.OUTCOME_UNKNOWN or (
            code == grpc.StatusCode.UNKNOWN and metadata.get(OUTCOME_KEY) == OUTCOME_UNKNOWN):
        return UnknownOutcome(message, **kwargs)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and (
            reason == Reason.QUEUE_FULL or metadata.get(OUTCOME_KEY) == OUTCOME_NONE):
        # The server's own full queue. gRPC's RESOURCE_EXHAUSTED (a message above its size cap)
        # carries neither and falls through: retrying the same bytes cannot help.
        return Overloaded(message, **kwargs)
    if reason == Reason.TXN_ABORTED:
        return TxnAborted(message, **kwargs)
    if reason == Reason.TXN_CONFLICT or (code == grpc.StatusCode.ABORTED and metadata.get(OUTCOME_KEY) == OUTCOME_NONE):
        return TxnConflict(message, **kwargs)
    if reason == Reason.COMPACTED or code == grpc.StatusCode.OUT_OF_RANGE:
        return Compacted(message, **kwargs)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message, **kwargs)
    if code == grpc.StatusCode.CANCELLED:
        return Cancelled(message, **kwargs)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(message, **kwargs)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(message, **kwargs)
    return KvError(message, **kwargs)


def _expired_message(details: str, request_id: str | None) -> str:
    # Whatever the server's wording, the caller must read that the outcome is unknown, not that
    # the write failed: the first attempt may well have committed.
    which = f"request id {request_id}" if request_id else "the request id"
    reason = f" ({details})" if details else ""
    return (f"{which} expired: it is older than the store's request-id horizon, so this retry was refused and "
            f"not applied; whether the original attempt committed is unknown and the store can no longer "
            f"tell{reason}")


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
        rich=details_of(trailing),
    )
