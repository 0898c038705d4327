"""The store's error hierarchy and its one mapping to gRPC status codes.

Servers raise these; `to_status` is the only place that decides a gRPC code, and the client
(`kvstore.client`) reads the same metadata keys back. A client that sees:

* INVALID_ARGUMENT: fix the request (the message names the limit);
* FAILED_PRECONDITION with `kvstore-leader-hint`: ask that node instead (not the leader);
* RESOURCE_EXHAUSTED: back off (a queue is full);
* UNAVAILABLE: retry (not bootstrapped yet, batch aborted, leader changing);
* UNKNOWN with `kvstore-outcome: unknown`: the commit may or may not have happened (W7): retry
  with the same request id, which the store applies at most once.
"""

from __future__ import annotations

import grpc

LEADER_HINT_KEY = "kvstore-leader-hint"
SHARD_KEY = "kvstore-shard"
OUTCOME_KEY = "kvstore-outcome"


class StoreError(Exception):
    """Base of every error the store reports to clients."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

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

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((OUTCOME_KEY, "unknown"),)


class DeadlineError(StoreError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def to_status(error: StoreError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The gRPC code, details and trailing metadata for a store error: the one mapping."""
    return error.code, str(error), error.metadata()
