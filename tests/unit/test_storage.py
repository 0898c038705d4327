"""`kvstore.storage.ShardStore` on a real LevelDB under tmp_path: apply, reads, request table, rebuilds."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import plyvel
import pytest

from kvstore.state import KeyState, RequestRecord, apply_entries
from kvstore.storage import ShardStore, StorageError
from kvstore.v1 import wal_entry_pb2 as pb

TOPIC = "wal-test"
GARBAGE = b"\xde\xad\xbe\xef" * 64
Records = list[tuple[int, bytes]]


def put(key: bytes, value: bytes = b"v", rid: str = "", response: bytes = b"") -> bytes:
    effect = pb.Effect(put=pb.PutEffect(key=key, value=value))
    return pb.WalEntry(request_id=rid, effects=[effect], response=response).SerializeToString()


def delete(key: bytes) -> bytes:
    return pb.WalEntry(effects=[pb.Effect(delete=pb.DeleteEffect(key=key))]).SerializeToString()


def model(records: Records) -> dict[bytes, KeyState]:
    """The state the pure state machine gives for these records (no request ids involved)."""
    writes = apply_entries(lambda _: None, lambda _: False, records).writes
    return {key: state for key, state in sorted(writes.items()) if state is not None}


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., ShardStore]]:
    opened: list[ShardStore] = []

    def _open(path: Path = tmp_path / "shard", *, topic: str = TOPIC, shard: int = 0, **kw: int) -> ShardStore:
        opened.append(ShardStore(path, topic=topic, shard=shard, **kw))
        return opened[-1]

    yield _open
    for store in opened:
        store.close()


@pytest.fixture
def store(open_store: Callable[..., ShardStore]) -> ShardStore:
    return open_store()


# ---- apply and checkpoint ------------------------------------------------------------------------


def test_fresh_store(store: ShardStore) -> None:
    assert (store.applied_offset, store.rebuilt_reason, list(store.keys())) == (0, None, [])
    assert store.get(b"k") is None
    assert store.request("r") is None


def test_apply_writes_keys_and_moves_checkpoint(store: ShardStore) -> None:
    applied = store.apply([(0, put(b"a", b"1")), (1, put(b"b", b"2")), (3, put(b"a", b"3"))], 5)
    assert store.applied_offset == 5
    assert dict(store.keys()) == applied.writes == {b"a": KeyState(b"3", 2, 3, 0), b"b": KeyState(b"2", 1, 1, 1)}
    store.apply([(5, delete(b"a")), (6, delete(b"missing"))], 7, sync=True)
    assert (store.applied_offset, store.get(b"a"), dict(store.keys())) == (7, None, {b"b": KeyState(b"2", 1, 1, 1)})
    store.apply([], 20)  # nothing but control records / aborted batches in between
    assert store.applied_offset == 20


@pytest.mark.parametrize(
    ("records", "new_checkpoint"),
    [
        pytest.param([], 4, id="checkpoint-backwards"),
        pytest.param([(4, put(b"x"))], 9, id="record-below-checkpoint"),
        pytest.param([(9, put(b"x"))], 9, id="record-at-new-checkpoint"),
        pytest.param([(5, put(b"x")), (12, put(b"y"))], 9, id="record-above-new-checkpoint"),
    ],
)
def test_apply_refuses_records_outside_the_window(store: ShardStore, records: Records, new_checkpoint: int) -> None:
    store.apply([(0, put(b"k"))], 5)
    with pytest.raises(AssertionError):
        store.apply(records, new_checkpoint)
    assert (store.applied_offset, dict(store.keys())) == (5, model([(0, put(b"k"))]))


def test_reopen_keeps_state_checkpoint_and_requests(open_store: Callable[..., ShardStore]) -> None:
    store = open_store()
    store.apply([(0, put(b"a", rid="r1", response=b"ok")), (2, put(b"b")), (3, delete(b"b"))], 4)
    store.close()
    store.close()  # idempotent
    again = open_store()
    assert (again.rebuilt_reason, again.applied_offset) == (None, 4)
    assert dict(again.keys()) == {b"a": KeyState(b"v", 1, 0, 0)}
    assert again.request("r1") == RequestRecord("r1", 0, b"ok")


# ---- reads ---------------------------------------------------------------------------------------

KEYS = [b"", b"\x00", b"a", b"a\x00", b"ab", b"b", b"\x7f", b"\xff", b"\xff\x00", b"\xff\xff"]


@pytest.fixture
def filled(store: ShardStore) -> ShardStore:
    store.apply([(i, put(key, b"%d" % i)) for i, key in enumerate(reversed(KEYS))], len(KEYS))
    return store


@pytest.mark.parametrize(
    ("start", "end", "limit", "expected"),
    [
        pytest.param(b"", None, 100, KEYS, id="all"),
        pytest.param(b"", None, 3, KEYS[:3], id="limit"),
        pytest.param(b"", None, 1, [b""], id="limit-1-empty-key-first"),
        pytest.param(b"a", b"b", 100, [b"a", b"a\x00", b"ab"], id="range-end-exclusive"),
        pytest.param(b"a\x00", b"ab", 100, [b"a\x00"], id="range-start-inclusive"),
        pytest.param(b"a", b"a", 100, [], id="empty-range"),
        pytest.param(b"b", b"a", 100, [], id="inverted-range"),
        pytest.param(b"", b"", 100, [], id="end-empty-key"),
        pytest.param(b"\xff", None, 100, [b"\xff", b"\xff\x00", b"\xff\xff"], id="ff-prefix-to-end"),
        pytest.param(b"\xff", b"\xff\xff", 2, [b"\xff", b"\xff\x00"], id="ff-range"),
        pytest.param(b"\xff\xff\x00", None, 100, [], id="past-last-key"),
        pytest.param(b"b", b"\xff", 100, [b"b", b"\x7f"], id="high-bytes-sort-last"),
    ],
)
def test_scan(filled: ShardStore, start: bytes, end: bytes | None, limit: int, expected: list[bytes]) -> None:
    got = filled.scan(start, end, limit)
    assert [key for key, _ in got] == expected
    assert all(filled.get(key) == state for key, state in got)


def test_keys_and_get(filled: ShardStore) -> None:
    assert list(dict(filled.keys())) == sorted(KEYS) == KEYS
    assert filled.get(b"\xff\xff") == KeyState(b"0", 1, 0, 0)
    assert filled.get(b"") == KeyState(b"%d" % (len(KEYS) - 1), 1, len(KEYS) - 1, len(KEYS) - 1)
    assert filled.get(b"a\x01") is None


def test_meta_and_request_rows_never_show_as_keys(store: ShardStore) -> None:
    store.apply([(0, put(b"k", rid="m:checkpoint", response=b"x"))], 1)
    assert list(dict(store.keys())) == [b"k"]
    assert [key for key, _ in store.scan(b"", None, 10)] == [b"k"]


# ---- request table -------------------------------------------------------------------------------


def test_request_table(store: ShardStore) -> None:
    store.apply([(3, put(b"k", b"1", rid="r1", response=b"\x00answer")), (4, put(b"j", rid="r2"))], 5)
    assert store.request("r1") == RequestRecord("r1", 3, b"\x00answer")
    assert store.request("r2") == RequestRecord("r2", 4, b"")
    assert store.request("r3") is None
    # the client's retry committed a second time: it must change nothing but the checkpoint
    applied = store.apply([(7, put(b"k", b"2", rid="r1", response=b"other"))], 8)
    assert (applied.duplicates, applied.writes, applied.requests) == (1, {}, [])
    assert (store.applied_offset, store.get(b"k"), store.request("r1")) == (
        8, KeyState(b"1", 1, 3, 3), RequestRecord("r1", 3, b"\x00answer"))


REQUESTS = [(i, put(b"k%d" % i, rid=f"r{i}", response=b"%d" % i)) for i in range(5)]


@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param([1, 1, 1, 1, 1], id="one-at-a-time"),
        pytest.param([2, 3], id="2+3"),
        pytest.param([3, 2], id="3+2"),
        pytest.param([5], id="one-batch"),
        pytest.param([1, 4], id="1+4"),
    ],
)
def test_request_table_is_bounded(open_store: Callable[..., ShardStore], chunks: list[int]) -> None:
    store, done = open_store(max_request_ids=3), 0
    for size in chunks:
        store.apply(REQUESTS[done:done + size], done + size)
        done += size
    assert [store.request(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.request("r4") == RequestRecord("r4", 4, b"4")


def test_retry_after_bound_gives_same_state_however_batched(open_store: Callable[..., ShardStore],
                                                            tmp_path: Path) -> None:
    batched, single = open_store(tmp_path / "a", max_request_ids=3), open_store(tmp_path / "b", max_request_ids=3)
    batched.apply(REQUESTS, 5)
    for offset, payload in REQUESTS:
        single.apply([(offset, payload)], offset + 1)
    retry = [(5, put(b"k0", b"retried", rid="r0"))]
    assert batched.apply(retry, 6).duplicates == single.apply(retry, 6).duplicates
    assert list(batched.keys()) == list(single.keys())


# ---- rebuilds ------------------------------------------------------------------------------------

SESSION_1 = [(i, put(b"k%02d" % i, b"v" * 100)) for i in range(50)]
SESSION_2 = [(50, put(b"x", b"y")), (51, delete(b"k00"))]


@pytest.fixture
def two_sessions(open_store: Callable[..., ShardStore], tmp_path: Path) -> Path:
    """A closed store whose first session LevelDB moved into a table file (.ldb), the second in a .log."""
    first = open_store()
    first.apply(SESSION_1, 50)
    first.close()
    second = open_store()
    second.apply(SESSION_2, 52)
    second.close()
    path = tmp_path / "shard"
    assert list(path.glob("*.ldb")) and list(path.glob("*.log"))
    return path


def assert_rebuilt(store: ShardStore) -> None:
    assert store.rebuilt_reason
    assert (store.applied_offset, list(store.keys()), store.request("r1")) == (0, [], None)
    store.apply(SESSION_1[:2], 2)  # and usable: the replica replays the WAL into it
    assert dict(store.keys()) == model(SESSION_1[:2])


@pytest.mark.parametrize(
    ("topic", "shard"), [pytest.param("other-topic", 0, id="other-topic"), pytest.param(TOPIC, 1, id="other-shard")]
)
def test_other_topic_or_shard_is_rebuilt(two_sessions: Path, open_store: Callable[..., ShardStore], topic: str,
                                         shard: int) -> None:
    other = open_store(topic=topic, shard=shard)
    assert_rebuilt(other)
    other.close()
    assert open_store().rebuilt_reason == "written for another topic or shard"  # and back again: wiped again


def _tamper(path: Path, change: Callable[[plyvel.DB], None]) -> None:
    db = plyvel.DB(str(path))
    change(db)
    db.close()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda db: db.delete(b"m:checkpoint"), id="no-checkpoint"),
        pytest.param(lambda db: db.put(b"m:format", b"0"), id="other-format"),
        pytest.param(lambda db: db.delete(b"m:format"), id="data-without-format"),
        pytest.param(lambda db: db.delete(b"m:topic"), id="no-topic"),
    ],
)
def test_suspect_metadata_is_rebuilt(two_sessions: Path, open_store: Callable[..., ShardStore],
                                     change: Callable[[plyvel.DB], None]) -> None:
    _tamper(two_sessions, change)
    assert_rebuilt(open_store())


def _garbage(*patterns: str) -> Callable[[Path], None]:
    def corrupt(path: Path) -> None:
        for pattern in patterns:
            for file in path.glob(pattern):
                file.write_bytes(GARBAGE)
    return corrupt




@pytest.mark.parametrize(
    ("corrupt", "rebuilt"),
    [
        pytest.param(lambda path: (path / "CURRENT").unlink(), True, id="CURRENT-deleted"),
        pytest.param(lambda path: (path / "CURRENT").write_bytes(b""), True, id="CURRENT-truncated"),
        pytest.param(_garbage("CURRENT"), True, id="CURRENT-garbage"),
        pytest.param(_garbage("MANIFEST-*"), True, id="MANIFEST-garbage"),
        pytest.param(lambda path: [file.unlink() for file in path.glob("*.ldb")], True, id="tables-deleted"),
        pytest.param(_garbage("*"), True, id="every-file-garbage"),
        # a torn .log is what a crash leaves: LevelDB drops the tail, the older batch is intact
        pytest.param(_garbage("*.log"), False, id="log-garbage"),
        pytest.param(lambda path: [file.write_bytes(b"") for file in path.glob("*.log")], False, id="log-truncated"),
        pytest.param(_garbage("*.ldb"), True, id="tables-garbage"),
        pytest.param(_garbage("*.ldb", "*.log"), True, id="tables-and-log-garbage"),
    ],
)
def test_corrupted_directory_opens_and_is_never_trusted_wrongly(
    two_sessions: Path, open_store: Callable[..., ShardStore], corrupt: Callable[[Path], None], rebuilt: bool
) -> None:
    corrupt(two_sessions)
    store = open_store()
    if rebuilt:
        assert_rebuilt(store)
    else:  # kept: then state and checkpoint agree (W5) and the replica replays from the checkpoint
        checkpoint = store.applied_offset
        assert store.rebuilt_reason is None and checkpoint in (0, 50, 52)
        assert dict(store.keys()) == model([r for r in SESSION_1 + SESSION_2 if r[0] < checkpoint])


def test_deleted_directory_is_a_fresh_store(two_sessions: Path, open_store: Callable[..., ShardStore]) -> None:
    shutil.rmtree(two_sessions)
    store = open_store()
    assert (store.rebuilt_reason, store.applied_offset, list(store.keys())) == (None, 0, [])


def test_opening_a_store_that_is_already_open_does_not_wipe_it(open_store: Callable[..., ShardStore]) -> None:
    live = open_store()
    live.apply([(0, put(b"k"))], 1, sync=True)
    with pytest.raises(StorageError, match="in use by another process"):
        open_store()
    live.close()
    again = open_store()
    assert (again.rebuilt_reason, again.applied_offset, dict(again.keys())) == (None, 1, model([(0, put(b"k"))]))
