"""gRPC security end to end, TLS + bearer tokens (docs/security.md): two real node processes on
loopback with certificates and tokens from the development CA; the nodes authenticate to each
other with a node token. Plaintext and unauthenticated calls are refused, each role may do what
the table says and no more (a refused write is definite and wrote nothing), a write sent to a node
that does not lead its shard is forwarded under the node's identity, and the Python client and
the CLI work with a CA and a token."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status

from kvstore.client import BatchIncomplete, PermissionDenied, Unauthenticated
from kvstore.internal.v1 import peer_pb2, peer_pb2_grpc
from kvstore.v1 import cluster_pb2, cluster_pb2_grpc, kv_pb2, kv_pb2_grpc
from tests.integration.secure_cluster import SHARDS, TOKENS, SecureCluster, key_of, kvstore
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
TIMEOUT = 20


@pytest.fixture(scope="module")
def cluster(kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    c = SecureCluster(kafka.bootstrap_servers, tmp_path_factory.mktemp("security"), TOKENS).start()
    try:
        yield c
    finally:
        c.stop()


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, error
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)), status
    return info


def kv(channel: grpc.Channel) -> Any:
    return kv_pb2_grpc.KVServiceStub(channel)  # type: ignore[no-untyped-call]


def test_a_plaintext_channel_to_the_tls_port_fails(cluster: SecureCluster) -> None:
    with grpc.insecure_channel(cluster.endpoints[0]) as channel, pytest.raises(grpc.RpcError) as refused:
        kv(channel).Get(kv_pb2.GetRequest(key=b"k"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "forged-token"])
def test_no_token_or_a_bad_one_is_unauthenticated(cluster: SecureCluster, token: str | None) -> None:
    security = cluster.security(None)
    if token is not None:
        security = type(security)(ca=security.ca, token=token)
    with security.channel(cluster.endpoints[0]) as channel:
        for call in (lambda: kv(channel).Get(kv_pb2.GetRequest(key=b"k"), timeout=5),
                     lambda: kv(channel).Put(kv_pb2.PutRequest(key=b"k", value=b"v"), timeout=5)):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = error_info(refused.value)
            assert info.reason == "UNAUTHENTICATED" and info.metadata["outcome"] == "none"
    with cluster.client(None) as client, pytest.raises(Unauthenticated):
        client.get("k")


def test_health_is_open_and_reflection_needs_read(cluster: SecureCluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = cluster.endpoints[0]
    with cluster.channel(address, None) as anonymous:
        reply = health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def services(channel: grpc.Channel) -> list[str]:
        call = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        replies = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        return [s.name for s in replies[0].list_services_response.service]

    with cluster.channel(address, None) as anonymous, pytest.raises(grpc.RpcError) as refused:
        services(anonymous)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with cluster.channel(address, "read") as reader:
        assert "kvstore.v1.KVService" in services(reader)


def test_a_read_token_reads_and_its_write_is_refused_definitely(cluster: SecureCluster) -> None:
    with cluster.client("write") as writer:
        writer.put("read-role/k", "v")
    with cluster.client("read") as reader:
        assert reader.get("read-role/k").value == b"v"
        assert [kv.key for kv in reader.scan_all(prefix="read-role/")] == [b"read-role/k"]
        with pytest.raises(PermissionDenied) as denied:
            reader.put("read-role/new", "v")
        assert denied.value.attempts == 1 and denied.value.reason == "PERMISSION_DENIED"  # not retried
        with pytest.raises(PermissionDenied):
            reader.fence(0)
    with cluster.channel(cluster.endpoints[1], "read") as channel, pytest.raises(grpc.RpcError) as refused:
        kv(channel).Put(kv_pb2.PutRequest(key=b"read-role/raw", value=b"v"), timeout=TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(refused.value).metadata["outcome"] == "none"  # definite
    with cluster.client("admin") as admin:
        assert not admin.get("read-role/new").found and not admin.get("read-role/raw").found  # nothing written


def test_batches_and_watches_carry_the_token(cluster: SecureCluster) -> None:
    with cluster.client("read") as reader, cluster.client("write") as writer:
        watch = reader.watch(prefix="watched/")
        try:
            result = writer.put_many({f"watched/{i}": "v" for i in range(8)})  # one WriteBatch per leader
            assert sum(1 for _ in result.revisions) >= 1
            seen = {next(watch).kv.key for _ in range(8)}
        finally:
            watch.cancel()
        assert seen == {f"watched/{i}".encode() for i in range(8)}
        with pytest.raises(BatchIncomplete) as refused:  # every part refused, each for the role
            reader.put_many({"watched/denied": "v"})
        assert refused.value.errors and all(isinstance(e, PermissionDenied) for e in refused.value.errors.values())
        assert not refused.value.unknown and not refused.value.committed
        with pytest.raises(Unauthenticated), cluster.client(None) as anonymous:
            anonymous.watch(prefix="watched/")


def test_write_token_writes_but_only_admin_fences(cluster: SecureCluster) -> None:
    with cluster.client("write") as writer:
        assert writer.put("write-role/k", "v").revision >= 0
        refusal = "token:dev-write (role write) may not call /kvstore.v1.ClusterService/FenceShard: it needs role admin"
        with pytest.raises(PermissionDenied, match=re.escape(refusal)):
            writer.fence(1)
    with cluster.client("admin") as admin:
        fenced = admin.fence(1)
        assert fenced.shard == 1 and fenced.end_offset >= 0
    cluster.wait_settled()  # the fenced leader stepped down and took the shard again
    # A refusal is logged with the caller's identity and role.
    logs = "".join(cluster.log_of(n) for n in cluster.nodes)
    assert "token:dev-write (role write)" in logs and '"event": "refused"' in logs


def test_a_write_to_a_node_that_does_not_lead_is_forwarded_under_tls(cluster: SecureCluster) -> None:
    smap = cluster.wait_settled()
    info = smap.shards[0]  # the group may give every shard to one node: use whichever does not lead it
    key = key_of(info.shard, "forwarded")
    other = next(n for n in cluster.nodes if n.node_id != info.leader_id)
    with cluster.channel(other.address, "write") as channel:
        # A plain stub, no routing metadata: `other` forwards to the leader as a node (its node token).
        assert kv(channel).Put(kv_pb2.PutRequest(key=key, value=b"fwd"), timeout=TIMEOUT).result.revision >= 0
        got = kv(channel).Get(kv_pb2.GetRequest(key=key), timeout=TIMEOUT)  # linearizable: the leader's
        assert got.found and got.kv.value == b"fwd" and got.header.served_by == info.leader_id
    assert other.metric("kvstore_forwarded_requests_total", method="Put") >= 1
    # A scan forwards the other node's shards through the peer service (role node).
    with cluster.client("read") as reader:
        assert [kv.key for kv in reader.scan_all(prefix="forwarded/")] == [key]


def test_the_peer_service_is_for_nodes_only(cluster: SecureCluster) -> None:
    with cluster.channel(cluster.endpoints[0], "admin") as channel, pytest.raises(grpc.RpcError) as refused:
        peer_pb2_grpc.PeerServiceStub(channel).LocalShardView(  # type: ignore[no-untyped-call]
            peer_pb2.LocalShardViewRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs role node" in str(refused.value.details())
    with cluster.channel(cluster.endpoints[0], "read") as channel:
        smap = cluster_pb2_grpc.ClusterServiceStub(channel).ShardMap(  # type: ignore[no-untyped-call]
            cluster_pb2.ShardMapRequest(), timeout=5)
    assert len(smap.nodes) == 2 and smap.shard_count == SHARDS  # its peers answered the node


def test_the_cli_with_ca_and_token(cluster: SecureCluster) -> None:
    endpoints = ",".join(cluster.endpoints)
    pki = cluster.pki
    put = kvstore({}, "--endpoints", endpoints, "--ca", str(pki.ca), "--token-file", str(pki.tokens["write"]),
                  "put", "cli/k", "from-cli")
    assert put.returncode == 0, put.stderr
    got = kvstore(cluster.cli_env("read"), "--endpoints", endpoints, "get", "cli/k", "--output", "json")
    assert got.returncode == 0 and json.loads(got.stdout)["value"] == "from-cli", got.stderr
    denied = kvstore(cluster.cli_env("read"), "--endpoints", endpoints, "put", "cli/k2", "v")
    assert denied.returncode == 1 and denied.stderr.startswith("kvstore: permission denied: "), denied.stderr
    anonymous = kvstore({"KVSTORE_CA": str(pki.ca)}, "--endpoints", endpoints, "get", "cli/k")
    assert anonymous.returncode == 1 and anonymous.stderr.startswith("kvstore: unauthenticated: "), anonymous.stderr
    plaintext = kvstore({}, "--endpoints", endpoints, "--timeout", "2", "get", "cli/k")
    # The TLS node closes a plaintext connection before gRPC has a channel to send on: nothing sent.
    assert plaintext.returncode == 4 and "Traceback" not in plaintext.stderr, plaintext.stderr
    assert plaintext.stderr.startswith("kvstore: unreachable, nothing was sent: "), plaintext.stderr
