"""The store end to end: a real node process, a real broker, real LevelDB, gRPC over loopback."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvstore import limits
from kvstore.core.sharding import shard_of
from kvstore.v1 import cluster_pb2, kv_pb2
from tests.conftest import unique
from tests.integration.store_process import StoreProcess
from tests.waiting import NotYet, wait_until
from wal.broker import LocalKafka

pytestmark = pytest.mark.kafka
TIMEOUT = 20

T = TypeVar("T")


@pytest.fixture
def store(kafka: LocalKafka, tmp_path: Path) -> Iterator[StoreProcess]:
    node = StoreProcess(kafka.bootstrap_servers, tmp_path / "node", unique("kv").replace("-", ""))
    node.start()
    try:
        yield node
    finally:
        node.stop()


def put(node: StoreProcess, key: bytes, value: bytes, request_id: str = "") -> kv_pb2.PutResponse:
    return node.kv.Put(kv_pb2.PutRequest(key=key, value=value, request_id=request_id), timeout=TIMEOUT)


def get(node: StoreProcess, key: bytes, consistency: int = kv_pb2.CONSISTENCY_LINEARIZABLE) -> kv_pb2.GetResponse:
    read = kv_pb2.ReadOptions(consistency=consistency)
    return node.kv.Get(kv_pb2.GetRequest(key=key, read=read), timeout=TIMEOUT)


def test_put_get_delete_scan_round_trip(store: StoreProcess) -> None:
    first = put(store, b"a", b"1")
    second = put(store, b"a", b"2")
    assert (first.version, second.version) == (1, 2)
    assert second.result.revision > first.result.revision
    for consistency in (kv_pb2.CONSISTENCY_LINEARIZABLE, kv_pb2.CONSISTENCY_LEADER_LOCAL, kv_pb2.CONSISTENCY_STALE):
        reply = get(store, b"a", consistency)
        assert reply.found and reply.kv.value == b"2" and reply.kv.version == 2
        assert reply.kv.mod_revision == second.result.revision
        assert reply.header.applied_revision > second.result.revision
    deleted = store.kv.Delete(kv_pb2.DeleteRequest(key=b"a"), timeout=TIMEOUT)
    assert deleted.deleted
    assert not get(store, b"a").found
    assert not store.kv.Delete(kv_pb2.DeleteRequest(key=b"a"), timeout=TIMEOUT).deleted

    keys = [f"scan/{i:03d}".encode() for i in range(25)]
    for key in keys:
        put(store, key, key.upper())
    put(store, b"other", b"x")
    seen: list[bytes] = []
    token = b""
    while True:
        page = store.kv.Scan(kv_pb2.ScanRequest(prefix=b"scan/", limit=7, page_token=token), timeout=TIMEOUT)
        seen += [kv.key for kv in page.kvs]
        token = page.next_page_token
        if not token:
            break
    assert seen == keys  # ordered across all shards
    ranged = store.kv.Scan(kv_pb2.ScanRequest(start=b"scan/010", end=b"scan/013"), timeout=TIMEOUT)
    assert [kv.key for kv in ranged.kvs] == keys[10:13]


def test_txn_compare_and_set(store: StoreProcess) -> None:
    def cas(expected_version: int, value: bytes) -> kv_pb2.TxnResponse:
        return store.kv.Txn(kv_pb2.TxnRequest(
            compares=[kv_pb2.Compare(key=b"cas", target=kv_pb2.Compare.TARGET_VERSION,
                                     op=kv_pb2.Compare.OP_EQUAL, version=expected_version)],
            success=[kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=b"cas", value=value))],
            failure=[kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=b"cas"))]), timeout=TIMEOUT)

    created = cas(0, b"v1")
    assert created.succeeded and created.results[0].put.version == 1
    stale = cas(0, b"again")
    assert not stale.succeeded and stale.results[0].get.kv.value == b"v1"
    assert cas(1, b"v2").succeeded
    assert get(store, b"cas").kv.value == b"v2"


def test_concurrent_compare_and_set_exactly_one_wins_per_version(store: StoreProcess) -> None:
    """Many clients race to move one key from version n to n+1: exactly one wins each round."""
    rounds, clients = 5, 8
    winners: dict[int, list[int]] = {}
    lock = threading.Lock()

    def client(number: int) -> None:
        for version in range(rounds):
            reply = store.kv.Txn(kv_pb2.TxnRequest(
                compares=[kv_pb2.Compare(key=b"race", target=kv_pb2.Compare.TARGET_VERSION,
                                         op=kv_pb2.Compare.OP_EQUAL, version=version)],
                success=[kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=b"race", value=str(number).encode()))]),
                timeout=TIMEOUT)
            if reply.succeeded:
                with lock:
                    winners.setdefault(version, []).append(number)
            barrier.wait(TIMEOUT)

    barrier = threading.Barrier(clients)
    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT * rounds)
    assert {version: len(ws) for version, ws in winners.items()} == dict.fromkeys(range(rounds), 1)
    final = get(store, b"race")
    assert final.kv.version == rounds and final.kv.value == str(winners[rounds - 1][0]).encode()


def test_idempotent_retry_after_lost_reply(store: StoreProcess) -> None:
    """The client never saw the first reply; its retry with the same id is applied at most once."""
    first = put(store, b"idem", b"once", request_id="req-1")
    retry = put(store, b"idem", b"once", request_id="req-1")
    assert retry.result.replayed and not first.result.replayed
    assert (retry.version, retry.result.revision) == (first.version, first.result.revision)
    assert get(store, b"idem").kv.version == 1
    store.stop()
    store.start()  # also after a restart
    again = put(store, b"idem", b"once", request_id="req-1")
    assert again.result.replayed and again.result.revision == first.result.revision
    assert get(store, b"idem").kv.version == 1


def test_restart_recovers_from_checkpoint_plus_wal(store: StoreProcess) -> None:
    for i in range(20):
        put(store, f"r{i}".encode(), f"{i}".encode())
    assert store.stop(signal.SIGKILL) != 0  # no graceful anything
    store.start()
    for i in range(20):
        assert get(store, f"r{i}".encode()).kv.value == f"{i}".encode()
    put(store, b"r-after", b"ok")
    assert get(store, b"r-after").found


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_lost_or_corrupt_leveldb_is_rebuilt_from_the_wal(store: StoreProcess, damage: str) -> None:
    for i in range(10):
        put(store, f"d{i}".encode(), b"x" * 100)
    put(store, b"d0", b"latest")
    store.stop()
    for shard_dir in store.data_dir.iterdir():
        if damage == "delete":
            shutil.rmtree(shard_dir)
        else:
            for path in shard_dir.iterdir():
                if path.name == "CURRENT" or path.suffix in (".ldb", ".log"):
                    path.write_bytes(b"\x00garbage" * 64)
    store.start()
    assert get(store, b"d0").kv.value == b"latest" and get(store, b"d0").kv.version == 2
    for i in range(1, 10):
        assert get(store, f"d{i}".encode()).kv.value == b"x" * 100


def test_watch_streams_changes(store: StoreProcess) -> None:
    first = put(store, b"w/1", b"before")
    stream = store.kv.Watch(kv_pb2.WatchRequest(prefix=b"w/"), timeout=TIMEOUT)  # from now on
    # The first event says the watch is registered: the writes below cannot slip in before it.
    assert next(stream).type == kv_pb2.WatchResponse.TYPE_CREATED
    put(store, b"w/2", b"a")
    put(store, b"w/1", b"b")
    store.kv.Delete(kv_pb2.DeleteRequest(key=b"w/2"), timeout=TIMEOUT)
    put(store, b"elsewhere", b"ignored")
    events = [next(stream) for _ in range(3)]
    stream.cancel()
    assert [(e.type, e.kv.key) for e in events] == [
        (kv_pb2.WatchResponse.TYPE_PUT, b"w/2"), (kv_pb2.WatchResponse.TYPE_PUT, b"w/1"),
        (kv_pb2.WatchResponse.TYPE_DELETE, b"w/2")]
    assert events[1].kv.version == 2 and events[1].kv.mod_revision > first.result.revision

    # From a past revision: history comes from the WAL.
    history = store.kv.Watch(kv_pb2.WatchRequest(key=b"w/1", start_revision=first.result.revision),
                             timeout=TIMEOUT)
    assert next(history).type == kv_pb2.WatchResponse.TYPE_CREATED  # first, also before history
    got = [next(history).kv.value, next(history).kv.value]
    history.cancel()
    assert got == [b"before", b"b"]


def test_a_prefix_watch_starts_per_shard(store: StoreProcess) -> None:
    """A revision is an offset of one shard's WAL: a prefix watch names the shard of each start,
    and a shard-less nonzero start over several shards is refused (never misread)."""
    keys = {shard_of(k, 4): k for k in (f"ps/{i}".encode() for i in range(40))}
    a, b = keys[0], keys[1]
    put(store, a, b"a0")
    first_a = put(store, a, b"a1")  # not at revision 0, which (all history) names no shard
    put(store, b, b"b1")
    put(store, a, b"a2")
    with pytest.raises(grpc.RpcError) as refused:
        next(store.kv.Watch(kv_pb2.WatchRequest(prefix=b"ps/", start_revision=first_a.result.revision),
                            timeout=TIMEOUT))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "start_revisions" in (refused.value.details() or "")
    stream = store.kv.Watch(kv_pb2.WatchRequest(prefix=b"ps/", start_revisions=[
        kv_pb2.ShardRevision(shard=0, revision=first_a.result.revision)]), timeout=TIMEOUT)
    assert next(stream).type == kv_pb2.WatchResponse.TYPE_CREATED
    history = [next(stream), next(stream)]  # shard 0's history only: shard 1 is watched from now on
    put(store, b, b"b2")
    live = next(stream)
    stream.cancel()
    assert [(e.shard, e.kv.value) for e in history] == [(0, b"a1"), (0, b"a2")]
    assert (live.shard, live.kv.value) == (1, b"b2")


def test_a_quiet_watch_on_a_busy_shard_learns_how_far_the_shard_got(kafka: LocalKafka, tmp_path: Path) -> None:
    """Progress events (etcd's progress notify): a watch on a prefix nobody writes, in a shard
    other keys keep busy, is told how far the shard got (only when it asked for it), and the
    client's watch resumes from there, not from where it was created (a revision the WAL may have
    truncated since)."""
    from kvstore.client import Client

    node = StoreProcess(kafka.bootstrap_servers, tmp_path / "node", unique("kv").replace("-", ""),
                        extra_args=("--watch-progress-ms", "200"))
    node.start()
    try:
        quiet = next(k for k in (f"quiet/{i}".encode() for i in range(100)) if shard_of(k, 4) == 0)
        busy = next(k for k in (f"busy/{i}".encode() for i in range(100)) if shard_of(k, 4) == 0)
        asked = node.kv.Watch(kv_pb2.WatchRequest(prefix=b"quiet/", progress_notify=True), timeout=TIMEOUT)
        plain = node.kv.Watch(kv_pb2.WatchRequest(prefix=b"quiet/"), timeout=TIMEOUT)
        created = next(asked)
        assert next(plain).type == kv_pb2.WatchResponse.TYPE_CREATED
        start = {b.shard: b.revision for b in created.start_revisions}[0]
        last = start
        for i in range(10):
            last = put(node, busy, str(i).encode()).result.revision
            time.sleep(0.06)
        event = next(asked)  # nothing under quiet/ changed: only progress comes
        assert event.type == kv_pb2.WatchResponse.TYPE_PROGRESS, event
        (mark,) = event.start_revisions
        assert mark.shard == 0 and start < mark.revision <= last + 2, (start, mark, last)  # + its commit marker
        changed = put(node, quiet, b"q").result.revision
        later = next(e for e in asked if e.type != kv_pb2.WatchResponse.TYPE_PROGRESS)  # bounded: the deadline
        assert later.kv.mod_revision == changed
        first_plain = next(plain)
        assert first_plain.type == kv_pb2.WatchResponse.TYPE_PUT and first_plain.kv.mod_revision == changed, \
            "a watch that did not ask gets no progress events"
        asked.cancel()
        plain.cancel()
        with Client([node.address], timeout_s=TIMEOUT) as client, client.watch(prefix="quiet/") as watch:
            created_at = watch._resume.starts[0]  # type: ignore[index]  (the position a resume starts from)
            for i in range(10):
                put(node, busy, str(i).encode())
                time.sleep(0.06)
            changed = put(node, quiet, b"q2").result.revision
            assert next(watch).kv.mod_revision == changed  # progress events are taken in, never yielded
            assert created_at < watch._resume.starts[0] <= changed  # type: ignore[index]
    finally:
        node.stop()


def test_a_watch_below_the_log_start_is_out_of_range(store: StoreProcess) -> None:
    """History that truncation deleted: OUT_OF_RANGE with reason COMPACTED naming the shard's log
    start (etcd's ErrCompacted), before the watch is registered, never INTERNAL after
    TYPE_CREATED; the client raises `Compacted` with the log start, and a watch from it works."""
    from kvstore.client import Client, Compacted
    from wal import delete_below

    key = b"compacted/1"
    shard = shard_of(key, 4)
    revisions = [put(store, key, f"v{i}".encode()).result.revision for i in range(4)]
    topic = f"{store.cluster}.wal"
    [log_start] = delete_below(store.kafka, topic, {shard: revisions[2]}).values()
    assert log_start == revisions[2]

    with pytest.raises(grpc.RpcError) as refused:
        next(store.kv.Watch(kv_pb2.WatchRequest(key=key, start_revision=revisions[1]), timeout=TIMEOUT))
    assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE
    status = rpc_status.from_call(refused.value)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert any(d.Unpack(info) for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR))
    assert (info.reason, info.metadata["log_start"], info.metadata["shard"]) == ("COMPACTED", str(log_start),
                                                                                 str(shard))
    assert info.metadata["outcome"] == "none"
    with pytest.raises(grpc.RpcError) as all_history:  # 0 (all history) is gone too
        next(store.kv.Watch(kv_pb2.WatchRequest(key=key, start_revision=0), timeout=TIMEOUT))
    assert all_history.value.code() == grpc.StatusCode.OUT_OF_RANGE

    with Client([store.address], timeout_s=TIMEOUT) as client:
        with pytest.raises(Compacted) as compacted:
            client.watch(key, start_revision=revisions[0])
        assert (compacted.value.log_start, compacted.value.shard) == (log_start, shard)
        with client.watch(key, start_revision=log_start) as watch:  # from the log start: what is left
            assert [next(watch).kv.value for _ in range(2)] == [b"v2", b"v3"]


def test_shard_map(store: StoreProcess) -> None:
    put(store, b"m", b"1")
    reply = store.cluster_stub.ShardMap(cluster_pb2.ShardMapRequest(), timeout=TIMEOUT)
    assert reply.shard_count == 4 and len(reply.shards) == 4
    assert all(s.leader == store.address for s in reply.shards)
    shard = reply.shards[shard_of(b"m", 4)]
    assert shard.applied_offset >= 2 and shard.lag == 0 and shard.term >= 1


def _details(status: status_pb2.Status) -> tuple[error_details_pb2.ErrorInfo, list[Any]]:
    info = error_details_pb2.ErrorInfo()
    violations: list[Any] = []
    for item in status.details:
        if item.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            item.Unpack(info)
        elif item.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            item.Unpack(bad_request)
            violations.extend(bad_request.field_violations)
    return info, violations


def bad(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value


def test_limits_and_malformed_requests_get_clear_errors(store: StoreProcess) -> None:
    kv = store.kv
    cases = [
        (lambda: put(store, b"", b"v"), "key must not be empty"),
        (lambda: put(store, b"k" * (limits.MAX_KEY_BYTES + 1), b"v"), "MAX_KEY_BYTES"),
        (lambda: put(store, b"k", b"v" * (limits.MAX_VALUE_BYTES + 1)), "MAX_VALUE_BYTES"),
        (lambda: put(store, b"k", b"v", request_id="r" * 200), "MAX_REQUEST_ID_BYTES"),
        (lambda: kv.Txn(kv_pb2.TxnRequest(), timeout=TIMEOUT), "at least one"),
        (lambda: kv.Txn(kv_pb2.TxnRequest(success=[kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=b"k"))] * 200),
                        timeout=TIMEOUT), "MAX_TXN_OPS"),
        (lambda: kv.Scan(kv_pb2.ScanRequest(limit=limits.MAX_SCAN_LIMIT + 1), timeout=TIMEOUT), "MAX_SCAN_LIMIT"),
        (lambda: kv.Scan(kv_pb2.ScanRequest(start=b"b", end=b"a"), timeout=TIMEOUT), "greater than start"),
        # A revision belongs to one shard: a scan of 4 shards cannot take a shard-less minimum.
        (lambda: kv.Scan(kv_pb2.ScanRequest(read=kv_pb2.ReadOptions(consistency=kv_pb2.CONSISTENCY_STALE,
                                                                   min_revision=0)), timeout=TIMEOUT),
         "ReadOptions.min_revision names no shard, but a scan reads all 4 shards"),
        (lambda: kv.Scan(kv_pb2.ScanRequest(min_revisions=[kv_pb2.ShardRevision(shard=4, revision=0)]),
                         timeout=TIMEOUT), "shard 4 out of range"),
    ]
    keys = [f"span{i}".encode() for i in range(64)]
    first_shard = shard_of(keys[0], 4)
    other = next(k for k in keys if shard_of(k, 4) != first_shard)
    # A Txn over two shards is a cross-shard transaction (docs/design.md §10); its request id may
    # not take the prefix the store keeps for its transactions' own records.
    cases.append((lambda: kv.Txn(kv_pb2.TxnRequest(success=[
        kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=keys[0], value=b"1")),
        kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=other, value=b"2"))], request_id="kvstore.txn/d/x"),
        timeout=TIMEOUT), "reserved"))
    for call, needle in cases:
        error = bad(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (needle, error)
        assert needle in (error.details() or ""), (needle, error.details())
    # Every refusal carries the rich status (google.rpc.Status): ErrorInfo's reason and the limit,
    # BadRequest's field, the outcome "none" (definite).
    limit = rpc_status.from_call(bad(lambda: put(store, b"k" * (limits.MAX_KEY_BYTES + 1), b"v")))  # type: ignore[arg-type]
    assert limit is not None
    info, violations = _details(limit)
    assert info.reason == "LIMIT_EXCEEDED" and info.domain == "kvstore", info
    assert info.metadata["limit"] == "MAX_KEY_BYTES" and info.metadata["outcome"] == "none", info
    assert [v.field for v in violations] == ["key"], violations
    # Bytes that are not a PutRequest, and more bytes than MAX_REQUEST_BYTES: INVALID_ARGUMENT
    # (definite), never UNKNOWN "Unexpected DecodeError" (which a client must read as W7).
    assert store.channel is not None
    raw_put = store.channel.unary_unary("/kvstore.v1.KVService/Put")
    for garbage, reason in ((b"\xff\xff\xff\xff", "INVALID_ARGUMENT"), (b"\x0a\x05ab", "INVALID_ARGUMENT"),
                            (b"\x00" * (limits.MAX_REQUEST_BYTES + 1), "LIMIT_EXCEEDED")):
        error = bad(lambda raw=garbage: raw_put(raw, timeout=TIMEOUT))  # type: ignore[misc]
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (garbage[:8], error)
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
        assert status is not None and _details(status)[0].reason == reason, (garbage[:8], status)
    # A message above gRPC's own cap is refused by gRPC, not by a crash.
    huge = bad(lambda: put(store, b"k", b"v" * (limits.GRPC_MAX_MESSAGE_BYTES + 10)))
    assert huge.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server is still fine.
    assert put(store, b"still", b"ok").version == 1
    assert get(store, b"still").kv.value == b"ok"


def test_graceful_shutdown_loses_no_acknowledged_write(store: StoreProcess) -> None:
    """SIGTERM while clients write: every write that was acknowledged is there after restart."""
    acked: dict[bytes, bytes] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def writer(number: int) -> None:
        i = 0
        while not stop.is_set() and i < 10_000:
            key, value = f"g{number}/{i}".encode(), f"{i}".encode()
            i += 1
            try:
                put(store, key, value)
            except (grpc.RpcError, AttributeError):
                continue  # not acknowledged: may or may not be there
            with lock:
                acked[key] = value

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(acked) >= 40, 60, what="writes acknowledged before the shutdown")  # mid-stream
    assert store.proc is not None
    store.proc.send_signal(signal.SIGTERM)
    assert store.proc.wait(60) == 0, "graceful shutdown did not exit cleanly"
    stop.set()
    for thread in threads:
        thread.join(30)
    assert len(acked) > 10, "nothing was written before the shutdown"
    store.stop()
    store.start()
    missing = [key for key, value in acked.items() if get(store, key).kv.value != value]
    assert missing == []


def test_full_write_queue_answers_resource_exhausted(kafka: LocalKafka, tmp_path: Path) -> None:
    node = StoreProcess(kafka.bootstrap_servers, tmp_path / "tiny", unique("kvq").replace("-", ""), shards=1,
                        extra_args=("--max-pending-writes", "1"))
    node.start()
    try:
        futures = [node.kv.Put.future(kv_pb2.PutRequest(key=f"q{i}".encode(), value=b"v"), timeout=TIMEOUT)
                   for i in range(60)]
        codes = []
        for future in futures:
            try:
                future.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "MAX_PENDING_WRITES_PER_SHARD" in (error.details() or "")
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes, codes
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert put(node, b"after", b"ok").version == 1  # back to normal once the burst is over
    finally:
        node.stop()


def test_follower_replica_tails_the_wal_and_serves_stale_reads(store: StoreProcess, tmp_path: Path) -> None:
    for i in range(5):
        put(store, f"f{i}".encode(), b"before")
    follower = StoreProcess(store.kafka, tmp_path / "follower", store.cluster, extra_args=("--follower",))
    follower.start()
    try:
        written = put(store, b"f-new", b"after")
        stale = kv_pb2.ReadOptions(consistency=kv_pb2.CONSISTENCY_STALE, min_revision=written.result.revision)
        reply = follower.kv.Get(kv_pb2.GetRequest(key=b"f-new", read=stale), timeout=TIMEOUT)
        assert reply.kv.value == b"after" and reply.header.served_by  # read-your-writes on a replica
        assert get(follower, b"f0", kv_pb2.CONSISTENCY_STALE).kv.value == b"before"
        with pytest.raises(grpc.RpcError) as refused:
            put(follower, b"x", b"y")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # not the leader
        with pytest.raises(grpc.RpcError) as linear:
            get(follower, b"f0")
        assert linear.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # The replicas agree key by key.
        scan = kv_pb2.ScanRequest(prefix=b"f", read=kv_pb2.ReadOptions(consistency=kv_pb2.CONSISTENCY_STALE))
        leader_rows = [(kv.key, kv.value, kv.version) for kv in store.kv.Scan(scan, timeout=TIMEOUT).kvs]
        follower_rows = [(kv.key, kv.value, kv.version) for kv in follower.kv.Scan(scan, timeout=TIMEOUT).kvs]
        assert follower_rows == leader_rows and len(leader_rows) == 6
    finally:
        follower.stop()


def test_stale_scan_waits_per_shard_on_a_replica(store: StoreProcess, tmp_path: Path) -> None:
    """Read-your-writes on a scan served by a replica: the scan names, per shard, the revision it
    must have applied. Many writes land on one shard only, so its revisions run far beyond the
    other shards' ends, where one shard-less number for every shard could never be reached."""
    follower = StoreProcess(store.kafka, tmp_path / "follower", store.cluster, extra_args=("--follower",),
                            node_id="replica")
    follower.start()
    try:
        keys = [k for k in (f"ps/{i:03d}".encode() for i in range(400)) if shard_of(k, 4) == 1][:30]
        last = [put(store, key, b"v") for key in keys][-1].result
        assert last.shard == 1 and last.revision > 30  # beyond any other shard's end (they got nothing)
        stale = kv_pb2.ReadOptions(consistency=kv_pb2.CONSISTENCY_STALE)
        floor = kv_pb2.ShardRevision(shard=1, revision=last.revision)
        reply = follower.kv.Scan(kv_pb2.ScanRequest(prefix=b"ps/", read=stale, limit=100, min_revisions=[floor]),
                                 timeout=TIMEOUT)
        assert [kv.key for kv in reply.kvs] == sorted(keys)
        header = next(h for h in reply.headers if h.shard == 1)
        assert header.applied_revision > last.revision and header.served_by == follower.node_id
        # A revision shard 1 has not reached yet: the scan waits for it (bounded), then says so.
        ahead = kv_pb2.ShardRevision(shard=1, revision=last.revision + 1000)
        started = time.monotonic()
        waited = bad(lambda: follower.kv.Scan(kv_pb2.ScanRequest(prefix=b"ps/", read=stale, min_revisions=[ahead]),
                                              timeout=1.5))
        assert waited.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), waited
        assert time.monotonic() - started >= 1.0
    finally:
        follower.stop()


def test_reflection_and_metrics(kafka: LocalKafka, tmp_path: Path) -> None:
    from urllib.request import urlopen

    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from wal.broker import free_port

    metrics_port = free_port()
    node = StoreProcess(kafka.bootstrap_servers, tmp_path / "m", unique("kvm").replace("-", ""),
                        extra_args=("--metrics-port", str(metrics_port)))
    node.start()
    try:
        put(node, b"metric", b"1")
        assert node.channel is not None
        stub = reflection_pb2_grpc.ServerReflectionStub(node.channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=TIMEOUT)
        services = {s.name for reply in replies for s in reply.list_services_response.service}
        assert {"kvstore.v1.KVService", "kvstore.v1.ClusterService", "grpc.health.v1.Health"} <= services
        assert not any("internal" in name for name in services)  # the peer service is not the API
        text = urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=TIMEOUT).read().decode()
        for name in ("kvstore_commit_latency_seconds_count", "kvstore_batch_records_bucket", "kvstore_applied_offset",
                     "kvstore_lag_records", "kvstore_w3_rejections_total", "kvstore_fencings_total",
                     "kvstore_open_txn_age_seconds", 'kvstore_requests_total{code="OK",method="Put",reason=""}'):
            assert name in text, name
    finally:
        node.stop()


def test_txn_whose_wal_record_would_be_too_large_is_refused(store: StoreProcess) -> None:
    keys = [f"big{i}".encode() for i in range(64)]
    same = [k for k in keys if shard_of(k, 4) == shard_of(keys[0], 4)][:2]
    for key in same:  # two gets of 510 000: an answer below MAX_RESPONSE_BYTES, a record above its limit
        put(store, key, b"v" * 510_000)
    error = bad(lambda: store.kv.Txn(kv_pb2.TxnRequest(success=[
        kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=same[0])), kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=same[1])),
        kv_pb2.TxnOp(put=kv_pb2.PutRequest(key=same[0], value=b"small"))]), timeout=TIMEOUT))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "record limit" in (error.details() or "")
    assert get(store, same[0]).kv.value == b"v" * 510_000  # nothing applied, shard still leading
    assert put(store, same[1], b"ok").version == 2


def test_foreign_write_into_the_wal_is_detected_and_the_leader_settles(store: StoreProcess) -> None:
    """An unguarded producer appends to a shard's partition: the read barrier sees a high
    watermark beyond the leader's writes, refuses (UNAVAILABLE), the leader re-bootstraps by
    itself, the foreign record has no effect (W3), and reads and writes work again. While it
    settles, every refusal is UNAVAILABLE (retry), never a wrong answer."""
    from confluent_kafka import Producer

    key = b"foreign"
    shard = shard_of(key, 4)
    put(store, key, b"mine")
    producer = Producer({"bootstrap.servers": store.kafka})
    producer.produce(f"{store.cluster}.wal", b"garbage", partition=shard)
    assert producer.flush(10) == 0
    codes: list[grpc.StatusCode] = []

    def until_ok(call: Callable[[], T]) -> T:
        def attempt() -> T:
            try:
                return call()
            except grpc.RpcError as error:
                codes.append(error.code())
                raise NotYet(f"{error.code().name}: {error.details()}") from error

        return wait_until(attempt, 10, interval_s=0.2, what="the leader to settle after the foreign record")

    assert until_ok(lambda: get(store, key)).kv.value == b"mine"
    request_id = unique("again")  # the same id on every retry: applied at most once
    assert until_ok(lambda: put(store, key, b"again", request_id)).version == 2
    assert set(codes) <= {grpc.StatusCode.UNAVAILABLE}
    assert get(store, key).kv.value == b"again"
