"""`kvstore.client`: the pure policy (errors, retries, txn shard check) without any server, then
routing and retries over loopback against a small in-process fake of the KV and Cluster services.

The fake is only a scripted stand-in to observe what the client sends where; the real server is
tested end to end elsewhere.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from kvstore import errors as store_errors
from kvstore.client import (
    Cancelled,
    Client,
    Compacted,
    Compare,
    CrossShardTxn,
    DeadlineExceeded,
    DeleteResult,
    GetResult,
    InvalidArgument,
    KeyValue,
    KvError,
    NotLeader,
    Op,
    Overloaded,
    PermissionDenied,
    PutResult,
    RequestExpired,
    RetryAction,
    TxnAborted,
    TxnResult,
    Unauthenticated,
    Unavailable,
    UnknownOutcome,
    Unreachable,
    backoff_delay,
    error_from_status,
    retry_action,
    revisions_of,
    to_bytes,
    txn_keys,
    txn_route_key,
    txn_shard,
    write_attempt_is_definite,
)
from kvstore.client import watch as watch_module
from kvstore.client.errors import details_of, metadata_dict
from kvstore.client.requests import shard_revisions
from kvstore.client.retry import keep_unknown
from kvstore.client.watch import WatchResume, reopen_request
from kvstore.core.sharding import shard_of
from kvstore.errors import (
    LEADER_HINT_KEY,
    OUTCOME_KEY,
    OUTCOME_NONE,
    REASON_KEY,
    REASON_REQUEST_ID_EXPIRED,
    SHARD_KEY,
)
from kvstore.v1 import cluster_pb2, cluster_pb2_grpc, kv_pb2, kv_pb2_grpc

SC = grpc.StatusCode


def key_on(shard: int, shard_count: int, prefix: str = "k") -> bytes:
    """The first key `<prefix><n>` that lands on `shard`."""
    for n in range(10_000):
        key = f"{prefix}{n}".encode()
        if shard_of(key, shard_count) == shard:
            return key
    raise AssertionError("no key found")


# ============================================================================================
# Pure: error mapping and retry classification


class FakeRpcError(grpc.RpcError):
    """What grpc raises for a failed unary call: code, details, trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str = "", metadata: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(details)
        self._code, self._details, self._metadata = code, details, tuple(metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


HINT = {LEADER_HINT_KEY: "10.0.0.2:50051", SHARD_KEY: "3"}
UNKNOWN_OUTCOME = {OUTCOME_KEY: "unknown"}
NONE = {OUTCOME_KEY: OUTCOME_NONE}  # the server's "definite: nothing of the request committed"
DEFINITE = ((OUTCOME_KEY, OUTCOME_NONE),)  # the same, as trailing metadata
EXPIRED = {**NONE, REASON_KEY: REASON_REQUEST_ID_EXPIRED}

# Reads: mapped by code alone. (code, metadata, details, exception class, action)
CLASSIFY_TABLE = [
    pytest.param(SC.INVALID_ARGUMENT, {}, "key too long", InvalidArgument, RetryAction.FAIL, id="invalid"),
    pytest.param(SC.INVALID_ARGUMENT, UNKNOWN_OUTCOME, "x", InvalidArgument, RetryAction.FAIL, id="invalid-even-w-md"),
    pytest.param(SC.FAILED_PRECONDITION, HINT, "not leader", NotLeader, RetryAction.REDIRECT, id="not-leader-hint"),
    pytest.param(SC.FAILED_PRECONDITION, {SHARD_KEY: "3"}, "no leader", NotLeader, RetryAction.REROUTE,
                 id="not-leader-no-hint"),
    pytest.param(SC.FAILED_PRECONDITION, {}, "other", KvError, RetryAction.FAIL, id="precondition-not-ours"),
    pytest.param(SC.UNAVAILABLE, {}, "connection refused", Unavailable, RetryAction.REROUTE, id="unavailable"),
    pytest.param(SC.UNKNOWN, UNKNOWN_OUTCOME, "commit timed out", UnknownOutcome, RetryAction.REROUTE,
                 id="unknown-outcome-w7"),
    pytest.param(SC.UNKNOWN, {}, "Exception calling application", KvError, RetryAction.FAIL, id="unknown-bare"),
    pytest.param(SC.UNKNOWN, {OUTCOME_KEY: "committed"}, "x", KvError, RetryAction.FAIL, id="unknown-other-md"),
    pytest.param(SC.RESOURCE_EXHAUSTED, NONE, "queue full", Overloaded, RetryAction.BACKOFF, id="overloaded"),
    # gRPC's own RESOURCE_EXHAUSTED (a size cap) is no full queue of ours: retrying cannot help.
    pytest.param(SC.RESOURCE_EXHAUSTED, {}, "Sent message larger than max (3000000 vs. 2097152)", KvError,
                 RetryAction.FAIL, id="grpc-message-too-large"),
    pytest.param(SC.DEADLINE_EXCEEDED, {}, "Deadline Exceeded", DeadlineExceeded, RetryAction.FAIL, id="deadline"),
    pytest.param(SC.INTERNAL, {}, "boom", KvError, RetryAction.FAIL, id="internal"),
    pytest.param(SC.PERMISSION_DENIED, {}, "no", PermissionDenied, RetryAction.FAIL, id="permission-denied"),
    pytest.param(SC.UNAUTHENTICATED, {}, "no token", Unauthenticated, RetryAction.FAIL, id="unauthenticated"),
    pytest.param(SC.CANCELLED, {}, "Cancelled", Cancelled, RetryAction.FAIL, id="cancelled"),
    pytest.param(SC.UNAVAILABLE, NONE, "bootstrapping", Unavailable, RetryAction.REROUTE, id="unavailable-tagged"),
    pytest.param(SC.RESOURCE_EXHAUSTED, {}, "Stream removed (CLIENT: Received message larger than max (5 vs. 1))",
                 KvError, RetryAction.FAIL, id="grpc-response-too-large"),
]

# Writes: only the server's `kvstore-outcome: none` (or gRPC refusing the size before any handler
# ran) makes a failed attempt definite; anything else may have committed (W7).
WRITE_CLASSIFY_TABLE = [
    # untagged: an unknown outcome, whatever the code, retried elsewhere with the same id
    pytest.param(SC.UNAVAILABLE, {}, "Socket closed", UnknownOutcome, RetryAction.REROUTE, id="socket-closed"),
    # gRPC's pick or name-resolution failure: never sent, so definite even for a write (issue 34)
    pytest.param(SC.UNAVAILABLE, {}, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
                 "Failed to connect to remote host: Connection refused", Unreachable, RetryAction.REROUTE,
                 id="failed-to-connect"),
    pytest.param(SC.UNAVAILABLE, {}, "errors resolving nowhere.invalid:5000: [field:hostname lookup error]",
                 Unreachable, RetryAction.REROUTE, id="name-not-resolved"),
    pytest.param(SC.DEADLINE_EXCEEDED, {}, "failed to connect to all addresses", UnknownOutcome, RetryAction.REROUTE,
                 id="deadline-whatever-its-words"),
    pytest.param(SC.CANCELLED, {}, "Cancelled", UnknownOutcome, RetryAction.REROUTE, id="cancelled"),
    pytest.param(SC.INTERNAL, {}, "boom", UnknownOutcome, RetryAction.REROUTE, id="internal"),
    pytest.param(SC.UNKNOWN, {}, "Exception calling application", UnknownOutcome, RetryAction.REROUTE,
                 id="unknown-bare"),
    pytest.param(SC.UNKNOWN, UNKNOWN_OUTCOME, "commit timed out", UnknownOutcome, RetryAction.REROUTE,
                 id="unknown-outcome-w7"),
    pytest.param(SC.DEADLINE_EXCEEDED, {}, "Deadline Exceeded", UnknownOutcome, RetryAction.REROUTE, id="deadline"),
    pytest.param(SC.RESOURCE_EXHAUSTED, {}, "queue full", UnknownOutcome, RetryAction.REROUTE,
                 id="exhausted-untagged"),
    pytest.param(SC.INVALID_ARGUMENT, {}, "from a proxy", UnknownOutcome, RetryAction.REROUTE, id="invalid-untagged"),
    pytest.param(SC.FAILED_PRECONDITION, HINT, "not leader", UnknownOutcome, RetryAction.REROUTE,
                 id="not-leader-untagged"),
    pytest.param(SC.RESOURCE_EXHAUSTED, {}, "Stream removed (CLIENT: Received message larger than max (5 vs. 1))",
                 UnknownOutcome, RetryAction.REROUTE, id="grpc-response-too-large"),
    pytest.param(SC.RESOURCE_EXHAUSTED, {}, "Received message larger than max (5 vs. 1)", UnknownOutcome,
                 RetryAction.REROUTE, id="grpc-received-too-large-which-side"),
    # definite: the current mapping
    pytest.param(SC.INVALID_ARGUMENT, NONE, "key too long", InvalidArgument, RetryAction.FAIL, id="invalid"),
    pytest.param(SC.FAILED_PRECONDITION, {**NONE, **HINT}, "not leader", NotLeader, RetryAction.REDIRECT,
                 id="not-leader-hint"),
    pytest.param(SC.FAILED_PRECONDITION, {**NONE, SHARD_KEY: "3"}, "no leader", NotLeader, RetryAction.REROUTE,
                 id="not-leader-no-hint"),
    pytest.param(SC.UNAVAILABLE, NONE, "batch aborted", Unavailable, RetryAction.REROUTE, id="unavailable"),
    pytest.param(SC.RESOURCE_EXHAUSTED, NONE, "queue full", Overloaded, RetryAction.BACKOFF, id="overloaded"),
    pytest.param(SC.FAILED_PRECONDITION, NONE, "other", KvError, RetryAction.FAIL, id="precondition-not-ours"),
    pytest.param(SC.INTERNAL, NONE, "bug before queueing", KvError, RetryAction.FAIL, id="internal-tagged"),
    pytest.param(SC.PERMISSION_DENIED, NONE, "role read", PermissionDenied, RetryAction.FAIL, id="denied-tagged"),
    pytest.param(SC.UNAUTHENTICATED, NONE, "no token", Unauthenticated, RetryAction.FAIL, id="unauthenticated-tagged"),
    # gRPC's own refusal of call credentials (no server verdict) may follow a write it sent: unknown.
    pytest.param(SC.UNAUTHENTICATED, {}, "creds", UnknownOutcome, RetryAction.REROUTE, id="unauthenticated-untagged"),
    # gRPC's size errors are not read (no English matching): the client never sends a request
    # above MAX_REQUEST_BYTES (it refuses it first), so one of these is not from this client.
    pytest.param(SC.RESOURCE_EXHAUSTED, {}, "SERVER: Received message larger than max (3000000 vs. 2097152)",
                 UnknownOutcome, RetryAction.REROUTE, id="grpc-server-refused-size"),
]


@pytest.mark.parametrize(("code", "metadata", "details", "cls", "action"), CLASSIFY_TABLE)
def test_error_mapping_and_retry_action(
    code: grpc.StatusCode, metadata: dict[str, str], details: str, cls: type[KvError], action: RetryAction
) -> None:
    error = error_from_status(code, details, metadata, target="n1:1", request_id="rid")
    assert type(error) is cls
    assert retry_action(error) is action
    assert error.message == details  # the server's own text is kept
    assert error.code == code and error.target == "n1:1" and error.request_id == "rid"


@pytest.mark.parametrize(("code", "metadata", "details", "cls", "action"), WRITE_CLASSIFY_TABLE)
def test_write_error_mapping_and_retry_action(
    code: grpc.StatusCode, metadata: dict[str, str], details: str, cls: type[KvError], action: RetryAction
) -> None:
    error = error_from_status(code, details, metadata, target="n1:1", request_id="rid", write=True)
    assert type(error) is cls
    assert retry_action(error) is action
    # The server's word (the `none` tag), or gRPC's that nothing left the client (Unreachable).
    assert write_attempt_is_definite(metadata) is (cls not in (UnknownOutcome, Unreachable))
    assert error.message == details  # the server's (or gRPC's) own text is kept
    assert error.code == code and error.target == "n1:1" and error.request_id == "rid"


@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_request_id_expired_is_its_own_error_never_retried(write: bool) -> None:
    error = error_from_status(SC.FAILED_PRECONDITION, "first attempt 3 days ago", EXPIRED, request_id="r1",
                              write=write)
    assert type(error) is RequestExpired and retry_action(error) is RetryAction.FAIL
    assert error.request_id == "r1" and error.code == SC.FAILED_PRECONDITION
    assert "request id r1 expired" in error.message and "unknown" in error.message
    assert "first attempt 3 days ago" in error.message  # the server's reason is kept


def test_not_leader_exposes_hint_and_shard() -> None:
    error = error_from_status(SC.FAILED_PRECONDITION, "this node does not lead shard 3", HINT)
    assert isinstance(error, NotLeader)
    assert error.leader_hint == "10.0.0.2:50051" and error.shard == 3


def test_invalid_argument_is_also_a_value_error() -> None:
    assert issubclass(InvalidArgument, ValueError) and issubclass(CrossShardTxn, InvalidArgument)


@pytest.mark.parametrize("attempt", range(1, 12))
def test_backoff_is_exponential_capped_and_jittered(attempt: int) -> None:
    base, cap = 0.05, 1.0
    ceiling = min(cap, base * 2 ** (attempt - 1))
    delays = [backoff_delay(attempt, base, cap) for _ in range(200)]
    assert all(ceiling / 2 <= d <= ceiling for d in delays)
    assert len(set(delays)) > 1  # jitter


def test_to_bytes() -> None:
    assert to_bytes("ключ") == "ключ".encode()
    assert to_bytes(b"\xff") == b"\xff"
    with pytest.raises(InvalidArgument):
        to_bytes(3)  # type: ignore[arg-type]


# ============================================================================================
# Pure: txn building blocks and the single-shard check


def test_compare_and_op_to_protobuf() -> None:
    c = Compare.version("k", "==", 0).to_pb()
    assert (c.key, c.target, c.op, c.version) == (b"k", kv_pb2.Compare.TARGET_VERSION, kv_pb2.Compare.OP_EQUAL, 0)
    c = Compare.value(b"k", "!=", "v").to_pb()
    assert (c.target, c.op, c.value) == (kv_pb2.Compare.TARGET_VALUE, kv_pb2.Compare.OP_NOT_EQUAL, b"v")
    c = Compare.exists("k", False).to_pb()
    assert (c.target, c.op, c.exists, c.WhichOneof("operand")) == (
        kv_pb2.Compare.TARGET_EXISTS, kv_pb2.Compare.OP_EQUAL, False, "exists")
    c = Compare.mod_revision("k", ">", 7).to_pb()
    assert (c.target, c.op, c.mod_revision) == (kv_pb2.Compare.TARGET_MOD_REVISION, kv_pb2.Compare.OP_GREATER, 7)
    assert Op.put("k", "v").to_pb().put == kv_pb2.PutRequest(key=b"k", value=b"v")
    assert Op.delete("k").to_pb().WhichOneof("op") == "delete"
    assert Op.get("k").to_pb().get.key == b"k"
    with pytest.raises(InvalidArgument):
        Compare.version("k", ">=", 1)  # type: ignore[arg-type]


def test_txn_shard_single_shard() -> None:
    a, b = key_on(1, 4, "a"), key_on(1, 4, "b")
    assert txn_shard([Compare.version(a, "==", 0)], [Op.put(a, "1"), Op.put(b, "2")], [Op.get(b)], 4) == 1
    assert txn_shard([], [], [], 4) is None
    assert txn_keys([Compare.exists(a)], [Op.put(b, "x"), Op.get(a)], [Op.delete(b)]) == [a, b]


def test_a_txn_over_two_shards_goes_to_its_coordinator_shard() -> None:
    a, b = key_on(0, 4, "a"), key_on(2, 4, "b")
    assert txn_shard([Compare.version(b, "==", 0)], [Op.put(a, "x")], [], 4) == 0
    assert txn_route_key([Compare.version(b, "==", 0)], [Op.put(a, "x")], [], 4) == a
    assert txn_route_key([Compare.version(b, "==", 0)], [Op.put(a, "x")], [], None) == b
    assert txn_route_key([], [], [], 4) is None


# ============================================================================================
# Without a server: the retry loop, driven through the client's one-attempt seam


@dataclasses.dataclass
class Attempt:
    target: str
    method: str
    request: Message
    timeout: float


class Scripted:
    """Replaces `Client._invoke`: answers ShardMap from a fixed map and replays a script of
    outcomes (an exception to raise or a response to return) for every other method."""

    def __init__(self, client: Client, shard_count: int, leaders: dict[int, str], script: list[Any]) -> None:
        self.shard_count, self.leaders, self.script = shard_count, leaders, list(script)
        self.attempts: list[Attempt] = []
        client._invoke = self  # type: ignore[method-assign]
        client._sleep = self.sleep
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def __call__(self, target: str, method: str, request: Message, timeout: float) -> Message:
        self.attempts.append(Attempt(target, method, request, timeout))
        if method == "ShardMap":
            shards = [cluster_pb2.ShardInfo(shard=s, leader=self.leaders.get(s, "")) for s in range(self.shard_count)]
            return cluster_pb2.ShardMapResponse(shard_count=self.shard_count, served_by=target, shards=shards)
        outcome = self.script.pop(0)
        if callable(outcome) and not isinstance(outcome, BaseException | Message):
            outcome = outcome(timeout)  # e.g. `times_out`: takes the attempt's time first
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, Message)
        return outcome

    def calls(self, method: str) -> list[Attempt]:
        return [a for a in self.attempts if a.method == method]


def put_ok(revision: int = 10, replayed: bool = False) -> kv_pb2.PutResponse:
    return kv_pb2.PutResponse(result=kv_pb2.WriteResult(shard=0, revision=revision, replayed=replayed), version=1)


def times_out(timeout: float) -> FakeRpcError:
    """A script step: the node does not answer within the attempt's timeout."""
    time.sleep(timeout)
    return FakeRpcError(SC.DEADLINE_EXCEEDED, "Deadline Exceeded")


def request_ids(attempts: list[Attempt]) -> list[str]:
    return [a.request.request_id for a in attempts]  # type: ignore[attr-defined]


def first_attempt_times(attempts: list[Attempt]) -> list[int]:
    return [a.request.first_attempt_unix_ms for a in attempts]  # type: ignore[attr-defined]


def test_write_retries_reuse_one_request_id() -> None:
    client = Client(["n1:1"], max_attempts=5)
    s = Scripted(client, 1, {0: "n1:1"}, [
        FakeRpcError(SC.UNKNOWN, "commit outcome unknown", [(OUTCOME_KEY, "unknown")]),
        FakeRpcError(SC.UNAVAILABLE, "batch aborted", DEFINITE),
        FakeRpcError(SC.RESOURCE_EXHAUSTED, "queue full", DEFINITE),
        put_ok(replayed=True),
    ])
    before = int(time.time() * 1000)
    result = client.put("k", "v")
    after = int(time.time() * 1000)
    puts = s.calls("Put")
    assert len(puts) == 4
    ids = {p.request.request_id for p in puts}  # type: ignore[attr-defined]
    assert len(ids) == 1 and len(ids.pop()) == 32  # uuid4 hex, the same on every attempt
    assert result.request_id == puts[0].request.request_id  # type: ignore[attr-defined]
    assert result.replayed and result.revision == 10
    assert len(s.slept) == 3  # a backoff between attempts
    (first_ms,) = set(first_attempt_times(puts))  # set once, when the request was built
    assert before <= first_ms <= after


def test_caller_request_id_is_kept_for_delete_and_txn() -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {0: "n1:1"}, [
        FakeRpcError(SC.UNAVAILABLE, "x", DEFINITE),
        kv_pb2.DeleteResponse(result=kv_pb2.WriteResult(revision=3), deleted=True),
        FakeRpcError(SC.UNKNOWN, "?", [(OUTCOME_KEY, "unknown")]),
        kv_pb2.TxnResponse(succeeded=True, result=kv_pb2.WriteResult(revision=4)),
    ])
    assert client.delete("k", request_id="my-del").request_id == "my-del"
    assert client.txn([], [Op.put("k", "v")], request_id="my-txn").request_id == "my-txn"
    assert [a.request.request_id for a in s.calls("Delete")] == ["my-del", "my-del"]  # type: ignore[attr-defined]
    assert [a.request.request_id for a in s.calls("Txn")] == ["my-txn", "my-txn"]  # type: ignore[attr-defined]


def test_each_write_gets_a_fresh_request_id() -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {}, [put_ok(), put_ok()])
    client.put("a", "1")
    client.put("a", "1")
    assert len({a.request.request_id for a in s.calls("Put")}) == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(FakeRpcError(SC.INVALID_ARGUMENT, "value is 2000000 bytes; limit MAX_VALUE_BYTES", DEFINITE),
                     id="invalid"),
        pytest.param(FakeRpcError(SC.UNKNOWN, "failed before queueing", DEFINITE), id="unknown-tagged-none"),
        pytest.param(FakeRpcError(SC.INTERNAL, "bug", DEFINITE), id="internal"),
        pytest.param(FakeRpcError(SC.FAILED_PRECONDITION, "something else", DEFINITE),
                     id="precondition-without-shard"),
    ],
)
def test_definite_write_errors_are_not_retried(error: FakeRpcError) -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {}, [error, put_ok()])
    with pytest.raises(KvError) as info:
        client.put("k", "v")
    assert not isinstance(info.value, UnknownOutcome)
    assert len(s.calls("Put")) == 1 and not s.slept
    assert info.value.message == error.details()
    assert info.value.request_id == s.calls("Put")[0].request.request_id  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("error", "cls"),
    [
        pytest.param(FakeRpcError(SC.UNKNOWN, "Exception calling application"), KvError, id="unknown-bare"),
        pytest.param(FakeRpcError(SC.INTERNAL, "bug"), KvError, id="internal"),
        pytest.param(FakeRpcError(SC.CANCELLED, "Cancelled"), Cancelled, id="cancelled"),
        pytest.param(FakeRpcError(SC.INVALID_ARGUMENT, "bad consistency"), InvalidArgument, id="invalid"),
    ],
)
def test_reads_are_classified_by_code_alone(error: FakeRpcError, cls: type[KvError]) -> None:
    """A read changes nothing: an untagged error is no unknown outcome, and is raised as before."""
    client = Client(["n1:1"])
    s = Scripted(client, 1, {}, [error, kv_pb2.GetResponse()])
    with pytest.raises(KvError) as info:
        client.get("k")
    assert type(info.value) is cls and len(s.calls("Get")) == 1 and not s.slept


def test_untagged_unavailable_on_a_read_stays_unavailable() -> None:
    client = Client(["n1:1"], max_attempts=3)
    s = Scripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, "Socket closed")] * 3)
    with pytest.raises(Unavailable) as info:
        client.get("k")
    assert type(info.value) is Unavailable and len(s.calls("Get")) == 3


UNTAGGED_WRITE_ERRORS = [
    pytest.param(FakeRpcError(SC.UNAVAILABLE, "Socket closed"), id="socket-closed"),
    pytest.param(FakeRpcError(SC.CANCELLED, "Cancelled"), id="cancelled"),
    pytest.param(FakeRpcError(SC.INTERNAL, "Received RST_STREAM with error code 2"), id="internal"),
    pytest.param(FakeRpcError(SC.UNKNOWN, "Exception calling application"), id="unknown-bare"),
    pytest.param(FakeRpcError(SC.DEADLINE_EXCEEDED, "Deadline Exceeded"), id="deadline"),
    pytest.param(FakeRpcError(SC.RESOURCE_EXHAUSTED, "queue full"), id="exhausted-untagged"),
]


@pytest.mark.parametrize("error", UNTAGGED_WRITE_ERRORS)
@pytest.mark.parametrize("method", ["Put", "Delete", "Txn"])
def test_untagged_write_error_is_retried_with_the_same_id_then_unknown_outcome(
    error: FakeRpcError, method: str
) -> None:
    """Nobody said nothing happened: every attempt is retried with the same request id and first
    attempt time, and giving up says the outcome is unknown, with the id to retry with."""
    client = Client(["n1:1", "n2:2"], max_attempts=4)
    s = Scripted(client, 1, {}, [error] * 4)
    calls: dict[str, Callable[[], object]] = {
        "Put": lambda: client.put("k", "v"),
        "Delete": lambda: client.delete("k"),
        "Txn": lambda: client.txn([Compare.version("k", "==", 0)], [Op.put("k", "v")]),
    }
    with pytest.raises(UnknownOutcome) as info:
        calls[method]()
    attempts = s.calls(method)
    assert len(attempts) == 4 and len(s.slept) == 3
    assert [a.target for a in attempts] == ["n1:1", "n2:2", "n1:1", "n2:2"]  # rerouted
    (rid,) = set(request_ids(attempts))
    (first_ms,) = set(first_attempt_times(attempts))
    assert first_ms > 0
    assert info.value.request_id == rid and info.value.first_attempt_unix_ms == first_ms
    assert info.value.attempts == 4 and info.value.code == error.code()
    assert info.value.message == error.details()


@pytest.mark.parametrize("error", UNTAGGED_WRITE_ERRORS)
def test_untagged_write_error_then_success(error: FakeRpcError) -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {}, [error, put_ok(replayed=True)])
    assert client.put("k", "v").replayed
    assert len(set(request_ids(s.calls("Put")))) == 1


REFUSED = FakeRpcError(SC.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                       "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused")


@pytest.mark.parametrize("method", ["Put", "Delete", "Txn", "Get"])
def test_a_call_none_of_whose_attempts_reached_a_server_is_unreachable_and_definite(method: str) -> None:
    """Every connection refused: gRPC never sent the request, so nothing can have happened."""
    client = Client(["n1:1", "n2:2"], max_attempts=4)
    s = Scripted(client, 1, {}, [REFUSED] * 4)
    calls: dict[str, Callable[[], object]] = {
        "Put": lambda: client.put("k", "v"),
        "Delete": lambda: client.delete("k"),
        "Txn": lambda: client.txn([Compare.version("k", "==", 0)], [Op.put("k", "v")]),
        "Get": lambda: client.get("k"),
    }
    with pytest.raises(Unreachable) as info:
        calls[method]()
    assert len(s.calls(method)) == 4 and info.value.attempts == 4
    assert "nothing was sent" in info.value.message and "Connection refused" in info.value.message
    assert isinstance(info.value, Unavailable) and not isinstance(info.value, UnknownOutcome)


def test_unreachable_until_the_deadline_is_unreachable_not_a_deadline() -> None:
    with (Client([_free_address()], max_attempts=100_000, backoff_s=0.01, max_backoff_s=0.01) as client,
          pytest.raises(Unreachable) as info):
        client.put("k", "v", timeout_s=0.3)
    assert "before the deadline" in info.value.message and info.value.request_id and info.value.attempts > 1


def test_a_refused_connect_after_an_unknown_attempt_stays_unknown() -> None:
    client = Client(["n1:1", "n2:2"], max_attempts=3)
    Scripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, "Socket closed"), REFUSED, REFUSED])
    with pytest.raises(UnknownOutcome) as info:
        client.put("k", "v")
    assert info.value.attempts == 3


def test_a_refused_connect_after_a_definite_refusal_is_unavailable_not_unreachable() -> None:
    """A server was reached (and said nothing was done): definite, but not "no server reached"."""
    client = Client(["n1:1", "n2:2"], max_attempts=2)
    Scripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, "shard 0 bootstrapping", DEFINITE), REFUSED])
    with pytest.raises(Unavailable) as info:
        client.put("k", "v")
    assert type(info.value) is Unavailable and info.value.attempts == 2


def test_tagged_unavailable_is_still_unavailable_when_nothing_was_unknown() -> None:
    client = Client(["n1:1"], max_attempts=3)
    s = Scripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, "shard 0 bootstrapping", DEFINITE)] * 3)
    with pytest.raises(Unavailable) as info:
        client.put("k", "v")
    assert type(info.value) is Unavailable and len(s.calls("Put")) == 3
    assert info.value.request_id == request_ids(s.calls("Put"))[0]


def test_tagged_invalid_argument_is_raised_at_once() -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {}, [FakeRpcError(SC.INVALID_ARGUMENT, "key is 5000 bytes", DEFINITE), put_ok()])
    with pytest.raises(InvalidArgument):
        client.put("k", "v")
    assert len(s.calls("Put")) == 1 and not s.slept


def test_tagged_error_after_an_unknown_attempt_is_still_unknown() -> None:
    """Even a definite "invalid" for the retry says nothing about the first attempt."""
    client = Client(["n1:1"])
    s = Scripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, "Socket closed"),
                                 FakeRpcError(SC.INVALID_ARGUMENT, "limits changed", DEFINITE)])
    with pytest.raises(UnknownOutcome) as info:
        client.put("k", "v")
    assert len(s.calls("Put")) == 2 and info.value.attempts == 2
    assert "Socket closed" in str(info.value) and "limits changed" in str(info.value)
    assert info.value.request_id == request_ids(s.calls("Put"))[0]


def test_request_expired_is_never_retried_and_not_turned_into_unknown_outcome() -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {}, [
        FakeRpcError(SC.UNAVAILABLE, "Socket closed"),  # an unknown outcome first
        FakeRpcError(SC.FAILED_PRECONDITION, "older than the horizon", tuple(EXPIRED.items())),
        put_ok(),
    ])
    with pytest.raises(RequestExpired) as info:
        client.put("k", "v", request_id="old-id", first_attempt_unix_ms=1_600_000_000_000)
    assert type(info.value) is RequestExpired and len(s.calls("Put")) == 2
    assert info.value.request_id == "old-id" and info.value.first_attempt_unix_ms == 1_600_000_000_000
    assert "request id old-id expired" in str(info.value) and "unknown" in str(info.value)


def test_caller_first_attempt_time_is_sent_on_every_attempt() -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {0: "n1:1"}, [
        FakeRpcError(SC.UNAVAILABLE, "Socket closed"), put_ok(replayed=True),
        kv_pb2.DeleteResponse(), kv_pb2.TxnResponse(succeeded=True),
    ])
    client.put("k", "v", request_id="r1", first_attempt_unix_ms=1_700_000_000_123)
    client.delete("k", request_id="r2", first_attempt_unix_ms=1_700_000_000_456)
    client.txn([], [Op.put("k", "v")], request_id="r3", first_attempt_unix_ms=1_700_000_000_789)
    assert first_attempt_times(s.calls("Put")) == [1_700_000_000_123] * 2
    assert first_attempt_times(s.calls("Delete")) == [1_700_000_000_456]
    assert first_attempt_times(s.calls("Txn")) == [1_700_000_000_789]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"first_attempt_unix_ms": 1_700_000_000_000}, "give its request_id", id="without-request-id"),
        pytest.param({"request_id": "r", "first_attempt_unix_ms": 0}, "positive", id="zero"),
        pytest.param({"request_id": "r", "first_attempt_unix_ms": -5}, "positive", id="negative"),
        pytest.param({"request_id": "r", "first_attempt_unix_ms": 1.5}, "positive", id="float"),
    ],
)
def test_first_attempt_time_is_checked_before_sending(kwargs: dict[str, Any], message: str) -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {}, [put_ok()])
    with pytest.raises(InvalidArgument, match=message):
        client.put("k", "v", **kwargs)
    assert s.calls("Put") == []


def test_write_cut_short_by_the_callers_deadline_is_unknown_outcome() -> None:
    client = Client(["n1:1"], timeout_s=0.05, max_attempts=5)
    s = Scripted(client, 1, {}, [times_out] * 5)
    with pytest.raises(UnknownOutcome) as info:
        client.put("k", "v")
    assert len(s.calls("Put")) == 1
    assert str(info.value) == "deadline exceeded, outcome unknown: Deadline Exceeded"
    assert info.value.request_id == request_ids(s.calls("Put"))[0]
    assert info.value.first_attempt_unix_ms == first_attempt_times(s.calls("Put"))[0]


def test_write_cut_short_by_the_attempt_cap_then_deadline_is_unknown_outcome() -> None:
    client = Client(["n1:1", "n2:2"], timeout_s=0.3, attempt_timeout_s=0.1, max_attempts=100,
                    backoff_s=0.05, max_backoff_s=0.05)
    s = Scripted(client, 1, {}, [times_out] + [FakeRpcError(SC.UNAVAILABLE, "bootstrapping", DEFINITE)] * 99)
    client._sleep = time.sleep  # real time, so that the deadline passes in the backoff
    with pytest.raises(UnknownOutcome) as info:
        client.put("k", "v")
    assert str(info.value).startswith("deadline exceeded, outcome unknown: n1:1 did not answer within 0.1s; "
                                      "the retries then failed: bootstrapping")
    assert len(set(request_ids(s.calls("Put")))) == 1


def test_write_refused_until_the_deadline_is_a_definite_deadline_exceeded() -> None:
    """Every attempt was refused with the `none` tag: nothing committed, so no unknown outcome."""
    client = Client(["n1:1"], timeout_s=0.2, max_attempts=1000, backoff_s=0.02, max_backoff_s=0.02)
    s = Scripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, "bootstrapping", DEFINITE)] * 1000)
    client._sleep = time.sleep
    with pytest.raises(DeadlineExceeded) as info:
        client.put("k", "v")
    assert "bootstrapping" in str(info.value) and len(s.calls("Put")) > 1
    assert info.value.request_id == request_ids(s.calls("Put"))[0]


def test_write_whose_deadline_passed_before_any_attempt_is_deadline_exceeded() -> None:
    client = Client(["n1:1"], timeout_s=0.01)
    s = Scripted(client, 1, {}, [put_ok()])

    def slow_route(key: bytes | None, deadline: float, *, stale: bool = False) -> str:
        time.sleep(max(0.0, deadline - time.monotonic()) + 0.001)
        return "n1:1"

    client._route = slow_route  # type: ignore[method-assign]
    with pytest.raises(DeadlineExceeded) as info:
        client.put("k", "v")
    assert s.calls("Put") == [] and info.value.request_id is not None


def test_closing_the_client_after_an_unknown_attempt_keeps_the_unknown_outcome() -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {}, [FakeRpcError(SC.CANCELLED, "Cancelled")])
    real_sleep = s.sleep

    def close_then_sleep(seconds: float) -> None:  # closed while the client backs off
        client._invoke = Client._invoke.__get__(client)  # type: ignore[method-assign]
        client.close()
        real_sleep(seconds)

    client._sleep = close_then_sleep
    with pytest.raises(UnknownOutcome, match="closed") as info:
        client.put("k", "v")
    assert info.value.request_id == request_ids(s.calls("Put"))[0]


def test_unknown_outcome_is_not_hidden_by_later_failures() -> None:
    """After an attempt whose commit outcome is unknown, running out of retries on "nothing was
    done" errors must still report an unknown outcome (W7), with the id to retry with."""
    client = Client(["n1:1"], max_attempts=3)
    s = Scripted(client, 1, {}, [
        FakeRpcError(SC.UNKNOWN, "commit outcome unknown", [(OUTCOME_KEY, "unknown")]),
        FakeRpcError(SC.UNAVAILABLE, "leader changing", DEFINITE),
        FakeRpcError(SC.UNAVAILABLE, "leader changing", DEFINITE),
    ])
    with pytest.raises(UnknownOutcome) as info:
        client.put("k", "v")
    assert info.value.request_id == s.calls("Put")[0].request.request_id  # type: ignore[attr-defined]
    assert "commit outcome unknown" in str(info.value) and "leader changing" in str(info.value)
    assert info.value.attempts == 3


def test_invalid_argument_keeps_server_message_and_class() -> None:
    client = Client(["n1:1"])
    Scripted(client, 1, {}, [FakeRpcError(SC.INVALID_ARGUMENT, "key is 5000 bytes; limit MAX_KEY_BYTES is 4096",
                                          DEFINITE)])
    with pytest.raises(InvalidArgument, match="MAX_KEY_BYTES"):
        client.put("k", "v")


def test_attempts_are_bounded() -> None:
    client = Client(["n1:1", "n2:2"], max_attempts=4)
    s = Scripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, f"down {i}") for i in range(10)])
    with pytest.raises(Unavailable) as info:
        client.get("k")
    assert len(s.calls("Get")) == 4
    assert info.value.attempts == 4 and "after 4 attempts" in str(info.value)
    assert info.value.message == "down 3"  # the last error


def test_unavailable_tries_the_next_endpoint() -> None:
    client = Client(["n1:1", "n2:2", "n3:3"])
    s = Scripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, "refused"), FakeRpcError(SC.UNAVAILABLE, "refused"),
                                 kv_pb2.GetResponse(found=False)])
    client.get("k", consistency="stale")
    assert [a.target for a in s.calls("Get")] == ["n1:1", "n2:2", "n3:3"]


def test_redirect_follows_hint_without_waiting_and_refreshes_map() -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 1, {0: "n1:1"}, [
        FakeRpcError(SC.FAILED_PRECONDITION, "not leader", [(SHARD_KEY, "0"), (LEADER_HINT_KEY, "n2:2"), *DEFINITE]),
        put_ok(),
        put_ok(),
    ])
    client.put("k", "v")
    assert [a.target for a in s.calls("Put")] == ["n1:1", "n2:2"] and not s.slept
    maps_before = len(s.calls("ShardMap"))
    client.put("k", "v")
    assert len(s.calls("ShardMap")) == maps_before + 1  # the hint invalidated the cached map


def test_deadline_bounds_the_whole_call_and_each_attempt_gets_the_rest() -> None:
    client = Client(["n1:1"], timeout_s=0.3, max_attempts=1000, backoff_s=0.02, max_backoff_s=0.02)
    s = Scripted(client, 1, {}, [FakeRpcError(SC.UNAVAILABLE, "down")] * 1000)
    client._sleep = time.sleep  # real time, so that the deadline passes
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        client.get("k", consistency="stale")
    assert time.monotonic() - started < 1.0
    assert "down" in str(info.value)
    timeouts = [a.timeout for a in s.calls("Get")]
    assert timeouts[0] <= 0.3 and timeouts == sorted(timeouts, reverse=True)


def test_txn_spanning_shards_is_sent_once_to_its_coordinator_shard() -> None:
    client = Client(["n1:1"])
    s = Scripted(client, 4, {}, [kv_pb2.TxnResponse(succeeded=True, result=kv_pb2.WriteResult(shard=0, revision=9))])
    a, b = key_on(0, 4), key_on(3, 4)
    result = client.txn([Compare.version(b, "==", 0)], [Op.put(a, "x")])
    assert len(s.calls("Txn")) == 1 and result.shard == 0 and result.revision == 9


def test_txn_is_routed_to_the_leader_of_its_shard_and_results_are_parsed() -> None:
    client = Client(["n1:1"])
    a = key_on(2, 4)
    response = kv_pb2.TxnResponse(
        succeeded=False, result=kv_pb2.WriteResult(shard=2),  # a gets-only branch writes nothing
        results=[kv_pb2.TxnOpResult(get=kv_pb2.GetResponse(found=True, kv=kv_pb2.KeyValue(key=a, value=b"v",
                                                                                           version=2)))],
    )
    s = Scripted(client, 4, {2: "n3:3"}, [response])
    result = client.txn([Compare.version(a, "==", 0)], [Op.put(a, "x")], [Op.get(a)])
    assert s.calls("Txn")[0].target == "n3:3"
    assert not result.succeeded and result.revision is None
    (get,) = result.results
    assert isinstance(get, GetResult) and get.found and get.value == b"v" and get.header is None


def test_routing_asks_for_the_public_shard_map() -> None:
    """The map a client routes with is the public one (no node-to-node fields on the wire)."""
    client = Client(["n1:1"])
    s = Scripted(client, 1, {0: "n1:1"}, [put_ok()])
    client.put("k", "v")
    (fetch,) = s.calls("ShardMap")
    assert fetch.request == cluster_pb2.ShardMapRequest()


def test_shard_revisions_name_their_shard_and_are_checked() -> None:
    assert [(r.shard, r.revision) for r in shard_revisions({2: 9, 0: 0})] == [(0, 0), (2, 9)]
    assert shard_revisions({}) == []
    for bad in ({-1: 3}, {0: -1}, {0: True}, {"0": 1}):
        with pytest.raises(InvalidArgument, match="min_revisions"):
            shard_revisions(bad)  # type: ignore[arg-type]


def test_revisions_of_keeps_the_highest_revision_per_shard() -> None:
    writes = [PutResult(b"a", 0, 7, 1, False, "r"), PutResult(b"b", 1, 3, 1, False, "r"),
              DeleteResult(b"c", 0, 12, True, False, "r"), TxnResult(True, 1, None, False, (), "r"),
              PutResult(b"d", 0, 9, 1, False, "r")]
    assert revisions_of(writes) == {0: 12, 1: 3}
    assert revisions_of([]) == {}


def test_client_side_argument_errors() -> None:
    with pytest.raises(InvalidArgument):
        Client([])
    client = Client("n1:1, n2:2")  # a comma-separated string is accepted too
    assert client.endpoints == ("n1:1", "n2:2")
    with pytest.raises(InvalidArgument):
        client.get("k", consistency="eventual")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        client.scan(prefix="p", start="a")
    with pytest.raises(InvalidArgument):
        client.watch()
    with pytest.raises(InvalidArgument):
        client.put("k", "v", request_id="")
    with pytest.raises(InvalidArgument, match="min_revisions"):
        client.scan(prefix="p", consistency="stale", min_revisions={0: -1})


# ============================================================================================
# Over loopback: a fake cluster of in-process gRPC servers


@dataclasses.dataclass
class Failure:
    code: grpc.StatusCode
    details: str
    metadata: tuple[tuple[str, str], ...] = ()
    apply_first: bool = False  # the write happens, then the answer is lost (W7)


@dataclasses.dataclass
class Call:
    node: str
    method: str
    request: Any


class FakeCluster:
    """Nodes sharing one store. `leaders` is the truth (a non-leader answers with a hint);
    `advertised` is what ShardMap says (stale maps are set up by making them differ)."""

    def __init__(self, nodes: int = 2, shard_count: int = 2) -> None:
        self.shard_count = shard_count
        self.lock = threading.Lock()
        self.calls: list[Call] = []
        self.failures: dict[tuple[str, str], list[Failure]] = {}
        self.store: dict[bytes, kv_pb2.KeyValue] = {}
        self.responses: dict[str, Message] = {}  # request id -> first answer
        self.revision = 0
        self.hints = True
        self.watch_events: list[kv_pb2.WatchResponse] = []
        self.watch_registers = True  # a server that answers `created` first (every server now)
        self.watch_break_after: int | None = None  # end the stream with UNAVAILABLE after this many events
        # A server that names its start revisions, over a WAL of these changes (each with its shard
        # and mod_revision): a watch starts at its start_revisions (else 0), is told so in `created`.
        self.watch_log: list[kv_pb2.WatchResponse] | None = None
        self.watch_ends: list[int] = []  # with watch_log: each open ends its stream OK after this many changes
        self.servers: list[grpc.Server] = []
        self.addresses: list[str] = []
        for _ in range(nodes):
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            node = FakeNode(self, server)
            kv_pb2_grpc.add_KVServiceServicer_to_server(node, server)
            cluster_pb2_grpc.add_ClusterServiceServicer_to_server(node, server)
            port = server.add_insecure_port("127.0.0.1:0")
            node.address = f"127.0.0.1:{port}"
            server.start()
            self.servers.append(server)
            self.addresses.append(node.address)
        self.leaders = {s: self.addresses[s % nodes] for s in range(shard_count)}
        self.advertised: dict[int, str] | None = None

    def stop(self) -> None:
        for server in self.servers:
            server.stop(0)

    def fail(self, node: str, method: str, *failures: Failure) -> None:
        self.failures.setdefault((node, method), []).extend(failures)

    def calls_to(self, method: str, node: str | None = None) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.method == method and (node is None or c.node == node)]


class FakeNode(kv_pb2_grpc.KVServiceServicer, cluster_pb2_grpc.ClusterServiceServicer):
    def __init__(self, cluster: FakeCluster, server: grpc.Server) -> None:
        self.cluster, self.server, self.address = cluster, server, ""

    def _enter(self, method: str, request: Any, context: grpc.ServicerContext, key: bytes | None) -> Failure | None:
        c = self.cluster
        with c.lock:
            c.calls.append(Call(self.address, method, request))
            script = c.failures.get((self.address, method))
            failure = script.pop(0) if script else None
        if failure is not None and not failure.apply_first:
            self._abort(context, failure)
        if key is not None:
            shard = shard_of(key, c.shard_count)
            leader = c.leaders[shard]
            if leader != self.address:
                md = [*DEFINITE, (SHARD_KEY, str(shard))] + ([(LEADER_HINT_KEY, leader)] if c.hints else [])
                self._abort(context, Failure(SC.FAILED_PRECONDITION, f"this node does not lead shard {shard}",
                                             tuple(md)))
        return failure

    @staticmethod
    def _abort(context: grpc.ServicerContext, failure: Failure) -> None:
        context.set_trailing_metadata(failure.metadata)
        context.abort(failure.code, failure.details)

    def _write(self, request_id: str, apply: Callable[[int], Message]) -> Message:
        c = self.cluster
        with c.lock:
            if request_id in c.responses:
                first = c.responses[request_id]
                replay = type(first)()
                replay.CopyFrom(first)
                replay.result.replayed = True  # type: ignore[attr-defined]
                return replay
            c.revision += 1
            response = apply(c.revision)
            c.responses[request_id] = response
            return response

    def _put(self, key: bytes, value: bytes, revision: int) -> kv_pb2.PutResponse:
        old = self.cluster.store.get(key)
        kv = kv_pb2.KeyValue(key=key, value=value, version=(old.version if old else 0) + 1, mod_revision=revision,
                             create_revision=old.create_revision if old else revision)
        self.cluster.store[key] = kv
        shard = shard_of(key, self.cluster.shard_count)
        return kv_pb2.PutResponse(result=kv_pb2.WriteResult(shard=shard, revision=revision), version=kv.version)

    def Put(self, request: kv_pb2.PutRequest, context: grpc.ServicerContext) -> kv_pb2.PutResponse:
        failure = self._enter("Put", request, context, request.key)
        if request.key == b"":
            self._abort(context, Failure(SC.INVALID_ARGUMENT, "key must not be empty", DEFINITE))
        response = self._write(request.request_id, lambda rev: self._put(request.key, request.value, rev))
        if failure is not None:
            self._abort(context, failure)
        assert isinstance(response, kv_pb2.PutResponse)
        return response

    def Delete(self, request: kv_pb2.DeleteRequest, context: grpc.ServicerContext) -> kv_pb2.DeleteResponse:
        self._enter("Delete", request, context, request.key)

        def apply(rev: int) -> kv_pb2.DeleteResponse:
            existed = self.cluster.store.pop(request.key, None) is not None
            shard = shard_of(request.key, self.cluster.shard_count)
            return kv_pb2.DeleteResponse(result=kv_pb2.WriteResult(shard=shard, revision=rev), deleted=existed)

        response = self._write(request.request_id, apply)
        assert isinstance(response, kv_pb2.DeleteResponse)
        return response

    def Get(self, request: kv_pb2.GetRequest, context: grpc.ServicerContext) -> kv_pb2.GetResponse:
        stale = request.read.consistency == kv_pb2.CONSISTENCY_STALE
        self._enter("Get", request, context, None if stale else request.key)
        with self.cluster.lock:
            kv = self.cluster.store.get(request.key)
            header = kv_pb2.ReadHeader(shard=shard_of(request.key, self.cluster.shard_count),
                                       applied_revision=self.cluster.revision + 1, served_by=self.address)
        return kv_pb2.GetResponse(header=header, found=kv is not None, kv=kv)

    def Txn(self, request: kv_pb2.TxnRequest, context: grpc.ServicerContext) -> kv_pb2.TxnResponse:
        keys = [c.key for c in request.compares] + [getattr(o, o.WhichOneof("op")).key for o in request.success]
        self._enter("Txn", request, context, keys[0] if keys else None)

        def apply(rev: int) -> kv_pb2.TxnResponse:
            store = self.cluster.store
            ok = all((store[c.key].version if c.key in store else 0) == c.version for c in request.compares)
            results = []
            for op in request.success if ok else request.failure:
                if op.HasField("put"):
                    results.append(kv_pb2.TxnOpResult(put=self._put(op.put.key, op.put.value, rev)))
                elif op.HasField("get"):
                    kv = store.get(op.get.key)
                    results.append(kv_pb2.TxnOpResult(get=kv_pb2.GetResponse(found=kv is not None, kv=kv)))
            return kv_pb2.TxnResponse(succeeded=ok, results=results, result=kv_pb2.WriteResult(revision=rev))

        response = self._write(request.request_id, apply)
        assert isinstance(response, kv_pb2.TxnResponse)
        return response

    def Scan(self, request: kv_pb2.ScanRequest, context: grpc.ServicerContext) -> kv_pb2.ScanResponse:
        self._enter("Scan", request, context, None)
        limit = request.limit or 2
        with self.cluster.lock:
            keys = sorted(k for k in self.cluster.store if k.startswith(request.prefix) and k >= request.page_token)
            page = [self.cluster.store[k] for k in keys[:limit]]
        token = page[-1].key + b"\x00" if len(keys) > limit else b""
        return kv_pb2.ScanResponse(kvs=page, next_page_token=token)

    def Watch(self, request: kv_pb2.WatchRequest, context: grpc.ServicerContext) -> Iterator[kv_pb2.WatchResponse]:
        self._enter("Watch", request, context, None)
        events, break_after = self.cluster.watch_events, self.cluster.watch_break_after  # as of the open
        log = self.cluster.watch_log
        if log is not None:
            starts = {s: 0 for s in sorted({e.shard for e in log})}
            starts.update({b.shard: b.revision for b in request.start_revisions})
            yield kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_CREATED, start_revisions=[
                kv_pb2.ShardRevision(shard=s, revision=r) for s, r in starts.items()])
            events = [e for e in log if e.kv.mod_revision >= starts[e.shard]]
            self.cluster.watch_break_after = None  # each break happens once
            if self.cluster.watch_ends:  # an older node stopping: the stream just ends
                yield from events[:self.cluster.watch_ends.pop(0)]
                return
            if break_after is not None:
                yield from events[:break_after]
                context.abort(SC.UNAVAILABLE, "node went away")
            yield from events
        elif self.cluster.watch_registers:
            yield kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_CREATED)
            if break_after is not None:
                yield from events[:break_after]
                context.abort(SC.UNAVAILABLE, "node went away")
            yield from events
        while context.is_active():  # until the client cancels
            time.sleep(0.01)

    def ShardMap(self, request: cluster_pb2.ShardMapRequest, context: grpc.ServicerContext) -> Any:
        self._enter("ShardMap", request, context, None)
        leaders = self.cluster.advertised if self.cluster.advertised is not None else self.cluster.leaders
        return cluster_pb2.ShardMapResponse(
            shard_count=self.cluster.shard_count, topic="wal", served_by=self.address,
            shards=[cluster_pb2.ShardInfo(shard=s, leader=leaders.get(s, "")) for s in range(self.cluster.shard_count)])


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    fake = FakeCluster(nodes=2, shard_count=2)
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def client(cluster: FakeCluster) -> Iterator[Client]:
    with Client([cluster.addresses[0]], timeout_s=5.0, backoff_s=0.01) as c:
        yield c


def test_routes_each_key_to_its_shard_leader(cluster: FakeCluster, client: Client) -> None:
    a, b = cluster.addresses
    k0, k1 = key_on(0, 2), key_on(1, 2)
    assert client.put(k0, "v0").shard == 0
    assert client.put(k1, "v1").shard == 1
    assert [c.request.key for c in cluster.calls_to("Put", a)] == [k0]
    assert [c.request.key for c in cluster.calls_to("Put", b)] == [k1]
    got = client.get(k1)
    assert got.found and got.value == b"v1" and got.header is not None and got.header.served_by == b
    assert len(cluster.calls_to("ShardMap")) == 1  # cached


def test_follows_leader_hint_and_refreshes_map(cluster: FakeCluster, client: Client) -> None:
    a, b = cluster.addresses
    k1 = key_on(1, 2)
    cluster.advertised = {0: a, 1: a}  # stale: b leads shard 1
    assert client.put(k1, "v").revision > 0
    assert [c.node for c in cluster.calls_to("Put")] == [a, b]
    cluster.advertised = None  # the map caught up
    client.put(k1, "w")
    assert [c.node for c in cluster.calls_to("Put")] == [a, b, b]
    assert len(cluster.calls_to("ShardMap")) == 2  # refreshed after the hint


def test_not_leader_without_hint_refreshes_map_and_retries(cluster: FakeCluster, client: Client) -> None:
    a, b = cluster.addresses
    k1 = key_on(1, 2)
    cluster.advertised = {0: a, 1: a}
    cluster.hints = False  # "no leader known right now": the client must look again by itself

    def heal() -> None:  # the map catches up once the client was refused
        while not cluster.calls_to("Put"):
            time.sleep(0.001)
        cluster.advertised = None

    healer = threading.Thread(target=heal)
    healer.start()
    client.put(k1, "v")
    healer.join()
    puts = cluster.calls_to("Put")
    assert puts[0].node == a and puts[-1].node == b
    assert len({p.request.request_id for p in puts}) == 1


def test_unknown_outcome_is_retried_with_the_same_request_id(cluster: FakeCluster, client: Client) -> None:
    k0 = key_on(0, 2)
    leader = cluster.leaders[0]
    lost = Failure(SC.UNKNOWN, "commit outcome unknown", ((OUTCOME_KEY, "unknown"),), apply_first=True)
    cluster.fail(leader, "Put", lost, lost)
    result = client.put(k0, "v")
    puts = cluster.calls_to("Put", leader)
    assert len(puts) == 3
    assert {p.request.request_id for p in puts} == {result.request_id}
    assert result.replayed and result.version == 1  # applied once, whatever the retries
    assert client.get(k0).kv == KeyValue(k0, b"v", 1, result.revision, result.revision)


def test_untagged_write_error_is_retried_and_applied_once(cluster: FakeCluster, client: Client) -> None:
    """A bare UNKNOWN after the write happened (say, the handler crashed after the commit): the
    client cannot know, so it retries with the same id and gets the original answer."""
    k0 = key_on(0, 2)
    leader = cluster.leaders[0]
    cluster.fail(leader, "Put", Failure(SC.UNKNOWN, "Exception calling application", apply_first=True))
    result = client.put(k0, "v")
    puts = cluster.calls_to("Put", leader)
    assert len(puts) == 2 and {p.request.request_id for p in puts} == {result.request_id}
    assert len({p.request.first_attempt_unix_ms for p in puts}) == 1
    assert result.replayed and result.version == 1


def _aborted() -> Failure:
    """What a node answers when a cross-shard Txn aborted and its request id's outcome is recorded."""
    code, details, trailers = store_errors.to_status(store_errors.TxnAbortedError("aborted: locked", txn_id="t1"),
                                                     request_id="whatever")
    return Failure(code, details, tuple(trailers))  # type: ignore[arg-type]


def test_a_txn_aborted_is_definite_even_after_an_unknown_attempt_and_never_retried_as_is() -> None:
    failure = _aborted()
    error = error_from_status(failure.code, failure.details, metadata_dict(failure.metadata), request_id="r",
                              write=True, rich=details_of(failure.metadata))
    assert type(error) is TxnAborted and error.txn_id == "t1" and retry_action(error) is RetryAction.FAIL
    unknown = UnknownOutcome("timed out", request_id="r")
    assert keep_unknown(error, unknown, write=True) is error  # the request's recorded outcome: failed


def test_a_txn_aborted_is_sent_again_under_a_fresh_id_only_when_the_client_chose_it(cluster: FakeCluster,
                                                                                     client: Client) -> None:
    k0 = key_on(0, 2)
    leader = cluster.leaders[0]
    cluster.fail(leader, "Txn", _aborted())
    result = client.txn(success=[Op.put(k0, "v")])
    sent = cluster.calls_to("Txn", leader)
    assert len(sent) == 2 and sent[0].request.request_id != sent[1].request.request_id
    assert result.request_id == sent[1].request.request_id and result.succeeded
    cluster.fail(leader, "Txn", _aborted())
    with pytest.raises(TxnAborted) as raised:
        client.txn(success=[Op.put(k0, "w")], request_id="mine")
    assert raised.value.request_id == "mine" and len(cluster.calls_to("Txn", leader)) == 3


def test_untagged_read_error_is_not_retried(cluster: FakeCluster, client: Client) -> None:
    cluster.fail(cluster.addresses[0], "Get", Failure(SC.UNKNOWN, "Exception calling application"))
    with pytest.raises(KvError) as info:
        client.get(key_on(0, 2), consistency="stale")
    assert type(info.value) is KvError and len(cluster.calls_to("Get")) == 1


def test_invalid_argument_is_not_retried(cluster: FakeCluster, client: Client) -> None:
    cluster.leaders = {0: cluster.addresses[0], 1: cluster.addresses[0]}
    with pytest.raises(InvalidArgument, match="key must not be empty") as info:
        client.put(b"", "v")
    assert len(cluster.calls_to("Put")) == 1
    assert info.value.code == SC.INVALID_ARGUMENT and info.value.attempts == 1


def test_overloaded_then_unavailable_then_success(cluster: FakeCluster, client: Client) -> None:
    k0 = key_on(0, 2)
    leader = cluster.leaders[0]
    cluster.fail(leader, "Delete", Failure(SC.RESOURCE_EXHAUSTED, "queue full", DEFINITE),
                 Failure(SC.UNAVAILABLE, "shard 0 bootstrapping", DEFINITE))
    result = client.delete(k0)
    assert isinstance(result, DeleteResult) and not result.deleted
    assert len({c.request.request_id for c in cluster.calls_to("Delete")}) == 1
    assert len(cluster.calls_to("Delete")) == 3


def test_dead_endpoint_is_skipped(cluster: FakeCluster) -> None:
    dead = _free_address()
    with Client([dead, cluster.addresses[0]], timeout_s=5.0, backoff_s=0.01) as c:
        assert c.shard_map().shard_count == 2
        assert c.put(key_on(0, 2), "v").revision > 0
        assert c.get(key_on(0, 2), consistency="stale").found


def test_all_endpoints_dead_read_and_write_unreachable() -> None:
    """Real gRPC channels to closed ports: every connection refused, gRPC never sent the request,
    so the write is a definite failure (issue 34), not an unknown outcome."""
    with Client([_free_address(), _free_address()], timeout_s=3.0, max_attempts=3, backoff_s=0.01) as c:
        with pytest.raises(Unreachable):
            c.get("k")
        with pytest.raises(Unreachable) as info:
            c.put("k", "v")
        assert info.value.request_id and info.value.attempts == 3


def test_stale_read_goes_to_a_copy_of_the_shard(cluster: FakeCluster, client: Client) -> None:
    k1 = key_on(1, 2)
    client.put(k1, "v")
    result = client.get(k1, consistency="stale", min_revision=1)
    # The fake's map lists no copies: the shard's leader, which holds one (a real map lists every
    # caught-up copy, and stale reads take them in turn: test_replica_for_takes_the_copies_in_turn).
    assert result.header is not None and result.header.served_by == cluster.leaders[1]
    (call,) = cluster.calls_to("Get")
    assert call.request.read.consistency == kv_pb2.CONSISTENCY_STALE and call.request.read.min_revision == 1


def test_replica_for_takes_the_copies_in_turn() -> None:
    from kvstore.client.results import ReplicaInfo, ShardInfo, ShardMap
    from kvstore.client.transport import Router

    copies = (ReplicaInfo("a", "a:1", "replica", 5, 0, True, True), ReplicaInfo("b", "b:1", "learner", 1, 4),
              ReplicaInfo("c", "c:1", "follower", 5, 0))
    smap = ShardMap(1, "wal", "a:1", (ShardInfo(0, "a:1", 1, 5, 5, 0, 0, "a", True, copies, ("a", "b")),))
    router = Router(("x:1", "y:1"))
    first = router.replica_for(b"k", smap)
    router.rotate()
    second = router.replica_for(b"k", smap)
    assert {first, second} == {"a:1", "c:1"}  # never the learner: it has not caught up
    no_copies = ShardMap(1, "wal", "a:1", (ShardInfo(0, "a:1", 1, 5, 5, 0, 0, "a", True),))
    assert router.replica_for(b"k", no_copies) == "a:1"  # the leader


def test_txn_over_the_wire(cluster: FakeCluster, client: Client) -> None:
    a = key_on(1, 2, "lock")
    first = client.txn([Compare.version(a, "==", 0)], [Op.put(a, "me")], [Op.get(a)])
    assert first.succeeded and isinstance(first.results[0], PutResult) and first.results[0].version == 1
    second = client.txn([Compare.version(a, "==", 0)], [Op.put(a, "you")], [Op.get(a)])
    assert not second.succeeded
    (got,) = second.results
    assert isinstance(got, GetResult) and got.value == b"me"
    assert cluster.calls_to("Txn")[0].node == cluster.leaders[1]


def test_scan_all_follows_page_tokens(cluster: FakeCluster, client: Client) -> None:
    keys = [f"p/{i:02d}".encode() for i in range(7)]
    for key in keys:
        client.put(key, key)
    client.put("q", "other")
    page = client.scan(prefix="p/", limit=3)
    assert [kv.key for kv in page.kvs] == keys[:3] and page.more
    assert [kv.key for kv in client.scan_all(prefix="p/", limit=3)] == keys
    assert len(cluster.calls_to("Scan")) == 1 + 3


def test_watch_delivers_events_and_cancels(cluster: FakeCluster, client: Client) -> None:
    kv = kv_pb2.KeyValue(key=b"w", value=b"1", version=1, mod_revision=5)
    cluster.watch_events = [
        kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PUT, kv=kv, shard=1),
        kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_DELETE, kv=kv_pb2.KeyValue(key=b"w", mod_revision=6),
                             shard=1),
    ]
    with client.watch(prefix="w", start_revision=3) as watch:
        first, second = next(watch), next(watch)
        assert (first.type, first.kv.value, first.kv.mod_revision) == ("put", b"1", 5)
        assert (second.type, second.kv.key, second.kv.mod_revision) == ("delete", b"w", 6)
        threading.Timer(0.1, watch.cancel).start()  # from another thread, while next() blocks
        assert list(watch) == []
    (call,) = cluster.calls_to("Watch")
    assert call.request.prefix == b"w" and call.request.start_revision == 3


def test_watch_per_shard_start_revisions(cluster: FakeCluster, client: Client) -> None:
    cluster.watch_events = []
    with client.watch(prefix="w", start_revisions={2: 40, 0: 7}):
        pass
    (call,) = cluster.calls_to("Watch")
    assert [(r.shard, r.revision) for r in call.request.start_revisions] == [(0, 7), (2, 40)]
    assert not call.request.HasField("start_revision")
    with pytest.raises(InvalidArgument, match="not both"):
        client.watch(prefix="w", start_revision=1, start_revisions={0: 1})


def test_watch_retries_before_the_first_event(cluster: FakeCluster, client: Client) -> None:
    cluster.watch_events = [kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PUT, kv=kv_pb2.KeyValue(key=b"w"))]
    cluster.fail(cluster.addresses[0], "Watch", Failure(SC.UNAVAILABLE, "starting"))
    with client.watch(prefix="w") as watch:
        assert next(watch).kv.key == b"w"
    assert len(cluster.calls_to("Watch")) == 2


def test_watch_returns_once_registered_and_never_yields_created(cluster: FakeCluster, client: Client) -> None:
    """`created` is consumed by opening: the first event a caller sees is a change."""
    cluster.watch_events = [kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PUT, kv=kv_pb2.KeyValue(key=b"w"))]
    with client.watch(key="w") as watch:
        event = next(watch)
    assert event.type == "put" and event.kv.key == b"w"


def test_watch_that_is_never_registered_fails_within_the_open_deadline(cluster: FakeCluster) -> None:
    cluster.watch_registers = False  # an old or stuck server: the stream opens, `created` never comes
    with Client([cluster.addresses[0]], timeout_s=5.0, max_attempts=2, backoff_s=0.01,
                attempt_timeout_s=0.2) as c:
        started = time.monotonic()
        with pytest.raises(Unavailable, match="did not register the watch"):
            c.watch(prefix="w")
        assert time.monotonic() - started < 2.0
    assert len(cluster.calls_to("Watch")) == 2  # the per-attempt cap moved on, then the attempts ran out


def test_watch_from_now_that_breaks_after_registering_is_raised_not_reopened(
        cluster: FakeCluster, client: Client) -> None:
    """Registered, then lost before any change arrived: reopening "from now" could silently skip
    the changes in between, so the caller is told (and watches again from what it saw)."""
    cluster.watch_break_after = 0
    with client.watch(prefix="w") as watch, pytest.raises(Unavailable, match="node went away"):
        next(watch)
    assert len(cluster.calls_to("Watch")) == 1


def test_watch_with_a_start_revision_is_reopened_until_something_was_delivered(
        cluster: FakeCluster, client: Client) -> None:
    """From a start revision the server replays history: reopening before anything was delivered
    loses and repeats nothing."""
    cluster.watch_events = [kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PUT, kv=kv_pb2.KeyValue(key=b"w"))]
    cluster.watch_break_after = 0
    watch = client.watch(prefix="w", start_revision=0)
    cluster.watch_break_after = None  # the reopened stream works
    with watch:
        assert next(watch).kv.key == b"w"
    assert len(cluster.calls_to("Watch")) == 2


def change(shard: int, revision: int, key: bytes) -> kv_pb2.WatchResponse:
    return kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PUT, shard=shard,
                                kv=kv_pb2.KeyValue(key=key, value=b"v", mod_revision=revision))


# Shard 0's record at revision 5 holds two changes (a Txn): a break between them must neither lose
# nor repeat the second.
WAL_OF_CHANGES = [change(0, 5, b"wa"), change(0, 5, b"wb"), change(1, 3, b"wd"), change(0, 6, b"wc")]


@pytest.mark.parametrize("break_after", [0, 1, 2, 3])
def test_a_watch_that_breaks_resumes_where_it_stood_nothing_lost_nothing_repeated(
        cluster: FakeCluster, client: Client, break_after: int) -> None:
    cluster.watch_log = WAL_OF_CHANGES
    cluster.watch_break_after = break_after
    with client.watch(prefix="w") as watch:
        keys = [next(watch).kv.key for _ in WAL_OF_CHANGES]
    assert sorted(keys) == [b"wa", b"wb", b"wc", b"wd"]
    reopened = cluster.calls_to("Watch")[1:]
    assert len(reopened) == 1
    starts = {b.shard: b.revision for b in reopened[0].request.start_revisions}  # type: ignore[attr-defined]
    delivered = WAL_OF_CHANGES[:break_after]
    assert starts == {0: max([e.kv.mod_revision for e in delivered if e.shard == 0], default=0),
                      1: max([e.kv.mod_revision for e in delivered if e.shard == 1], default=0)}


def test_a_watch_whose_stream_just_ends_resumes_each_time_with_fresh_attempts(
        cluster: FakeCluster) -> None:
    """A stream that ends (a node stopping, an older server) is a break, not the end of the watch;
    and each resume has its own attempts: three breaks do not add up against max_attempts=2."""
    cluster.watch_log = WAL_OF_CHANGES
    cluster.watch_ends = [1, 2, 3]  # the first three streams end after 1, 2, 3 changes (replays included)
    with Client(cluster.addresses, max_attempts=2, backoff_s=0.001, max_backoff_s=0.001) as c, \
            c.watch(prefix="w") as watch:
        keys = [next(watch).kv.key for _ in WAL_OF_CHANGES]
    assert keys == [e.kv.key for e in WAL_OF_CHANGES] and len(cluster.calls_to("Watch")) == 4


def test_watch_resume_is_pure_and_bounded() -> None:
    resume = WatchResume(kv_pb2.WatchRequest(prefix=b"w"))
    assert resume.resume() is None  # no `created` yet (or an old server): no position
    resume.created(kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_CREATED, start_revisions=[
        kv_pb2.ShardRevision(shard=0, revision=5), kv_pb2.ShardRevision(shard=1, revision=9)]))
    assert resume.accept(change(0, 5, b"wa")) and resume.accept(change(0, 5, b"wb"))
    request = resume.resume()
    assert request is not None and request.prefix == b"w"
    assert [(b.shard, b.revision) for b in request.start_revisions] == [(0, 5), (1, 9)]
    # The resumed stream replays revision 5 of shard 0: its first two changes were delivered.
    assert not resume.accept(change(0, 5, b"wa")) and not resume.accept(change(0, 5, b"wb"))
    assert resume.accept(change(0, 6, b"wc")) and resume.reopens == 0
    error = Unavailable("node went away")
    for _ in range(3):
        assert reopen_request(resume, request, True, error, max_reopens=3) is not None
    assert reopen_request(resume, request, True, error, max_reopens=3) is None, "three reopens in a row, no change"
    gone = Compacted("history truncated", code=SC.OUT_OF_RANGE)
    assert reopen_request(WatchResume(request), request, True, gone, max_reopens=3) is None  # raised, saying so


def test_a_progress_event_moves_the_resume_position_and_is_never_delivered() -> None:
    resume = WatchResume(kv_pb2.WatchRequest(prefix=b"w", progress_notify=True))
    resume.created(kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_CREATED, start_revisions=[
        kv_pb2.ShardRevision(shard=0, revision=5), kv_pb2.ShardRevision(shard=1, revision=9)]))
    assert resume.accept(change(0, 6, b"wa"))

    def progress(shard: int, revision: int) -> kv_pb2.WatchResponse:
        return kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PROGRESS,
                                    start_revisions=[kv_pb2.ShardRevision(shard=shard, revision=revision)])

    assert not resume.accept(progress(0, 40))  # taken in, not a change
    assert not resume.accept(progress(1, 3))  # behind where shard 1 stands: nothing moves
    request = resume.resume()
    assert request is not None and request.progress_notify
    assert [(b.shard, b.revision) for b in request.start_revisions] == [(0, 40), (1, 9)]
    assert resume.accept(change(0, 40, b"wb")), "nothing of revision 40 was delivered before: nothing skipped"


def test_watch_uses_only_the_clients_public_retry_seam() -> None:
    """`Watch` retries as `Client` does through `route`, `connection`, `reroute` and the limits,
    never through the client's private members, which are free to change."""
    private = sorted({node.attr for node in ast.walk(ast.parse(inspect.getsource(watch_module)))
                      if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                      and not node.attr.startswith("__")
                      and isinstance(node.value, ast.Attribute) and node.value.attr == "_client"})
    assert not private, f"Watch reaches into Client's private members: {private}"


def test_scan_sends_per_shard_min_revisions(cluster: FakeCluster, client: Client) -> None:
    put0, put1 = client.put(key_on(0, 2), "a"), client.put(key_on(1, 2), "b")
    again0 = client.put(key_on(0, 2, "j"), "c")
    client.scan(prefix="k", consistency="stale", min_revisions=revisions_of([put0, put1, again0]))
    (call,) = cluster.calls_to("Scan")
    assert [(r.shard, r.revision) for r in call.request.min_revisions] == [(0, again0.revision), (1, put1.revision)]
    assert not call.request.read.HasField("min_revision")  # a scan never sends a shard-less minimum


def test_close_closes_channels(cluster: FakeCluster) -> None:
    c = Client(cluster.addresses, max_channels=1)
    c.put(key_on(0, 2), "v")
    c.put(key_on(1, 2), "v")  # a second address: the first channel is evicted
    assert len(c._channels) == 1
    c.close()
    assert not len(c._channels)
    with pytest.raises(KvError, match="closed"):
        c.get("k")


def test_an_evicted_channel_closes_after_its_grace_and_at_once_on_close() -> None:
    """A channel evicted for another stays usable for its grace (a call in flight on it, say a
    batch round's, is not cancelled), then closes; `close()` closes it at once."""
    from kvstore.client.transport import Channels

    def usable(conn: Any) -> bool:
        try:
            conn.kv.Get(kv_pb2.GetRequest(key=b"k"), timeout=0.05)
        except grpc.RpcError:
            return True  # reached gRPC's transport (nobody listens): the channel is open
        except ValueError:
            return False  # "Cannot invoke RPC on closed channel!"
        return True

    channels = Channels(1, evicted_grace_s=0.3)
    first = channels.get(_free_address())
    channels.get(_free_address())  # evicts the first
    assert usable(first)
    time.sleep(0.6)
    assert not usable(first)
    again = Channels(1, evicted_grace_s=30)
    evicted = again.get(_free_address())
    again.get(_free_address())
    again.close()
    assert not usable(evicted)


def _free_address() -> str:
    """A loopback address nobody listens on (connection refused, fast)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_move_progress_is_judged_from_the_copies_the_map_lists() -> None:
    from kvstore.client.moves import PlacementChange, describe, progress
    from kvstore.client.results import ReplicaInfo, ShardInfo, ShardMap

    def smap(*copies: ReplicaInfo) -> ShardMap:
        return ShardMap(2, "wal", "a:1", (ShardInfo(1, "a:1", 1, 5, 5, 0, 0, "a", True, copies, ("a", "c")),))

    change = PlacementChange(1, ("a", "b"), ("a", "c"))
    moving = progress(smap(ReplicaInfo("a", "a:1", "replica", 5, 0, True, True),
                           ReplicaInfo("b", "b:1", "retiring", 5, 0),
                           ReplicaInfo("c", "c:1", "learner", 2, 3)), [change])
    assert not moving.done and describe(moving.left[0]) == \
        "shard 1 -> a,c: c learning (lag 3); b still holds a copy"
    unstarted = progress(smap(ReplicaInfo("a", "a:1", "replica", 5, 0, True, True)), [change])
    assert describe(unstarted.left[0]) == "shard 1 -> a,c: c not started"
    done = progress(smap(ReplicaInfo("a", "a:1", "replica", 5, 0, True, True),
                         ReplicaInfo("c", "c:1", "replica", 5, 0, True, True),
                         ReplicaInfo("f", "f:1", "follower", 5, 0)), [change])
    assert done.done and describe(done.moves[0]) == "shard 1 -> a,c: done"
    assert not progress(ShardMap(2, "wal", "a:1", ()), [change]).done  # a map without the shard: not done


def test_a_status_that_carries_the_stores_outcome_is_read_by_it_not_by_grpcs_words() -> None:
    """A proxy relaying an upstream's pick failure, or any status with the store's own outcome:
    "failed to connect" there does not mean this request was never sent."""
    text = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.9:1: Connection refused"
    assert type(error_from_status(SC.UNAVAILABLE, text, {}, write=True)) is Unreachable
    assert type(error_from_status(SC.UNAVAILABLE, text, UNKNOWN_OUTCOME, write=True)) is UnknownOutcome
    assert type(error_from_status(SC.UNAVAILABLE, text, NONE, write=True)) is Unavailable


def test_channels_never_retry_on_their_own() -> None:
    """gRPC reports only its last attempt's status: a retry policy from a service config could
    hide an attempt that reached a server behind a later "failed to connect"."""
    from kvstore.client.transport import CHANNEL_OPTIONS

    assert ("grpc.enable_retries", 0) in CHANNEL_OPTIONS
