"""WriteBatch end to end: a real node process, a real broker, real LevelDB, gRPC over loopback."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvstore import errors
from kvstore.client import BatchingWriter, Client, Op
from kvstore.core.sharding import shard_of
from kvstore.v1 import kv_pb2
from tests.conftest import unique
from tests.integration.store_process import StoreProcess
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka
SHARDS = 4


@pytest.fixture(scope="module")
def node(kafka: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    store = StoreProcess(kafka.bootstrap_servers, tmp_path_factory.mktemp("batch") / "node",
                         unique("batch").replace("-", ""), shards=SHARDS, metrics=True)
    store.start()
    try:
        yield store
    finally:
        store.stop()


@pytest.fixture
def client(node: StoreProcess) -> Iterator[Client]:
    with Client([node.address], timeout_s=20) as c:
        yield c


def read_all(client: Client, prefix: bytes) -> dict[bytes, tuple[bytes, int]]:
    return {kv.key: (kv.value, kv.version) for kv in client.scan_all(prefix=prefix, limit=1000)}


def test_put_many_spans_shards_one_record_each_and_a_retry_applies_nothing(client: Client) -> None:
    items = {f"pm/{i:04d}".encode(): f"v{i}".encode() for i in range(2000)}
    first = client.put_many(items, request_id="pm-1")
    assert [p.shard for p in first.shards] == list(range(SHARDS)) and first.mutations == 2000
    assert not any(p.replayed for p in first.shards)
    assert read_all(client, b"pm/") == {k: (v, 1) for k, v in items.items()}
    for key in list(items)[:20]:  # every mutation of a part landed at the part's revision
        assert client.get(key).kv.mod_revision == first.revisions[shard_of(key, SHARDS)]  # type: ignore[union-attr]
    again = client.put_many(items, request_id="pm-1", first_attempt_unix_ms=int(time.time() * 1000))
    assert all(p.replayed for p in again.shards) and again.revisions == first.revisions
    assert read_all(client, b"pm/") == {k: (v, 1) for k, v in items.items()}, "a replay must not write again"


def test_puts_and_deletes_apply_in_order_within_a_part(client: Client) -> None:
    key = next(f"ord/{i}".encode() for i in range(100) if shard_of(f"ord/{i}".encode(), SHARDS) == 2)
    client.write_batch([Op.put(key, "a"), Op.put(key, "b"), Op.delete(key), Op.put(key, "c")])
    got = client.get(key).kv
    assert got is not None and (got.value, got.version) == (b"c", 1), "deleted, then created again"


def test_a_broken_part_refuses_the_whole_call_naming_the_rule(node: StoreProcess) -> None:
    wrong = next(k for k in (f"bad/{i}".encode() for i in range(100)) if shard_of(k, SHARDS) == 1)
    fine = next(k for k in (f"bad/{i}".encode() for i in range(100)) if shard_of(k, SHARDS) == 0)
    request = kv_pb2.WriteBatchRequest(shards=[
        kv_pb2.ShardMutations(shard=0, mutations=[kv_pb2.Mutation(key=fine, value=b"x")]),
        kv_pb2.ShardMutations(shard=3, mutations=[kv_pb2.Mutation(key=wrong, value=b"x")])])
    with pytest.raises(grpc.RpcError) as caught:
        node.kv.WriteBatch(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "belongs to shard 1, not to shard 3" in (caught.value.details() or "")
    assert dict(caught.value.trailing_metadata() or ()).get(errors.OUTCOME_KEY) == errors.OUTCOME_NONE
    got = node.kv.Get(kv_pb2.GetRequest(key=fine), timeout=10)
    assert not got.found, "nothing of a refused batch is written"


def test_batching_writer_from_many_threads(node: StoreProcess, client: Client) -> None:
    threads, per_thread = 8, 400
    before = node.metric("kvstore_requests_total", method="WriteBatch", code="OK")
    results: dict[bytes, int] = {}
    lock = threading.Lock()
    with BatchingWriter(client, linger_ms=5, max_batch_mutations=500) as writer:
        def work(t: int) -> None:
            futures = {f"bw/{t}/{i:04d}".encode(): writer.put(f"bw/{t}/{i:04d}", f"{t}-{i}")
                       for i in range(per_thread)}
            for key, future in futures.items():
                revision = future.result(timeout=30).revision
                with lock:
                    results[key] = revision
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
        calls = writer.batches
    assert len(results) == threads * per_thread
    stored = read_all(client, b"bw/")
    assert stored == {f"bw/{t}/{i:04d}".encode(): (f"{t}-{i}".encode(), 1)
                      for t in range(threads) for i in range(per_thread)}
    assert calls < threads * per_thread / 10, f"{calls} calls: the writer did not batch"
    assert node.metric("kvstore_requests_total", method="WriteBatch", code="OK") - before == calls
