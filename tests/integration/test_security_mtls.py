"""gRPC security end to end, mutual TLS (docs/security.md): two real node processes that require a
client certificate from the development CA; a certificate's role is its URI SAN kvstore-role:<role>,
and the nodes call each other with their own certificates (role node)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from kvstore.client import ClientSecurity, PermissionDenied
from kvstore.v1 import kv_pb2, kv_pb2_grpc
from tests.integration.secure_cluster import MTLS, SecureCluster, key_of, kvstore
from wal.broker import LocalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
TIMEOUT = 20


@pytest.fixture(scope="module")
def cluster(kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    c = SecureCluster(kafka.bootstrap_servers, tmp_path_factory.mktemp("security-mtls"), MTLS).start()
    try:
        yield c
    finally:
        c.stop()


def test_without_a_client_certificate_there_is_no_connection(cluster: SecureCluster) -> None:
    for security in (cluster.security(None), ClientSecurity(ca=str(cluster.pki.ca), token="a-token-is-not-enough")):
        with security.channel(cluster.endpoints[0]) as channel, pytest.raises(grpc.RpcError) as refused:
            kv_pb2_grpc.KVServiceStub(channel).Get(kv_pb2.GetRequest(key=b"k"), timeout=5)  # type: ignore[no-untyped-call]
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(cluster.endpoints[0]) as channel, pytest.raises(grpc.RpcError) as plaintext:
        kv_pb2_grpc.KVServiceStub(channel).Get(kv_pb2.GetRequest(key=b"k"), timeout=5)  # type: ignore[no-untyped-call]
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_certificate_carries_the_role_without_a_token(cluster: SecureCluster) -> None:
    with cluster.client("write") as writer:
        assert writer.put("mtls/k", "v").revision >= 0
        with pytest.raises(PermissionDenied, match=r"cert:dev-write \(role write\) may not call .*FenceShard"):
            writer.fence(0)
    with cluster.client("read") as reader:
        assert reader.get("mtls/k").value == b"v"
        with pytest.raises(PermissionDenied, match=r"cert:dev-read \(role read\)"):
            reader.put("mtls/denied", "v")
    with cluster.client("admin") as admin:
        assert not admin.get("mtls/denied").found


def test_a_node_certificate_is_no_client_role_beyond_reads_and_writes(cluster: SecureCluster) -> None:
    node = cluster.pki.nodes["n1"]
    as_node = ClientSecurity(ca=str(cluster.pki.ca), cert=str(node.cert), key=str(node.key))
    with as_node.channel(cluster.endpoints[1]) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)  # type: ignore[no-untyped-call]
        assert stub.Put(kv_pb2.PutRequest(key=b"mtls/node", value=b"v"), timeout=TIMEOUT) is not None
    from kvstore.v1 import cluster_pb2, cluster_pb2_grpc

    with as_node.channel(cluster.endpoints[1]) as channel, pytest.raises(grpc.RpcError) as refused:
        cluster_pb2_grpc.ClusterServiceStub(channel).FenceShard(  # type: ignore[no-untyped-call]
            cluster_pb2.FenceShardRequest(shard=0), timeout=TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_forwarding_between_nodes_with_their_certificates(cluster: SecureCluster) -> None:
    smap = cluster.wait_settled()  # both nodes listed: LocalShardView between them passed mutual TLS
    # The group may give every shard to one node: send to whichever node does not lead the shard.
    info = smap.shards[0]
    sender = next(n for n in cluster.nodes if n.node_id != info.leader_id)
    key = key_of(info.shard, "mtls-fwd")
    with cluster.channel(sender.address, "write") as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)  # type: ignore[no-untyped-call]
        assert stub.Put(kv_pb2.PutRequest(key=key, value=b"fwd"), timeout=TIMEOUT).result.revision >= 0
        got = stub.Get(kv_pb2.GetRequest(key=key), timeout=TIMEOUT)
    assert got.found and got.header.served_by == info.leader_id
    assert sender.metric("kvstore_forwarded_requests_total", method="Put") >= 1


def test_the_cli_with_a_client_certificate(cluster: SecureCluster) -> None:
    endpoints = ",".join(cluster.endpoints)
    write = cluster.pki.clients["write"]
    put = kvstore({}, "--endpoints", endpoints, "--ca", str(cluster.pki.ca), "--cert", str(write.cert),
                  "--key", str(write.key), "put", "mtls-cli/k", "v1")
    assert put.returncode == 0, put.stderr
    got = kvstore(cluster.cli_env("read"), "--endpoints", endpoints, "get", "mtls-cli/k", "--output", "json")
    assert got.returncode == 0 and json.loads(got.stdout)["value"] == "v1", got.stderr
