"""Any node serves any request (kvstore.server.forward), against three real node processes: a
plain gRPC client (no routing, as grpcurl) writes and reads through every node; the request id
survives the hop; a caller that routes itself gets NOT_LEADER with the leader in ErrorInfo; a
forwarded write whose leader stops answering is an unknown outcome (W7), and its retry with the
same request id applies it exactly once."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvstore import errors
from kvstore.core.sharding import shard_of
from kvstore.v1 import kv_pb2, kv_pb2_grpc
from tests.integration.helpers import REPO
from tests.integration.test_cluster import SHARDS, Cluster
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
TIMEOUT = 20


@pytest.fixture(scope="module")
def cluster(kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(kafka.bootstrap_servers, tmp_path_factory.mktemp("forwarding")).start()
    try:
        yield c
    finally:
        c.stop()


def stub(address: str) -> tuple[grpc.Channel, kv_pb2_grpc.KVServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, kv_pb2_grpc.KVServiceStub(channel)  # type: ignore[no-untyped-call]


def key_of(shard: int, prefix: str) -> bytes:
    return next(k for k in (f"{prefix}/{i}".encode() for i in range(1000)) if shard_of(k, SHARDS) == shard)


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    """The real grpcurl (`make test` builds it into .tools/), as a user without our client runs it."""
    found = sorted(REPO.glob(".tools/grpcurl-*/grpcurl"))
    assert found, "grpcurl is missing: `make test` builds it into .tools/ (the Makefile's $(GRPCURL) rule)"
    return subprocess.run([str(found[-1]), "-plaintext", *args], capture_output=True, text=True, timeout=60,
                          check=False)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, error
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)), status
    return info


def test_every_node_takes_writes_and_linearizable_reads_for_every_shard(cluster: Cluster) -> None:
    for node in cluster.nodes:
        channel, kv = stub(node.address)
        with channel:
            for shard in range(SHARDS):
                key = key_of(shard, f"any-{node.node_id}")
                put = kv.Put(kv_pb2.PutRequest(key=key, value=node.node_id.encode()), timeout=TIMEOUT)
                assert put.result.revision >= 0
                deleted = kv.Delete(kv_pb2.DeleteRequest(key=key_of(shard, "absent")), timeout=TIMEOUT)
                assert deleted is not None
                got = kv.Get(kv_pb2.GetRequest(key=key), timeout=TIMEOUT)  # linearizable (the default)
                assert got.found and got.kv.value == node.node_id.encode(), (node.node_id, shard, got)
                assert got.header.served_by == cluster.leader_of(shard).node_id  # the leader answered
    # Followers counted what they forwarded (a node leads some shards, never all four here).
    assert sum(n.metric("kvstore_forwarded_requests_total", method="Put") for n in cluster.nodes) > 0
    # Every node reads back every other node's writes.
    for node in cluster.nodes:
        channel, kv = stub(node.address)
        with channel:
            for writer in cluster.nodes:
                for shard in range(SHARDS):
                    got = kv.Get(kv_pb2.GetRequest(key=key_of(shard, f"any-{writer.node_id}")), timeout=TIMEOUT)
                    assert got.kv.value == writer.node_id.encode()


def test_a_write_batch_to_any_node_commits_every_part(cluster: Cluster) -> None:
    node = cluster.node(cluster.leader_of(0).node_id)  # it leads shard 0 at most, not all four
    parts = [kv_pb2.ShardMutations(shard=s, request_id=f"fwd-batch-{s}", mutations=[
        kv_pb2.Mutation(key=key_of(s, "batch"), value=b"b")]) for s in range(SHARDS)]
    channel, kv = stub(node.address)
    with channel:
        reply = kv.WriteBatch(kv_pb2.WriteBatchRequest(shards=parts), timeout=TIMEOUT)
        assert [r.shard for r in reply.results] == list(range(SHARDS))
        assert all(not r.HasField("error") for r in reply.results), reply
        for s in range(SHARDS):
            assert kv.Get(kv_pb2.GetRequest(key=key_of(s, "batch")), timeout=TIMEOUT).kv.value == b"b"


def test_the_request_id_survives_the_hop(cluster: Cluster) -> None:
    shard = 1
    leader = cluster.leader_of(shard)
    follower = next(n for n in cluster.nodes if n.node_id != leader.node_id)
    request = kv_pb2.PutRequest(key=key_of(shard, "rid"), value=b"once", request_id="fwd-rid-1")
    channel, kv = stub(follower.address)
    with channel:
        first = kv.Put(request, timeout=TIMEOUT)
    channel, kv = stub(leader.address)
    with channel:
        again = kv.Put(request, timeout=TIMEOUT)  # the same request at the leader: a replay, not a new write
        assert again.result.replayed and not first.result.replayed
        assert again.result.revision == first.result.revision
        assert kv.Get(kv_pb2.GetRequest(key=request.key), timeout=TIMEOUT).kv.version == 1


def test_a_caller_that_routes_itself_gets_not_leader_with_the_leader(cluster: Cluster) -> None:
    shard = 2
    leader = cluster.leader_of(shard)
    follower = next(n for n in cluster.nodes if n.node_id != leader.node_id)
    channel, kv = stub(follower.address)
    with channel, pytest.raises(grpc.RpcError) as refused:
        kv.Put(kv_pb2.PutRequest(key=key_of(shard, "routed"), value=b"x"), timeout=TIMEOUT,
               metadata=((errors.FORWARD_KEY, errors.FORWARD_NEVER),))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(refused.value)
    assert info.reason == "NOT_LEADER" and info.domain == "kvstore"
    assert info.metadata["leader"] == leader.address and info.metadata["shard"] == str(shard)
    assert info.metadata["outcome"] == "none"


def test_grpcurl_puts_through_every_node_and_shows_error_info(cluster: Cluster) -> None:
    """The issue's own words: grpcurl's Put succeeds against every node of a plaintext cluster,
    and grpcurl shows ErrorInfo for a not-leader write (one that asks not to be forwarded)."""
    cluster.wait_settled()
    for node in cluster.nodes:
        for shard in range(SHARDS):
            key = key_of(shard, f"grpcurl-{node.node_id}")
            done = grpcurl("-d", json.dumps({"key": b64(key), "value": b64(b"hi")}), node.address,
                           "kvstore.v1.KVService/Put")
            assert done.returncode == 0, (node.node_id, shard, done.stderr)
            assert json.loads(done.stdout)["version"] == "1", done.stdout  # int64 fields are JSON strings
    shard = 0
    leader = cluster.leader_of(shard)
    follower = next(n for n in cluster.nodes if n.node_id != leader.node_id)
    refused = grpcurl("-H", f"{errors.FORWARD_KEY}: {errors.FORWARD_NEVER}", "-d",
                      json.dumps({"key": b64(key_of(shard, "grpcurl-refused")), "value": b64(b"x")}),
                      follower.address, "kvstore.v1.KVService/Put")
    assert refused.returncode != 0
    shown = refused.stdout + refused.stderr
    assert "FailedPrecondition" in shown and "type.googleapis.com/google.rpc.ErrorInfo" in shown, shown
    assert '"reason": "NOT_LEADER"' in shown and leader.address in shown, shown


def test_a_forwarded_write_whose_leader_stops_answering_is_unknown_and_its_retry_applies_once(
        cluster: Cluster) -> None:
    shard = 3
    leader = cluster.leader_of(shard)
    follower = next(n for n in cluster.nodes if n.node_id != leader.node_id)
    request = kv_pb2.PutRequest(key=key_of(shard, "lost"), value=b"maybe", request_id="fwd-lost-1")
    assert leader.proc is not None
    leader.proc.send_signal(signal.SIGSTOP)
    try:
        channel, kv = stub(follower.address)
        with channel, pytest.raises(grpc.RpcError) as lost:
            kv.Put(request, timeout=3)
        # The follower's hop to the paused leader timed out before the caller's deadline: the
        # follower says the outcome is unknown and names the request id to retry with.
        assert lost.value.code() == grpc.StatusCode.UNKNOWN, lost.value
        info = error_info(lost.value)
        assert info.reason == "OUTCOME_UNKNOWN" and info.metadata["outcome"] == "unknown", info
        assert info.metadata["request_id"] == "fwd-lost-1"
    finally:
        leader.proc.send_signal(signal.SIGCONT)
    cluster.wait_settled()
    deadline = time.monotonic() + 60
    while True:  # retry with the same id, through any node, until it is answered
        channel, kv = stub(follower.address)
        try:
            with channel:
                kv.Put(request, timeout=TIMEOUT)
            break
        except grpc.RpcError as exc:
            assert time.monotonic() < deadline, exc
            time.sleep(0.5)
    channel, kv = stub(follower.address)
    with channel:
        got = kv.Get(kv_pb2.GetRequest(key=request.key), timeout=TIMEOUT)
    assert got.kv.value == b"maybe" and got.kv.version == 1  # applied once, whatever the first hop did
