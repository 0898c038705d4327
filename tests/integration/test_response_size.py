"""Every response within MAX_RESPONSE_BYTES, below gRPC's send cap, against real nodes
(kvstore/limits.py, docs/limits.md).

The case found by fuzzing: three 900 000-byte values and one Scan with limit 3 made a node build a
2 700 071-byte answer, which its own gRPC send cap turned into RESOURCE_EXHAUSTED without
ErrorInfo. Now a Scan page stops early at the byte budget and says there is more (paging through
the Python client or raw gRPC returns every key once, in order), the part of a scan one node
serves another (PeerService.ScanShards) is bounded the same way, and a Txn whose answer would not
fit is refused with INVALID_ARGUMENT naming MAX_RESPONSE_BYTES, nothing written. The last test
runs the scatter-gather across two nodes, where the other leader's part is forwarded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from kvstore import limits
from kvstore.client import Client, InvalidArgument, Op
from kvstore.core.sharding import shard_of
from kvstore.internal.v1 import peer_pb2, peer_pb2_grpc
from kvstore.v1 import cluster_pb2, kv_pb2
from tests.conftest import unique
from tests.integration.store_process import StoreProcess
from tests.integration.test_cluster import Cluster
from tests.waiting import wait_until
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka
SHARDS = 4
TIMEOUT_S = 30.0
BIG = limits.MAX_VALUE_BYTES


@pytest.fixture(scope="module")
def node(kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    store = StoreProcess(kafka.bootstrap_servers, Path(tmp_path_factory.mktemp("resp")) / "node",
                         unique("rs").replace("-", ""), shards=SHARDS)
    store.start()
    try:
        yield store
    finally:
        store.stop()


def key_in(shard: int, tag: str, shards: int = SHARDS) -> bytes:
    return next(k for k in (f"{tag}/{i:03d}".encode() for i in range(1000)) if shard_of(k, shards) == shard)


def value_of(key: bytes, size: int) -> bytes:
    """A value that says whose it is, so a key served with another key's value would show."""
    return (key + b"|" + b"v" * size)[:size] if size else b""


def fill(client: Client, prefix: str, sizes: list[int]) -> dict[bytes, bytes]:
    """Keys `prefix/000`.. with values of `sizes`, spread over every shard by their hash."""
    written = {}
    for i, size in enumerate(sizes):
        key = f"{prefix}/{i:03d}".encode()
        value = value_of(key, size)
        client.put(key, value, timeout_s=TIMEOUT_S)
        written[key] = value
    assert len({shard_of(k, SHARDS) for k in written}) > 1, "the keys should span shards"
    return written


def raw_pages(stub: object, request: kv_pb2.ScanRequest) -> list[kv_pb2.ScanResponse]:
    """Every page of `request` through raw gRPC, following the token, each page checked bounded."""
    pages: list[kv_pb2.ScanResponse] = []
    token = b""
    for _ in range(10_000):
        page = stub.Scan(kv_pb2.ScanRequest(**_fields(request), page_token=token), timeout=TIMEOUT_S)  # type: ignore[attr-defined]
        assert page.ByteSize() <= limits.MAX_RESPONSE_BYTES, page.ByteSize()
        assert page.kvs or not page.next_page_token, "a page that has more holds its first key"
        pages.append(page)
        if not page.next_page_token:
            return pages
        assert page.next_page_token > token, "paging must progress"
        token = page.next_page_token
    raise AssertionError("paging did not end")


def _fields(request: kv_pb2.ScanRequest) -> dict[str, object]:
    return {field.name: value for field, value in request.ListFields()}


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, f"no status details: {error}"
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)), status
    return info


def digests(node: StoreProcess) -> list[tuple[bytes, int]]:
    out = []
    for shard in range(SHARDS):
        reply = node.cluster_stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=shard), timeout=TIMEOUT_S)
        out.append((reply.sha256, reply.keys))
    return out


def test_the_fuzz_case_three_large_values_scanned_with_limit_three(node: StoreProcess) -> None:
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        written = {key_in(s, "issue"): b"" for s in range(3)}
        for key in written:
            written[key] = value_of(key, BIG)
            client.put(key, written[key], timeout_s=TIMEOUT_S)
    page = node.kv.Scan(kv_pb2.ScanRequest(prefix=b"issue/", limit=3), timeout=TIMEOUT_S)
    assert len(page.kvs) == 1 and page.next_page_token == page.kvs[0].key + b"\x00"
    assert page.ByteSize() <= limits.MAX_RESPONSE_BYTES
    pages = raw_pages(node.kv, kv_pb2.ScanRequest(prefix=b"issue/", limit=3))
    assert [(kv.key, kv.value) for p in pages for kv in p.kvs] == sorted(written.items())


def test_large_values_over_several_pages_every_key_once_in_order_through_the_client(node: StoreProcess) -> None:
    # Large and small values interleaved across shards: pages end on bytes at varying counts.
    sizes = [BIG, 10, 400_000, 0, 300_000, BIG, 5, 200_000, 700_000, 1, BIG, 100_000, 50]
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        written = fill(client, "paged", sizes)
        for limit in (1000, 2, 0):  # the maximum, a small one, the server's default
            got = [(kv.key, kv.value) for kv in client.scan_all(prefix=b"paged/", limit=limit, timeout_s=TIMEOUT_S)]
            assert got == sorted(written.items()), f"limit {limit}"
        pages, token = [], b""
        while True:
            page = client.scan(prefix=b"paged/", limit=1000, page_token=token, timeout_s=TIMEOUT_S)
            pages.append(page)
            if not page.next_page_token:
                break
            token = page.next_page_token
    assert len(pages) >= 4, [len(p.kvs) for p in pages]  # ~5.5 MB of values in pages of at most 1 MiB
    assert all(0 < sum(len(kv.key) + len(kv.value) for kv in p.kvs) <= limits.MAX_RESPONSE_BYTES for p in pages)


def test_a_raw_scan_with_the_maximum_limit_over_large_values_is_one_bounded_page_with_more(
        node: StoreProcess) -> None:
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        written = fill(client, "raw", [BIG // 3] * 8)
    page = node.kv.Scan(kv_pb2.ScanRequest(prefix=b"raw/", limit=limits.MAX_SCAN_LIMIT), timeout=TIMEOUT_S)
    assert page.next_page_token, "a page cut by bytes says there is more"
    assert len(page.kvs) == 3 and page.ByteSize() <= limits.MAX_RESPONSE_BYTES, (len(page.kvs), page.ByteSize())
    assert [kv.key for kv in page.kvs] == sorted(written)[:3]
    assert page.next_page_token == page.kvs[-1].key + b"\x00"
    pages = raw_pages(node.kv, kv_pb2.ScanRequest(prefix=b"raw/", limit=limits.MAX_SCAN_LIMIT))
    assert [(kv.key, kv.value) for p in pages for kv in p.kvs] == sorted(written.items())
    # The bytes counted are the bytes sent: without values every key fits one page.
    keys_only = node.kv.Scan(kv_pb2.ScanRequest(prefix=b"raw/", limit=limits.MAX_SCAN_LIMIT, keys_only=True),
                             timeout=TIMEOUT_S)
    assert [kv.key for kv in keys_only.kvs] == sorted(written) and not keys_only.next_page_token
    assert not any(kv.value for kv in keys_only.kvs)


def test_the_part_a_node_serves_another_is_bounded_too(node: StoreProcess) -> None:
    """PeerService.ScanShards, what a gathering node asks the leader of other shards for."""
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        written = fill(client, "peer", [BIG // 2] * 6)
    assert node.channel is not None
    peer = peer_pb2_grpc.PeerServiceStub(node.channel)  # type: ignore[no-untyped-call]
    seen: list[bytes] = []
    token = b""
    while True:
        scan = kv_pb2.ScanRequest(prefix=b"peer/", limit=limits.MAX_SCAN_LIMIT, page_token=token)
        reply = peer.ScanShards(peer_pb2.ScanShardsRequest(scan=scan, shards=list(range(SHARDS))), timeout=TIMEOUT_S)
        assert reply.ByteSize() <= limits.MAX_RESPONSE_BYTES + 8 and 1 <= len(reply.scan.kvs) <= 2, reply.ByteSize()
        seen += [kv.key for kv in reply.scan.kvs]
        if not reply.scan.next_page_token:
            break
        token = reply.scan.next_page_token
    assert seen == sorted(written)


def _refused_for_its_answer(error: grpc.RpcError, field: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error  # type: ignore[attr-defined]
    info = error_info(error)
    assert (info.domain, info.reason) == ("kvstore", "LIMIT_EXCEEDED"), info
    assert info.metadata["limit"] == "MAX_RESPONSE_BYTES" and info.metadata["outcome"] == "none", info
    assert "MAX_RESPONSE_BYTES" in (error.details() or "")  # type: ignore[attr-defined]
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details if d.Is(error_details_pb2.BadRequest.DESCRIPTOR)), status
    assert [v.field for v in bad.field_violations] == [field]


def test_a_txn_whose_answer_would_exceed_the_budget_is_refused_and_changes_nothing(node: StoreProcess) -> None:
    shard = 2
    big = [key_in(shard, f"txn-big-{i}") for i in range(2)]
    fresh = key_in(shard, "txn-fresh")
    with Client([node.address], timeout_s=TIMEOUT_S) as client:
        for key in big:
            client.put(key, value_of(key, BIG), timeout_s=TIMEOUT_S)
    before = digests(node)
    gets = [kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=k)) for k in big]
    writing = kv_pb2.TxnRequest(request_id="resp-size-writing",
                                success=[kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=fresh, value=b"x")), *gets])
    cases = {
        "read-only": (kv_pb2.TxnRequest(success=gets), "success"),
        "writing": (writing, "success"),
        "writing, retried with the same id": (writing, "success"),
        "the failure branch": (kv_pb2.TxnRequest(
            compares=[kv_pb2.Compare(key=fresh, target=kv_pb2.Compare.TARGET_EXISTS, op=kv_pb2.Compare.OP_EQUAL,
                                     exists=True)],
            failure=gets, request_id="resp-size-failure"), "failure"),
    }
    for what, (request, field) in cases.items():
        with pytest.raises(grpc.RpcError) as caught:
            node.kv.Txn(request, timeout=TIMEOUT_S)
        try:
            _refused_for_its_answer(caught.value, field)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {exc}") from exc
    with Client([node.address], timeout_s=TIMEOUT_S) as client, pytest.raises(InvalidArgument) as refused:
        client.txn(success=[Op.get(k) for k in big])
    assert refused.value.reason == "LIMIT_EXCEEDED"
    assert digests(node) == before, "a refused Txn must change nothing"
    assert not node.kv.Get(kv_pb2.GetRequest(key=fresh), timeout=TIMEOUT_S).found
    # One large get fits, and the node still serves.
    one = node.kv.Txn(kv_pb2.TxnRequest(success=gets[:1]), timeout=TIMEOUT_S)
    assert one.results[0].get.kv.value == value_of(big[0], BIG)


@pytest.mark.slow
def test_a_scan_gathered_across_two_nodes_pages_large_values_in_order(
        kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The scatter-gather with a forwarded part: each node leads some shards and asks the other
    for the rest (ScanShards). Parts cut by bytes on either side must not make the merged page
    skip or repeat a key. Small and large values interleaved, so a part stops after one large
    value while the gathering node's own shards hold many small keys after it."""
    # One copy per shard: placement gives each node two of the four shards, so each leads some.
    # With copies on both nodes, which one leads is the leadership groups' choice, and nothing
    # makes it spread (a CI run saw one node lead all four).
    cluster = Cluster(kafka.bootstrap_servers, tmp_path_factory.mktemp("resp-two"), nodes=2,
                      extra_args=("--replication-factor", "1")).start()
    try:
        def both_lead() -> bool:
            return len({s.leader for s in cluster.wait_settled().shards}) == 2

        wait_until(both_lead, 60, interval_s=0.5, what="each of the two nodes to lead some shards")
        sizes = [BIG if i % 3 == 0 else 40_000 * (i % 4) for i in range(24)]
        with cluster.client() as client:
            written = fill(client, "two", sizes)
        expected = sorted(written.items())
        for member in cluster.nodes:
            for limit in (limits.MAX_SCAN_LIMIT, 3):
                pages = raw_pages(member.kv, kv_pb2.ScanRequest(prefix=b"two/", limit=limit))
                assert [(kv.key, kv.value) for p in pages for kv in p.kvs] == expected, (member.node_id, limit)
                served_by = {h.served_by for p in pages for h in p.headers}
                assert served_by == {n.node_id for n in cluster.nodes}, served_by  # a part was forwarded
            error = None
            try:  # the leader's refusal of an oversized Txn reaches a client of the other node unchanged
                shard = 1
                key = key_in(shard, "two-txn")
                with cluster.client() as client:
                    client.put(key, value_of(key, BIG), timeout_s=TIMEOUT_S)
                twice = [kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=key))] * 2
                member.kv.Txn(kv_pb2.TxnRequest(success=twice), timeout=TIMEOUT_S)
            except grpc.RpcError as exc:
                error = exc
            assert error is not None
            _refused_for_its_answer(error, "success")
    finally:
        cluster.stop()
