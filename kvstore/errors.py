"""The store's error hierarchy and its one mapping to gRPC status codes.

Servers raise these; `to_status` is the only place that decides a gRPC code, and the client
(`kvstore.client`) reads the same metadata keys back. A client that sees:

* INVALID_ARGUMENT: fix the request (the message names the limit);
* FAILED_PRECONDITION with `kvstore-leader-hint`: ask that node instead (not the leader);
* RESOURCE_EXHAUSTED: back off (a queue is full);
* UNAVAILABLE: retry (not bootstrapped yet, batch aborted, leader changing);
* UNKNOWN with `kvstore-outcome: unknown`: the commit may or may not have happened (W7): retry
  with the same request id, which the store applies at most once;
* FAILED_PRECONDITION with `kvstore-reason: request-id-expired`: the retry came after the
  request-id horizon; the original attempt's outcome is unknown and cannot be learnt here.

Every error the store raises *before anything of the request could have been committed* carries
`kvstore-outcome: none` ("definite": nothing was queued, or the batch was aborted). A client
must treat a write error without that mark (a dropped connection, CANCELLED, INTERNAL, a bare
UNKNOWN, a deadline) as an unknown outcome (DESIGN.md §3, W7): only the server can say that
nothing happened, and only this module says it.
"""

from __future__ import annotations

import grpc

LEADER_HINT_KEY = "kvstore-leader-hint"
SHARD_KEY = "kvstore-shard"
OUTCOME_KEY = "kvstore-outcome"
REASON_KEY = "kvstore-reason"
OUTCOME_NONE = "none"  # definite: nothing of the request was or will be committed
OUTCOME_UNKNOWN = "unknown"  # W7: it may or may not have committed
REASON_REQUEST_ID_EXPIRED = "request-id-expired"


class StoreError(Exception):
    """Base of every error the store reports to clients.

    Definite by default: raise a StoreError only where nothing of the request was committed or
    can still commit. The one exception is `UnknownOutcomeError`."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    definite = True

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ()


class InvalidRequestError(StoreError):
    """Malformed request or a broken limit; the message names the limit."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotLeaderError(StoreError):
    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, shard: int, leader_hint: str | None) -> None:
        where = f"; try {leader_hint}" if leader_hint else "; no leader known right now"
        super().__init__(f"this node does not lead shard {shard}{where}")
        self.shard = shard
        self.leader_hint = leader_hint

    def metadata(self) -> tuple[tuple[str, str], ...]:
        hint = ((LEADER_HINT_KEY, self.leader_hint),) if self.leader_hint else ()
        return ((SHARD_KEY, str(self.shard)), *hint)


class OverloadedError(StoreError):
    """A bounded queue is full; nothing was done."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(StoreError):
    """Retriable: the shard is bootstrapping, changing leader, or its batch was aborted."""

    code = grpc.StatusCode.UNAVAILABLE


class UnknownOutcomeError(StoreError):
    """W7: the write may or may not have committed. Retry with the same request id."""

    code = grpc.StatusCode.UNKNOWN
    definite = False


class RequestExpiredError(StoreError):
    """A retry whose request id may be older than the dedupe horizon: applying it could apply
    the request twice, and the store no longer knows whether the first attempt committed.
    Definite for this attempt (nothing is queued); the original outcome stays unknown."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REASON_KEY, REASON_REQUEST_ID_EXPIRED),)


class DeadlineError(StoreError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def to_status(error: StoreError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The gRPC code, details and trailing metadata for a store error: the one mapping, and the
    one place that tags an error definite (`kvstore-outcome: none`) or unknown."""
    outcome = OUTCOME_NONE if error.definite else OUTCOME_UNKNOWN
    return error.code, str(error), ((OUTCOME_KEY, outcome), *error.metadata())
