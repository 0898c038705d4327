"""The error contract end to end without a network: a server error, through the one mapping
(`kvstore.errors.to_status`), read back by the client from the google.rpc.Status alone."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from kvstore import errors, limits
from kvstore.client import Client
from kvstore.client.errors import (
    NO_DETAILS,
    Compacted,
    ErrorDetails,
    InvalidArgument,
    KvError,
    NotLeader,
    Overloaded,
    PermissionDenied,
    RequestExpired,
    TxnConflict,
    Unauthenticated,
    Unavailable,
    UnknownOutcome,
    details_of,
    error_from_status,
    metadata_dict,
)
from kvstore.server.interceptor import decode, method_label, request_id_of
from kvstore.v1 import kv_pb2

R = errors.Reason

# (server error, client class for a write, reason, retry delay s, violations, ErrorInfo metadata subset)
TABLE = [
    pytest.param(errors.InvalidRequestError("key must not be empty", field="key"), InvalidArgument, R.INVALID_ARGUMENT,
                 None, (("key", "key must not be empty"),), {"outcome": "none"}, id="invalid-field"),
    pytest.param(errors.InvalidRequestError("value has 9 bytes; limit MAX_VALUE_BYTES is 8", field="value",
                                            limit="MAX_VALUE_BYTES"), InvalidArgument, R.LIMIT_EXCEEDED, None,
                 (("value", "value has 9 bytes; limit MAX_VALUE_BYTES is 8"),), {"limit": "MAX_VALUE_BYTES"},
                 id="limit"),
    pytest.param(errors.NotLeaderError(3, "10.0.0.2:50051"), NotLeader, R.NOT_LEADER, None, (),
                 {"shard": "3", "leader": "10.0.0.2:50051", "outcome": "none"}, id="not-leader-hint"),
    pytest.param(errors.NotLeaderError(3, None), NotLeader, R.NOT_LEADER, errors.RETRY_NO_LEADER_MS / 1000, (),
                 {"shard": "3"}, id="not-leader-none-known"),
    pytest.param(errors.OverloadedError("queue full"), Overloaded, R.QUEUE_FULL, errors.RETRY_QUEUE_FULL_MS / 1000,
                 (), {"outcome": "none"}, id="queue-full"),
    pytest.param(errors.UnavailableError("bootstrapping"), Unavailable, R.UNAVAILABLE,
                 errors.RETRY_UNAVAILABLE_MS / 1000, (), {"outcome": "none"}, id="unavailable"),
    pytest.param(errors.UnknownOutcomeError("commit timed out"), UnknownOutcome, R.OUTCOME_UNKNOWN, None, (),
                 {"outcome": "unknown", "request_id": "rid-1"}, id="outcome-unknown"),
    pytest.param(errors.RequestExpiredError("too old"), RequestExpired, R.REQUEST_ID_EXPIRED, None, (),
                 {"outcome": "none"}, id="expired"),
    pytest.param(errors.TxnConflictError("key k locked", txn_id="t1"), TxnConflict, R.TXN_CONFLICT,
                 errors.RETRY_TXN_CONFLICT_MS / 1000, (), {"outcome": "none", "txn_id": "t1"}, id="txn-conflict"),
    pytest.param(errors.InternalError("bug"), UnknownOutcome, R.INTERNAL, None, (), {"outcome": "unknown"},
                 id="internal-is-unknown"),
    pytest.param(errors.CompactedError(2, 5, 40), Compacted, R.COMPACTED, None, (),
                 {"outcome": "none", "shard": "2", "revision": "5", "log_start": "40"}, id="compacted"),
    pytest.param(errors.PermissionDeniedError("role read may not Put"), PermissionDenied, R.PERMISSION_DENIED, None,
                 (), {"outcome": "none"}, id="permission-denied"),
    pytest.param(errors.UnauthenticatedError("no credentials"), Unauthenticated, R.UNAUTHENTICATED, None, (),
                 {"outcome": "none"}, id="unauthenticated"),
]


def _rich_only(trailing: errors.Trailers) -> list[tuple[str, str | bytes]]:
    """Only the google.rpc.Status: what a client in another language reads."""
    return [(k, v) for k, v in trailing if k == errors.STATUS_DETAILS_KEY]


@pytest.mark.parametrize(("error", "cls", "reason", "delay", "violations", "info"), TABLE)
def test_the_client_reads_the_status_details_alone(error: errors.StoreError, cls: type[KvError], reason: str,
                                                   delay: float | None, violations: tuple[tuple[str, str], ...],
                                                   info: dict[str, str]) -> None:
    code, message, trailing = errors.to_status(error, request_id="rid-1")
    status = status_pb2.Status.FromString(dict(trailing)[errors.STATUS_DETAILS_KEY])  # type: ignore[arg-type]
    assert status.code == code.value[0] and status.message == message == str(error)  # grpcurl shows these
    rich = details_of(_rich_only(trailing))
    assert rich.reason == reason
    assert rich.retry_delay_s == delay
    assert rich.violations == violations
    assert info.items() <= rich.info.items()
    client_error = error_from_status(code, message, metadata_dict(_rich_only(trailing)), request_id="rid-1",
                                     write=True, rich=rich)
    assert type(client_error) is cls
    assert client_error.reason == reason and client_error.field_violations == violations
    if isinstance(client_error, NotLeader):
        assert client_error.leader_hint == info.get("leader") and client_error.shard == 3
    if isinstance(client_error, Compacted):
        assert (client_error.shard, client_error.log_start) == (2, 40)


@pytest.mark.parametrize(("error", "cls", "reason", "delay", "violations", "info"), TABLE)
def test_the_legacy_trailers_say_the_same(error: errors.StoreError, cls: type[KvError], reason: str,
                                          delay: float | None, violations: tuple[tuple[str, str], ...],
                                          info: dict[str, str]) -> None:
    """Without the details (an older client's view), the kvstore-* trailers classify the same
    (INTERNAL has no class of its own there)."""
    code, message, trailing = errors.to_status(error)
    legacy = metadata_dict(trailing)
    assert errors.STATUS_DETAILS_KEY not in legacy
    client_error = error_from_status(code, message, legacy, write=True, rich=NO_DETAILS)
    assert type(client_error) is cls


def test_a_status_from_another_domain_or_broken_bytes_is_no_reason() -> None:
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason="QUEUE_FULL", domain="example.com", metadata={"outcome": "none"}))
    foreign = status_pb2.Status(code=8, message="x", details=[info]).SerializeToString()
    assert ErrorDetails.parse(foreign).reason == ""
    assert ErrorDetails.parse(b"\xff\xff not a status") == NO_DETAILS
    # gRPC's own RESOURCE_EXHAUSTED with a foreign status: not our full queue; for a write unknown.
    foreign_status = ErrorDetails.parse(foreign)
    read = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", {}, rich=foreign_status)
    write = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", {}, rich=foreign_status, write=True)
    assert type(read) is KvError and type(write) is UnknownOutcome


def test_decode_refuses_bytes_that_are_no_message_and_oversized_requests() -> None:
    assert decode(kv_pb2.PutRequest.FromString, kv_pb2.PutRequest(key=b"k").SerializeToString()).key == b"k"
    with pytest.raises(errors.InvalidRequestError) as bad:
        decode(kv_pb2.PutRequest.FromString, b"\xff\xff\xff\xff")
    assert bad.value.reason is R.INVALID_ARGUMENT and "not a valid protobuf message" in str(bad.value)
    with pytest.raises(errors.InvalidRequestError) as big:
        decode(kv_pb2.PutRequest.FromString, b"\x00" * (limits.MAX_REQUEST_BYTES + 1))
    assert big.value.reason is R.LIMIT_EXCEEDED and big.value.limit == "MAX_REQUEST_BYTES"
    assert decode(None, b"raw") == b"raw"


def test_method_labels_and_request_ids() -> None:
    assert method_label("/kvstore.v1.KVService/Put") == "Put"
    assert method_label("/kvstore.internal.v1.PeerService/ScanShards") == "Peer.ScanShards"
    assert method_label("/grpc.health.v1.Health/Check") is None
    assert request_id_of(kv_pb2.PutRequest(request_id="r")) == "r"
    assert request_id_of(kv_pb2.GetRequest()) == ""


def test_the_client_refuses_an_oversized_request_without_sending_it() -> None:
    # Nothing listens there: a request that was sent would fail otherwise.
    with Client(["127.0.0.1:1"], timeout_s=1) as client, pytest.raises(InvalidArgument) as info:
        client.put(b"k", b"v" * (limits.MAX_REQUEST_BYTES + 1))
    assert "MAX_REQUEST_BYTES" in str(info.value) and info.value.request_id
