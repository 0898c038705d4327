"""The store's error hierarchy and its one mapping to gRPC status codes.

Servers raise these; `to_status` is the only place that decides a gRPC code and the rich status
every error carries: a `google.rpc.Status` in `grpc-status-details-bin` (what grpcurl prints and
every gRPC language reads) with an `ErrorInfo` (domain "kvstore", a `Reason`, and metadata: the
outcome, the leader, the shard, the request id, the limit), a `RetryInfo` when retrying soon can
help, and `BadRequest` field violations for a malformed request. The same facts also go out as
`kvstore-*` trailers, which older clients read. The client (`kvstore.client`) reads both back.
A client that sees:

* INVALID_ARGUMENT: fix the request (the message names the limit);
* FAILED_PRECONDITION with `kvstore-leader-hint`: ask that node instead (not the leader);
* RESOURCE_EXHAUSTED: back off (a queue is full);
* UNAVAILABLE: retry (not bootstrapped yet, batch aborted, leader changing);
* UNKNOWN with `kvstore-outcome: unknown`: the commit may or may not have happened (W7): retry
  with the same request id, which the store applies at most once;
* FAILED_PRECONDITION with `kvstore-reason: request-id-expired`: the retry came after the
  request-id horizon; the original attempt's outcome is unknown and cannot be learnt here;
* OUT_OF_RANGE, reason COMPACTED: a Watch asked for history the WAL no longer holds (truncated);
  ErrorInfo.metadata["log_start"] says where it starts now.

Every error the store raises *before anything of the request could have been committed* carries
`kvstore-outcome: none` ("definite": nothing was queued, or the batch was aborted). A client
must treat a write error without that mark (a dropped connection, CANCELLED, INTERNAL, a bare
UNKNOWN, a deadline) as an unknown outcome (docs/design.md §4, W7): only the server can say that
nothing happened, and only this module says it.
"""

from __future__ import annotations

import enum

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

DOMAIN = "kvstore"  # ErrorInfo.domain of every error the store reports
STATUS_DETAILS_KEY = "grpc-status-details-bin"  # where gRPC carries a google.rpc.Status
LEADER_HINT_KEY = "kvstore-leader-hint"
SHARD_KEY = "kvstore-shard"
OUTCOME_KEY = "kvstore-outcome"
REASON_KEY = "kvstore-reason"
OUTCOME_NONE = "none"  # definite: nothing of the request was or will be committed
OUTCOME_UNKNOWN = "unknown"  # W7: it may or may not have committed
REASON_REQUEST_ID_EXPIRED = "request-id-expired"  # the kvstore-reason trailer's one value
# Request metadata of forwarding (kvstore.server.forward): a node that does not lead a shard
# forwards a write or a leader read to the leader, one hop; the forwarded call carries
# FORWARDED_BY_KEY (never forwarded again). A client that routes itself (kvstore.client) sends
# FORWARD_KEY: FORWARD_NEVER and gets NOT_LEADER with the leader instead (fewer hops).
FORWARDED_BY_KEY = "kvstore-forwarded-by"
FORWARD_KEY = "kvstore-forward"
FORWARD_NEVER = "never"
# ErrorInfo.metadata keys
INFO_OUTCOME = "outcome"  # OUTCOME_NONE or OUTCOME_UNKNOWN, as the kvstore-outcome trailer
INFO_LEADER = "leader"
INFO_SHARD = "shard"
INFO_REQUEST_ID = "request_id"
INFO_LIMIT = "limit"
INFO_LOG_START = "log_start"  # COMPACTED: the oldest revision the shard's WAL still holds
INFO_REVISION = "revision"  # COMPACTED: the revision asked for
INFO_TXN_ID = "txn_id"  # TXN_CONFLICT: the prepared transaction holding the lock
INFO_SAME_REQUEST = "same_request"  # TXN_CONFLICT: the holder is an attempt of the same request


class Reason(enum.StrEnum):
    """ErrorInfo.reason: why a request failed, one word a program can switch on (and a metric
    label: `kvstore_requests_total{reason}`)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # malformed (BadRequest says which field)
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"  # a documented limit (ErrorInfo.metadata["limit"] names it)
    NOT_LEADER = "NOT_LEADER"  # ask metadata["leader"] instead (if known)
    QUEUE_FULL = "QUEUE_FULL"  # a bounded queue is full: back off (RetryInfo)
    UNAVAILABLE = "UNAVAILABLE"  # bootstrapping, leader changing, batch aborted: retry (RetryInfo)
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"  # W7: retry with metadata["request_id"]
    REQUEST_ID_EXPIRED = "REQUEST_ID_EXPIRED"  # the retry came too late: outcome unknown for good
    COMPACTED = "COMPACTED"  # history below the shard's log start was truncated (metadata["log_start"])
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no or bad credentials
    PERMISSION_DENIED = "PERMISSION_DENIED"  # the caller's role does not allow the call
    INTERNAL = "INTERNAL"  # a bug: the outcome of a write is unknown
    TXN_CONFLICT = "TXN_CONFLICT"  # a key is locked by a prepared cross-shard Txn (metadata["txn_id"]): retry
    # A cross-shard Txn was aborted and its request id's outcome recorded as failed: nothing of it
    # was or will be applied; a retry with the same id gets this answer again: retry with a new id.
    TXN_ABORTED = "TXN_ABORTED"
    # An operator's drain or move computed from an older placement epoch: nothing was recorded;
    # look at the placement again (ShardMap's placement_epoch) and retry.
    PLACEMENT_CHANGED = "PLACEMENT_CHANGED"
    # A drain the placement controller refuses as it stands (it would leave a shard fewer than R
    # nodes able to hold it; the message names the shards): nothing was recorded. --force overrides.
    PLACEMENT_REFUSED = "PLACEMENT_REFUSED"


# RetryInfo.retry_delay: how long a client should wait before the same request can succeed. Short:
# a takeover or a drained queue takes milliseconds to a second; clients back off further themselves.
RETRY_UNAVAILABLE_MS = 100
RETRY_QUEUE_FULL_MS = 50
RETRY_NO_LEADER_MS = 200
RETRY_TXN_CONFLICT_MS = 20  # a prepared cross-shard Txn holds its locks for a few appends


class StoreError(Exception):
    """Base of every error the store reports to clients.

    Definite by default: raise a StoreError only where nothing of the request was committed or
    can still commit. The one exception is `UnknownOutcomeError`."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: Reason = Reason.INTERNAL
    definite = True
    retry_after_ms: int | None = None  # RetryInfo, when waiting this long and retrying can help

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The kvstore-* trailers (besides kvstore-outcome) that older clients read."""
        return ()

    def info(self) -> dict[str, str]:
        """ErrorInfo.metadata (besides the outcome and the request id, which `to_status` adds)."""
        return {}

    def violations(self) -> tuple[tuple[str, str], ...]:
        """BadRequest field violations: (field path, what is wrong with it)."""
        return ()


class InternalError(StoreError):
    """A bug reached the client: the request's outcome is unknown (a write may have committed)."""

    definite = False


class InvalidRequestError(StoreError):
    """Malformed request or a broken limit; the message names the limit.

    `field`: the request field at fault (BadRequest), e.g. "key" or "shards[2].mutations[7].value";
    `limit`: the name of the documented limit it breaks (kvstore.limits), which makes the reason
    LIMIT_EXCEEDED instead of INVALID_ARGUMENT."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, *, field: str = "", limit: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.limit = limit
        self.reason = Reason.LIMIT_EXCEEDED if limit else Reason.INVALID_ARGUMENT

    def info(self) -> dict[str, str]:
        return {INFO_LIMIT: self.limit} if self.limit else {}

    def violations(self) -> tuple[tuple[str, str], ...]:
        return ((self.field, str(self)),) if self.field else ()


class NotLeaderError(StoreError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.NOT_LEADER

    def __init__(self, shard: int, leader_hint: str | None) -> None:
        where = f"; try {leader_hint}" if leader_hint else "; no leader known right now"
        super().__init__(f"this node does not lead shard {shard}{where}")
        self.shard = shard
        self.leader_hint = leader_hint
        # No leader known: one is being chosen, ask again shortly. Known: go there at once.
        self.retry_after_ms = None if leader_hint else RETRY_NO_LEADER_MS

    def metadata(self) -> tuple[tuple[str, str], ...]:
        hint = ((LEADER_HINT_KEY, self.leader_hint),) if self.leader_hint else ()
        return ((SHARD_KEY, str(self.shard)), *hint)

    def info(self) -> dict[str, str]:
        hint = {INFO_LEADER: self.leader_hint} if self.leader_hint else {}
        return {INFO_SHARD: str(self.shard), **hint}


class NotHeldError(NotLeaderError):
    """This node holds no replica of the shard (placement put it elsewhere, docs/design.md §9):
    the same refusal as NOT_LEADER, so that the request is forwarded, or a client goes, to the
    shard's leader (or, while it has none, to another replica)."""

    def __init__(self, shard: int, hint: str | None) -> None:
        super().__init__(shard, hint)
        where = f"; try {hint}" if hint else "; no replica of it known right now"
        self.args = (f"this node holds no replica of shard {shard}{where}",)


class OverloadedError(StoreError):
    """A bounded queue is full; nothing was done."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.QUEUE_FULL
    retry_after_ms = RETRY_QUEUE_FULL_MS


class UnavailableError(StoreError):
    """Retriable: the shard is bootstrapping, changing leader, or its batch was aborted."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = Reason.UNAVAILABLE
    retry_after_ms = RETRY_UNAVAILABLE_MS


class TxnConflictError(StoreError):
    """A key this write needs stayed locked by a prepared cross-shard transaction for as long as
    a write waits (docs/design.md §10): nothing was written; retrying after a moment can succeed.
    Definite. The bounded wait is what ends a deadlock between transactions."""

    code = grpc.StatusCode.ABORTED
    reason = Reason.TXN_CONFLICT
    retry_after_ms = RETRY_TXN_CONFLICT_MS

    def __init__(self, message: str, *, txn_id: str = "", same_request: bool = False) -> None:
        super().__init__(message)
        self.txn_id = txn_id
        # The holder is an earlier attempt of the same client request (docs/design.md §10): that
        # request's outcome is unknown, though this write was not queued.
        self.same_request = same_request

    def info(self) -> dict[str, str]:
        info = {INFO_TXN_ID: self.txn_id} if self.txn_id else {}
        if self.same_request:
            info[INFO_SAME_REQUEST] = "true"
        return info


class TxnAbortedError(StoreError):
    """A cross-shard transaction was aborted, and the abort is its request id's recorded outcome
    (docs/design.md §10, T5): nothing of the request was applied, and no attempt with that id
    ever will be, earlier ones still running included. A retry with the same request id is
    answered with this abort; to try the Txn again, send it with a new request id. The message
    says why it aborted (a lock held too long, a shard unavailable, a resolver's timeout)."""

    code = grpc.StatusCode.ABORTED
    reason = Reason.TXN_ABORTED
    retry_after_ms = RETRY_TXN_CONFLICT_MS

    def __init__(self, message: str, *, txn_id: str = "") -> None:
        super().__init__(message)
        self.txn_id = txn_id

    def info(self) -> dict[str, str]:
        return {INFO_TXN_ID: self.txn_id} if self.txn_id else {}


class UnknownOutcomeError(StoreError):
    """W7: the write may or may not have committed. Retry with the same request id."""

    code = grpc.StatusCode.UNKNOWN
    reason = Reason.OUTCOME_UNKNOWN
    definite = False


class RequestExpiredError(StoreError):
    """A retry whose request id may be older than the dedupe horizon: applying it could apply
    the request twice, and the store no longer knows whether the first attempt committed.
    Definite for this attempt (nothing is queued); the original outcome stays unknown."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.REQUEST_ID_EXPIRED

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REASON_KEY, REASON_REQUEST_ID_EXPIRED),)


class PlacementChangedError(StoreError):
    """An operator's drain or move named a placement epoch that is no longer the log's (P4):
    refused, never merged into the newer placement. Nothing was recorded."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.PLACEMENT_CHANGED


class PlacementRefusedError(StoreError):
    """A well-formed drain that the placement's state forbids (P4: below R); nothing recorded."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.PLACEMENT_REFUSED


class CompactedError(StoreError):
    """History asked for below a shard's log start: `kvstore wal truncate` deleted those records
    (etcd's ErrCompacted). Nothing was done. The newest snapshot holds the state as of its cut;
    read the current state and watch again from `log_start` or later."""

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = Reason.COMPACTED

    def __init__(self, shard: int, revision: int, log_start: int) -> None:
        super().__init__(f"shard {shard}: revision {revision} was compacted: the WAL starts at {log_start} now "
                         "(truncated below a snapshot); read the current state and watch from that revision or later")
        self.shard = shard
        self.revision = revision
        self.log_start = log_start

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((SHARD_KEY, str(self.shard)),)

    def info(self) -> dict[str, str]:
        return {INFO_SHARD: str(self.shard), INFO_REVISION: str(self.revision), INFO_LOG_START: str(self.log_start)}


class DeadlineError(StoreError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = Reason.DEADLINE_EXCEEDED


class UnauthenticatedError(StoreError):
    """No credentials, or credentials the node does not accept; nothing was done."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = Reason.UNAUTHENTICATED


class PermissionDeniedError(StoreError):
    """The caller is known but its role does not allow this call; nothing was done."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = Reason.PERMISSION_DENIED


Trailers = tuple[tuple[str, str | bytes], ...]


def to_status(error: StoreError, *, request_id: str = "") -> tuple[grpc.StatusCode, str, Trailers]:
    """The gRPC code, details and trailing metadata for a store error: the one mapping, and the
    one place that tags an error definite (outcome "none") or unknown. `request_id`: the
    request's, so that an unknown outcome names the id to retry with. Pure."""
    outcome = OUTCOME_NONE if error.definite else OUTCOME_UNKNOWN
    message = str(error)
    info = {INFO_OUTCOME: outcome, **error.info()}
    if request_id:
        info[INFO_REQUEST_ID] = request_id
    details = [_packed(error_details_pb2.ErrorInfo(reason=error.reason.value, domain=DOMAIN, metadata=info))]
    if error.retry_after_ms is not None:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(error.retry_after_ms)
        details.append(_packed(error_details_pb2.RetryInfo(retry_delay=delay)))
    violations = error.violations()
    if violations:
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=field, description=why) for field, why in violations])))
    status = status_pb2.Status(code=error.code.value[0], message=message, details=details)
    return error.code, message, ((OUTCOME_KEY, outcome), *error.metadata(),
                                 (STATUS_DETAILS_KEY, status.SerializeToString()))


def _packed(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def from_status(code: grpc.StatusCode, details: str, trailing: Trailers | None) -> StoreError:
    """A peer node's refusal, as this node's own error: the inverse of `to_status`, for the calls
    nodes make to each other (a cross-shard transaction's records, kvstore.server.txns). Definite
    only when the peer said so (outcome "none"); whatever it did not say (a lost connection, a
    deadline, another domain's status) is an unknown outcome. Pure."""
    reason, info = "", {}
    raw = dict(trailing or ()).get(STATUS_DETAILS_KEY)
    if isinstance(raw, bytes):
        try:
            status = status_pb2.Status.FromString(raw)
        except Exception:  # a status we cannot read says nothing
            status = status_pb2.Status()
        for detail in status.details:
            found = error_details_pb2.ErrorInfo()
            if detail.Unpack(found) and found.domain == DOMAIN:
                reason, info = found.reason, dict(found.metadata)
    text = f"{code.name}: {details}"
    if reason == Reason.TXN_CONFLICT:
        return TxnConflictError(details, txn_id=info.get(INFO_TXN_ID, ""),
                                same_request=info.get(INFO_SAME_REQUEST) == "true")
    if reason == Reason.TXN_ABORTED:
        return TxnAbortedError(details, txn_id=info.get(INFO_TXN_ID, ""))
    if reason == Reason.REQUEST_ID_EXPIRED:
        return RequestExpiredError(details)
    if reason == Reason.PLACEMENT_CHANGED:
        return PlacementChangedError(details)
    if reason == Reason.PLACEMENT_REFUSED:
        return PlacementRefusedError(details)
    if reason in (Reason.INVALID_ARGUMENT, Reason.LIMIT_EXCEEDED):
        return InvalidRequestError(details, limit=info.get(INFO_LIMIT, ""))
    if info.get(INFO_OUTCOME) == OUTCOME_NONE:
        return UnavailableError(text)
    return UnknownOutcomeError(text)
