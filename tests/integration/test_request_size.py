"""The request-size contract against a real node (docs/limits.md, "Request sizes: two refusing zones"; issue 18 item 9).

Two refusing zones, pinned at their edges on a unary write, the issue's 2.7 MB WriteBatch, a read
and a server stream: a request above MAX_REQUEST_BYTES and up to the node's gRPC receive cap
(GRPC_MAX_MESSAGE_BYTES) is refused by the store itself (INVALID_ARGUMENT, ErrorInfo
LIMIT_EXCEEDED naming MAX_REQUEST_BYTES, counted by the interceptor); one above the cap is refused
by gRPC's transport (RESOURCE_EXHAUSTED, no status details, never reaching the interceptor). In
both the node stays up and no shard's state changes. The requests are sent as raw bytes, as any
gRPC client could: the Python client would refuse them itself before sending.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from kvstore import limits
from kvstore.core.sharding import shard_of
from kvstore.v1 import cluster_pb2, kv_pb2
from tests.conftest import unique
from tests.fuzz import contract
from tests.integration.store_process import StoreProcess
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka
SHARDS = 4
TIMEOUT_S = 30.0
CAP = limits.GRPC_MAX_MESSAGE_BYTES


@pytest.fixture(scope="module")
def node(kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    store = StoreProcess(kafka.bootstrap_servers, Path(tmp_path_factory.mktemp("size")) / "node",
                         unique("sz").replace("-", ""), shards=SHARDS, metrics=True)
    store.start()
    try:
        yield store
    finally:
        store.stop()


def _of_size(build: Callable[[int], Message], size: int) -> bytes:
    """The encoding of `build(n)` for the filler length n that makes it exactly `size` bytes."""
    n = size
    for _ in range(8):
        raw = build(n).SerializeToString()
        if len(raw) == size:
            return raw
        n += size - len(raw)
    raise AssertionError(f"no filler length gives {size} bytes")


def _key(shard: int, tag: str) -> bytes:
    return next(k for k in (f"size/{tag}/{i}".encode() for i in range(1000)) if shard_of(k, SHARDS) == shard)


def _put(size: int) -> bytes:
    return _of_size(lambda n: kv_pb2.PutRequest(key=b"size/put", value=b"v" * n), size)


def _get(size: int) -> bytes:
    return _of_size(lambda n: kv_pb2.GetRequest(key=b"k" * n), size)


def _watch(size: int) -> bytes:
    return _of_size(lambda n: kv_pb2.WatchRequest(prefix=b"p" * n), size)


def _write_batch(size: int) -> bytes:
    """Parts of values of MAX_VALUE_BYTES, one shard each, the last value cut to fit `size`: the
    shape of the fuzz case in the issue (2 700 036 bytes)."""
    def build(n: int) -> kv_pb2.WriteBatchRequest:
        parts, left, shard = [], n, 0
        while left > 0 or not parts:
            value = min(left, limits.MAX_VALUE_BYTES)
            mutation = kv_pb2.Mutation(key=_key(shard % SHARDS, str(shard)), value=b"w" * value)
            parts.append(kv_pb2.ShardMutations(shard=shard % SHARDS, mutations=[mutation]))
            left, shard = left - value, shard + 1
        return kv_pb2.WriteBatchRequest(shards=parts)
    return _of_size(build, size)


KEYS_WRITTEN = [b"size/put", *(_key(s % SHARDS, str(s)) for s in range(4))]
# (RPC path, server streaming, request of a given size)
RPCS: dict[str, tuple[str, bool, Callable[[int], bytes]]] = {
    "Put": ("/kvstore.v1.KVService/Put", False, _put),
    "WriteBatch": ("/kvstore.v1.KVService/WriteBatch", False, _write_batch),
    "Get": ("/kvstore.v1.KVService/Get", False, _get),
    "Watch": ("/kvstore.v1.KVService/Watch", True, _watch),
}


def _send(node: StoreProcess, rpc: str, raw: bytes) -> grpc.RpcError:
    path, streaming, _ = RPCS[rpc]
    assert node.channel is not None
    with pytest.raises(grpc.RpcError) as caught:
        if streaming:
            stream = node.channel.unary_stream(path)(raw, timeout=TIMEOUT_S)
            try:
                next(iter(stream))
            finally:
                stream.cancel()
        else:
            node.channel.unary_unary(path)(raw, timeout=TIMEOUT_S)
    return caught.value


def _digests(node: StoreProcess) -> list[bytes]:
    return [node.cluster_stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=s), timeout=TIMEOUT_S).sha256
            for s in range(SHARDS)]


def _requests_counted(node: StoreProcess, rpc: str) -> float:
    return node.metric("kvstore_requests_total", method=rpc)


def _still_fine(node: StoreProcess, before: list[bytes]) -> None:
    """Alive, serving, every shard's state as it was, nothing of the refused request written."""
    assert node.proc is not None and node.proc.poll() is None, "the node died"
    assert node.channel is not None
    health = health_pb2_grpc.HealthStub(node.channel).Check(
        health_pb2.HealthCheckRequest(service="kvstore.v1.KVService"), timeout=TIMEOUT_S)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert _digests(node) == before
    for key in KEYS_WRITTEN:
        assert not node.kv.Get(kv_pb2.GetRequest(key=key), timeout=TIMEOUT_S).found, key


def test_the_zones_are_ordered() -> None:
    """The store's zone exists only if the cap is above the request limit, with room for a
    request's framing: the reason the cap is what it is."""
    assert limits.MAX_VALUE_BYTES < limits.MAX_REQUEST_BYTES < CAP
    assert contract.zone_of(limits.MAX_REQUEST_BYTES) is contract.Zone.WITHIN
    assert contract.zone_of(CAP) is contract.Zone.STORE_REFUSES
    assert contract.zone_of(CAP + 1) is contract.Zone.TRANSPORT_REFUSES


@pytest.mark.parametrize("rpc", list(RPCS))
@pytest.mark.parametrize("size", [limits.MAX_REQUEST_BYTES + 1, CAP], ids=["limit+1", "cap"])
def test_above_the_request_limit_the_store_refuses_with_error_info(node: StoreProcess, rpc: str, size: int) -> None:
    raw = RPCS[rpc][2](size)
    assert len(raw) == size
    before, counted = _digests(node), _requests_counted(node, rpc)

    error = _send(node, rpc, raw)

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error  # type: ignore[attr-defined]
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, error
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)), status
    assert (info.domain, info.reason) == ("kvstore", "LIMIT_EXCEEDED"), info
    assert info.metadata["limit"] == "MAX_REQUEST_BYTES" and info.metadata["outcome"] == "none", info
    assert f"{size} bytes" in error.details(), error  # type: ignore[attr-defined]
    # The store answered: its interceptor counted the refusal.
    assert _requests_counted(node, rpc) == counted + 1
    assert node.metric("kvstore_requests_total", method=rpc, code="INVALID_ARGUMENT", reason="LIMIT_EXCEEDED") >= 1
    _still_fine(node, before)


@pytest.mark.parametrize("rpc", list(RPCS))
@pytest.mark.parametrize("size", [CAP + 1, 2_700_036], ids=["cap+1", "issue-2.7MB"])
def test_above_the_transport_cap_grpc_refuses_without_error_info(node: StoreProcess, rpc: str, size: int) -> None:
    raw = RPCS[rpc][2](size)
    assert len(raw) == size
    before, counted = _digests(node), _requests_counted(node, rpc)

    error = _send(node, rpc, raw)

    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error  # type: ignore[attr-defined]
    assert rpc_status.from_call(error) is None, "gRPC's transport answer carries no status details"  # type: ignore[arg-type]
    trailers = [key for key, _ in error.trailing_metadata() or ()]  # type: ignore[attr-defined]
    assert not [key for key in trailers if key.startswith("kvstore-")], trailers
    # The node's code never saw it: the interceptor counted nothing.
    assert _requests_counted(node, rpc) == counted
    _still_fine(node, before)


def test_at_the_request_limit_the_request_is_decoded_and_judged(node: StoreProcess) -> None:
    """The lower edge: exactly MAX_REQUEST_BYTES passes the size check, so the Put is validated
    and refused for its value (MAX_VALUE_BYTES), not for its size."""
    before = _digests(node)
    error = _send(node, "Put", _put(limits.MAX_REQUEST_BYTES))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error  # type: ignore[attr-defined]
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)), status
    assert info.reason == "LIMIT_EXCEEDED" and info.metadata["limit"] == "MAX_VALUE_BYTES", info
    _still_fine(node, before)
    # And the node still takes an ordinary write.
    assert node.kv.Put(kv_pb2.PutRequest(key=b"size/ok", value=b"ok"), timeout=TIMEOUT_S).version == 1
