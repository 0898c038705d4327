"""The answer a request must get, judged from what was sent and what came back: one pure rule for
the fuzz test, its table test and the size integration test (docs/limits.md).

A request's size puts it in one of three zones. Up to MAX_REQUEST_BYTES the store decides, and
every error it gives carries its ErrorInfo. Above MAX_REQUEST_BYTES and up to the node's gRPC
receive cap (GRPC_MAX_MESSAGE_BYTES) the store's interceptor refuses it, INVALID_ARGUMENT with
ErrorInfo reason LIMIT_EXCEEDED naming MAX_REQUEST_BYTES, before decoding it. Above the cap gRPC's
transport refuses it with RESOURCE_EXHAUSTED and no ErrorInfo: the node's code never sees those
bytes, so nothing of the store can have added one. That last answer is the only one allowed to
come without ErrorInfo, and only for a request that really was larger than the cap.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc

from kvstore import limits

# Clean answers: the request is wrong, not for this node, too much right now, or (a watch) still
# open. Never UNKNOWN, INTERNAL or UNIMPLEMENTED, which a client must read as an unknown outcome.
CLEAN = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


class Zone(enum.Enum):
    WITHIN = "within MAX_REQUEST_BYTES"
    STORE_REFUSES = "above MAX_REQUEST_BYTES"
    TRANSPORT_REFUSES = "above GRPC_MAX_MESSAGE_BYTES"


def zone_of(size_bytes: int) -> Zone:
    """Which part of the system answers a request of `size_bytes` (its encoded message, which is
    what both the interceptor and gRPC's receive cap measure)."""
    if size_bytes <= limits.MAX_REQUEST_BYTES:
        return Zone.WITHIN
    if size_bytes <= limits.GRPC_MAX_MESSAGE_BYTES:
        return Zone.STORE_REFUSES
    return Zone.TRANSPORT_REFUSES


@dataclass(frozen=True)
class Info:
    """The ErrorInfo of an answer, reduced to what the contract looks at."""

    domain: str
    reason: str
    metadata: dict[str, str] = field(default_factory=dict)


def problem(size_bytes: int, code: grpc.StatusCode, info: Info | None) -> str | None:
    """What is wrong with answering a request of `size_bytes` with `code` and `info` (None: the
    answer carried no ErrorInfo); None if the answer keeps the contract."""
    zone = zone_of(size_bytes)
    got = f"{code.name} with {'no ErrorInfo' if info is None else f'ErrorInfo {info.reason}'}"
    if zone is Zone.TRANSPORT_REFUSES:
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and info is None:
            return None
        return (f"a request of {size_bytes} bytes, above the transport cap GRPC_MAX_MESSAGE_BYTES="
                f"{limits.GRPC_MAX_MESSAGE_BYTES}, must get gRPC's RESOURCE_EXHAUSTED without ErrorInfo; got {got}")
    if code not in CLEAN:
        return f"an unclean status: {got}"
    if zone is Zone.STORE_REFUSES:
        if (code == grpc.StatusCode.INVALID_ARGUMENT and info is not None and info.domain == "kvstore"
                and info.reason == "LIMIT_EXCEEDED" and info.metadata.get("limit") == "MAX_REQUEST_BYTES"):
            return None
        return (f"a request of {size_bytes} bytes, above MAX_REQUEST_BYTES={limits.MAX_REQUEST_BYTES} and within "
                f"the transport cap, must get INVALID_ARGUMENT with ErrorInfo LIMIT_EXCEEDED naming "
                f"MAX_REQUEST_BYTES; got {got}{'' if info is None else f' {info.metadata}'}")
    if code == grpc.StatusCode.OK:
        return None
    if info is None:
        return f"an error without ErrorInfo from the store: {got}"
    if info.domain != "kvstore" or not info.reason:
        return f"an ErrorInfo that is not the store's: domain {info.domain!r}, reason {info.reason!r}"
    return None
