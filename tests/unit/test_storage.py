"""`kvstore.storage.shard_store.ShardStore` on a real LevelDB under tmp_path: apply, reads, request table, rebuilds."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import plyvel
import pytest

from kvstore import limits
from kvstore.core.request_horizon import expired
from kvstore.core.state import (
    DecidedTxn,
    KeyState,
    PreparedTxn,
    RequestRecord,
    apply_entries,
    decision_id,
    prepare_id,
    resolve_id,
)
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.storage.shard_store import FORMAT_VERSION, HeldKeys, ShardStore, StorageError, decided_digest

TOPIC = "wal-test"
GARBAGE = b"\xde\xad\xbe\xef" * 64
Records = list[tuple[int, bytes]]


def put(key: bytes, value: bytes = b"v", rid: str = "", response: bytes = b"", ms: int = 0) -> bytes:
    effect = pb.Effect(put=pb.PutEffect(key=key, value=value))
    return pb.WalEntry(request_id=rid, effects=[effect], response=response, leader_unix_ms=ms).SerializeToString()


def delete(key: bytes, rid: str = "", ms: int = 0) -> bytes:
    effects = [pb.Effect(delete=pb.DeleteEffect(key=key))]
    return pb.WalEntry(request_id=rid, effects=effects, leader_unix_ms=ms).SerializeToString()


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
    assert store.evicted_through_ms == 0
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


def test_reopen_keeps_the_prepared_transactions(open_store: Callable[..., ShardStore]) -> None:
    """Cross-shard transactions' locks are state like keys (docs/design.md §10): written with
    the checkpoint, read back when the directory is opened again, gone once resolved."""
    prepare = pb.TxnPrepare(txn_id="t", exclusive_keys=[b"a"], shared_keys=[b"b"],
                            success=pb.TxnBranch(effects=[pb.Effect(put=pb.PutEffect(key=b"a", value=b"1"))]))
    store = open_store()
    store.apply([(0, pb.WalEntry(request_id=prepare_id("t"), prepare=prepare, leader_unix_ms=5).SerializeToString())],
                1)
    assert store.locks.lock_holders(b"a") == {"t": True}
    store.close()
    again = open_store()
    assert again.locks.prepared_txn("t") == PreparedTxn(prepare, 0, 5)
    assert again.locks.lock_holders(b"b") == {"t": False}
    resolve = pb.WalEntry(request_id=resolve_id("t"), resolve=pb.TxnResolve(txn_id="t", commit=True, succeeded=True),
                          effects=prepare.success.effects)
    again.apply([(1, resolve.SerializeToString())], 2)
    assert not again.locks.has_locks() and again.get(b"a") == KeyState(b"1", 1, 1, 1)
    again.close()
    assert not open_store().locks.has_locks()
    wiped = open_store(tmp := again.path.parent / "other")
    wiped.apply([(0, pb.WalEntry(request_id=prepare_id("t"), prepare=prepare).SerializeToString())], 1)
    wiped.wipe("test")
    assert not wiped.locks.has_locks() and tmp.exists()


def decision(txn_id: str, *, commit: bool = True, participants: tuple[int, ...] = (0, 1), ms: int = 0,
             effects: tuple[pb.Effect, ...] = (), request_id: str = "") -> bytes:
    """A decision record, as the coordinator's leader appends it (a commit carries its own part)."""
    body = pb.TxnDecision(txn_id=txn_id, commit=commit, succeeded=commit, participants=participants,
                          request_id=request_id, answer=b"answer" if commit else b"",
                          reason="" if commit else "conflict", kept=True)
    response = pb.TxnDecided(commit=commit, succeeded=commit, answer=body.answer).SerializeToString()
    return pb.WalEntry(request_id=decision_id(txn_id), decision=body, effects=effects, response=response,
                       leader_unix_ms=ms).SerializeToString()


def forget(*txn_ids: str, ms: int = 0) -> bytes:
    return pb.WalEntry(forget=pb.TxnForget(txn_ids=txn_ids), leader_unix_ms=ms).SerializeToString()


def test_reopen_keeps_the_decision_table(open_store: Callable[..., ShardStore]) -> None:
    """The coordinator's decision table is state like keys (docs/design.md §10): written with the
    checkpoint, read back when the directory is opened again, oldest first, gone once forgotten."""
    effect = pb.Effect(put=pb.PutEffect(key=b"mine", value=b"1"))
    store = open_store()
    applied = store.apply([(0, decision("t1", ms=7, effects=(effect,), request_id="client")),
                           (2, decision("t0", commit=False, participants=(0, 1, 2), ms=8)),
                           (3, decision("t0", ms=9))], 4)  # a second decision of t0: a duplicate id (T1)
    assert list(applied.decided) == ["t1", "t0"] and applied.duplicates == 1
    assert store.get(b"mine") == KeyState(b"1", 1, 0, 0)  # the coordinator's part, with the decision
    assert (client := store.request("client")) is not None and client.kind == pb.REQUEST_KIND_TXN
    table = store.decided()
    assert [(d.txn_id, d.revision, d.leader_unix_ms, d.decision.commit) for d in table] == [
        ("t1", 0, 7, True), ("t0", 2, 8, False)]
    assert [d.pending for d in table] == [(1,), (1, 2)]
    digest = store.decided_digest()
    assert digest == decided_digest(reversed(table)) != decided_digest(table[:1])
    store.close()

    again = open_store()
    assert again.decided() == table and again.decided_digest() == digest
    assert (t1 := again.decided_txn("t1")) == table[0] and t1 is not None and t1.decided().answer == b"answer"
    assert again.decided_txn("nope") is None
    again.apply([(4, forget("t1", "never-decided-here")), (5, decision("t2"))], 6)
    assert [d.txn_id for d in again.decided()] == ["t0", "t2"]
    again.apply([(6, forget("t2")), (7, decision("t2"))], 8)  # forgotten, and its id still answers for it
    assert [d.txn_id for d in again.decided()] == ["t0"]
    assert [key for key, _ in again.scan(b"", None, 10)] == [b"mine"]  # decision rows never show as keys
    again.close()
    assert [d.txn_id for d in open_store().decided()] == ["t0"]
    wiped = open_store(tmp := again.path.parent / "other")
    wiped.apply([(0, decision("t"))], 1)
    wiped.wipe("test")
    assert wiped.decided() == [] and wiped.decided_txn("t") is None and tmp.exists()


def test_an_apply_that_fails_midway_writes_nothing(store: ShardStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write batch is all or nothing even when the code filling it raises (plyvel writes a
    batch left by an exception unless it is a transaction): before, a read failing inside the
    batch (the decision table's row before this apply) left the keys written without their
    checkpoint, and the replay from the old checkpoint applied those records a second time."""
    store.apply([(0, put(b"before"))], 1)
    read = store.decided_txn
    calls: list[str] = []

    def fail_in_the_batch(txn_id: str) -> DecidedTxn | None:
        calls.append(txn_id)  # the first read plans the apply (store_delta), the second is in the batch
        if len(calls) > 1:
            raise StorageError(f"reading {txn_id} failed")
        return read(txn_id)

    monkeypatch.setattr(store, "decided_txn", fail_in_the_batch)
    with pytest.raises(StorageError):
        store.apply([(1, put(b"half", b"written")), (2, decision("t"))], 3)
    monkeypatch.undo()
    assert calls == ["t", "t"], calls
    assert (store.applied_offset, store.get(b"half"), store.decided()) == (1, None, [])
    store.apply([(1, put(b"half", b"written")), (2, decision("t"))], 3)  # the replay applies it once
    assert store.get(b"half") == KeyState(b"written", 1, 1, 1) and [d.txn_id for d in store.decided()] == ["t"]


def test_a_decision_is_found_by_its_client_request_id(open_store: Callable[..., ShardStore]) -> None:
    """The first decision carrying a client's request id is the request's outcome, found after the
    request-id table forgot the id (`kvstore.core.txn.request_outcome`), until it is forgotten."""
    store = open_store()
    store.apply([(0, decision("first", request_id="client")), (1, decision("other", request_id="clientx")),
                 (2, decision("retry", commit=False, request_id="client")), (3, decision("none"))], 4)
    assert [getattr(store.decided_request(r), "txn_id", None) for r in ("client", "clientx")] == ["first", "other"]
    assert store.decided_request("clien") is None and store.decided_request("") is None
    store.close()
    store = open_store()
    store.apply([(4, forget("first", "none"))], 5)
    assert store.decided_request("client") == store.decided_txn("retry") and store.decided_txn("retry") is not None
    store.apply([(5, forget("retry")), (6, decision("late", request_id="client")), (7, forget("late"))], 8)
    assert store.decided_request("client") is None and store.decided_request("clientx") is not None
    store.apply([(8, forget("other"))], 9)
    assert store.decided_request("clientx") is None and store.decided() == []


def test_a_snapshot_load_keeps_the_decision_table(store: ShardStore) -> None:
    row = DecidedTxn(pb.TxnDecision(txn_id="t", commit=True, participants=[0, 2], request_id="c"), 3, 11, b"r")
    store.apply([(0, decision("gone"))], 1)
    store.load_snapshot([], [], checkpoint=5, evicted_through_ms=0, decided=[row])
    assert store.decided() == [row] and store.decided_txn("gone") is None and store.decided_request("c") == row
    with pytest.raises(AssertionError):  # a decision at or above the cut is not the cut's state
        store.load_snapshot([], [], checkpoint=3, evicted_through_ms=0, decided=[row])


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


# ---- request table: time bound and evicted-through --------------------------------------------------

T0 = 1_700_000_000_000  # a plausible leader clock, Unix ms
HORIZON = 100


def ids_kept(store: ShardStore, candidates: list[str]) -> list[str]:
    return [rid for rid in candidates if store.request(rid) is not None]


def test_request_keeps_its_leader_time(open_store: Callable[..., ShardStore]) -> None:
    store = open_store()
    store.apply([(0, put(b"k", rid="r1", response=b"ok", ms=T0)), (1, put(b"j", rid="r2"))], 2)
    store.close()
    again = open_store()
    assert again.request("r1") == RequestRecord("r1", 0, b"ok", T0)
    assert again.request("r2") == RequestRecord("r2", 1, b"", 0)


def test_time_bound_forgets_ids_older_than_the_horizon(open_store: Callable[..., ShardStore]) -> None:
    store = open_store(request_id_horizon_ms=HORIZON)
    store.apply([(0, put(b"a", rid="r0", ms=T0)), (1, put(b"b", rid="r1", ms=T0 + 50))], 2)
    store.apply([(2, delete(b"x", ms=T0 + HORIZON))], 3)  # r0 is exactly HORIZON old: kept
    assert (ids_kept(store, ["r0", "r1"]), store.evicted_through_ms) == (["r0", "r1"], 0)
    store.apply([(3, delete(b"x", ms=T0 + HORIZON + 1))], 4)  # any entry moves the clock, id or not
    assert (ids_kept(store, ["r0", "r1"]), store.evicted_through_ms) == (["r1"], T0)
    store.apply([(4, put(b"c", rid="r2", ms=T0 + 10 * HORIZON))], 5)
    assert (ids_kept(store, ["r0", "r1", "r2"]), store.evicted_through_ms) == (["r2"], T0 + 50)


def test_time_bound_never_forgets_an_id_from_under_its_own_retry(store: ShardStore) -> None:
    store.apply([(0, put(b"k", b"1", rid="r", response=b"first", ms=T0))], 1)
    late = T0 + limits.REQUEST_ID_HORIZON_MS + 1  # the retry's entry is itself past the horizon
    applied = store.apply([(1, put(b"k", b"2", rid="r", ms=late))], 2)
    assert (applied.duplicates, store.get(b"k"), store.request("r")) == (1, KeyState(b"1", 1, 0, 0), None)
    assert store.evicted_through_ms == T0


def test_time_bound_stops_at_the_first_young_id(open_store: Callable[..., ShardStore]) -> None:
    """Oldest first by revision: an id whose leader clock lagged stays behind a younger one
    (kept a little longer is safe); it goes once the ids before it have gone."""
    store = open_store(request_id_horizon_ms=HORIZON)
    store.apply([(0, put(b"a", rid="ahead", ms=T0)), (1, put(b"b", rid="lagging", ms=T0 - 40))], 2)
    store.apply([(2, delete(b"x", ms=T0 + HORIZON - 1))], 3)
    assert (ids_kept(store, ["ahead", "lagging"]), store.evicted_through_ms) == (["ahead", "lagging"], 0)
    store.apply([(3, delete(b"x", ms=T0 + HORIZON + 1))], 4)
    assert (ids_kept(store, ["ahead", "lagging"]), store.evicted_through_ms) == ([], T0)


def test_id_of_unknown_time_is_forgotten_at_the_evicting_entrys_time(store: ShardStore) -> None:
    """Ids from entries written before leader_unix_ms existed: forgotten by the first timed entry,
    which bounds when they committed, so retries first attempted up to then are refused."""
    store.apply([(0, put(b"a", rid="old")), (1, put(b"b", rid="older-leader"))], 2)
    store.apply([(2, put(b"c", rid="new", ms=T0))], 3)
    assert (ids_kept(store, ["old", "older-leader", "new"]), store.evicted_through_ms) == (["new"], T0)


def test_count_bound_records_the_time_of_what_it_forgets(open_store: Callable[..., ShardStore]) -> None:
    store = open_store(max_request_ids=2)
    store.apply([(i, put(b"k", rid=f"r{i}", ms=T0 + 10 * i)) for i in range(4)], 4)
    assert (ids_kept(store, ["r0", "r1", "r2", "r3"]), store.evicted_through_ms) == (["r2", "r3"], T0 + 10)
    store.apply([(4, put(b"k", rid="r4"))], 5)  # no time: an unknown one counts as the evicting entry's
    assert (ids_kept(store, ["r2", "r3", "r4"]), store.evicted_through_ms) == (["r3", "r4"], T0 + 20)
    store.apply([(5, put(b"k", rid="r5", ms=T0 - 1000))], 6)  # a lagging clock never lowers it
    assert (ids_kept(store, ["r3", "r4", "r5"]), store.evicted_through_ms) == (["r4", "r5"], T0 + 30)


def test_evicted_through_survives_reopen(open_store: Callable[..., ShardStore]) -> None:
    store = open_store(max_request_ids=1)
    store.apply([(0, put(b"a", rid="r0", ms=T0)), (1, put(b"b", rid="r1", ms=T0 + 5))], 2)
    store.close()
    assert open_store(max_request_ids=1).evicted_through_ms == T0


def test_a_forgotten_id_is_refused_by_the_horizon_rule(open_store: Callable[..., ShardStore]) -> None:
    """The contract with the replica: once the table forgot an id (by count here, long before the
    horizon), a retry of it is refused; a request first attempted after that is let through."""
    store = open_store(max_request_ids=1)
    store.apply([(0, put(b"a", rid="r0", ms=T0)), (1, put(b"b", rid="r1", ms=T0 + 1_000))], 2)
    assert (store.request("r0"), store.evicted_through_ms) == (None, T0)
    now_ms, skew_ms = T0 + 60_000, limits.MAX_CLOCK_SKEW_MS

    def check(first_attempt_ms: int) -> str | None:
        return expired(first_attempt_ms, now_ms, store.evicted_through_ms, limits.REQUEST_ID_HORIZON_MS, skew_ms)

    assert check(T0 - 30) is not None  # r0's retry: the client's clock read T0 - 30 when it first sent it
    assert check(T0 + skew_ms) is not None  # could still be r0, committed by a leader whose clock lagged
    assert check(T0 + skew_ms + 1) is None
    assert check(now_ms - 100) is None


# ---- request table: however the records are batched, every replica keeps the same ids ---------------

RIDS = [f"r{i}" for i in range(8)]


def _random_requests(rng: random.Random) -> Records:
    """Entries with and without ids, repeated ids, unknown (0) and lagging leader times, garbage."""
    records: Records = []
    offset, clock_ms = rng.randrange(3), T0
    for _ in range(rng.randrange(1, 60)):
        offset += rng.randrange(1, 3)
        clock_ms += rng.randrange(0, HORIZON // 2)
        ms = rng.choice([clock_ms, clock_ms, clock_ms, clock_ms - rng.randrange(HORIZON), 0])
        rid = rng.choice(["", *RIDS])
        payload = GARBAGE if rng.random() < 0.05 else put(b"k%d" % rng.randrange(3), b"%d" % offset, rid=rid,
                                                           response=b"%d" % offset, ms=ms)
        records.append((offset, payload))
    return records


def _model_table(records: Records, limit: int, horizon_ms: int) -> tuple[list[RequestRecord], int]:
    """The rule as stated in the issue, on a list: (ids kept in revision order, evicted_through_ms)."""
    table: list[RequestRecord] = []
    through_ms = 0

    def evict(evicting_ms: int) -> None:
        nonlocal through_ms
        oldest = table.pop(0)
        through_ms = max(through_ms, oldest.leader_unix_ms or evicting_ms)

    for offset, payload in records:
        if payload == GARBAGE:
            continue
        entry = pb.WalEntry.FromString(payload)
        rid, ms = entry.request_id, entry.leader_unix_ms
        duplicate = bool(rid) and any(r.request_id == rid for r in table)
        while ms > 0 and table and table[0].leader_unix_ms < ms - horizon_ms:
            evict(ms)
        if rid and not duplicate:
            table.append(RequestRecord(rid, offset, bytes(entry.response), ms))
            while len(table) > limit:
                evict(ms)
    return table, through_ms


@pytest.mark.parametrize("seed", range(40))
def test_request_table_is_a_function_of_the_entries(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    records = _random_requests(rng)
    limit = rng.randrange(1, 6)
    expected_table, expected_through_ms = _model_table(records, limit, HORIZON)
    n = len(records)
    cuttings = [[], list(range(1, n)), *(sorted(rng.sample(range(1, n), rng.randrange(n))) for _ in range(2))]
    outcomes = []
    for i, cuts in enumerate(cuttings):
        store = ShardStore(tmp_path / f"s{i}", topic=TOPIC, shard=0, max_request_ids=limit,
                           request_id_horizon_ms=HORIZON)
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            store.apply(records[lo:hi], records[hi - 1][0] + 1)
        table = [r for r in (store.request(rid) for rid in RIDS) if r is not None]
        outcomes.append((sorted(table, key=lambda r: r.revision), store.evicted_through_ms, list(store.keys())))
        store.close()
    assert outcomes[0][:2] == (expected_table, expected_through_ms)
    assert all(outcome == outcomes[0] for outcome in outcomes[1:])


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
        pytest.param(lambda db: db.put(b"m:format", b"1"), id="format-1-ids-without-times"),
        pytest.param(lambda db: db.delete(b"m:evicted_through"), id="no-evicted-through"),
        pytest.param(lambda db: db.delete(b"m:requests"), id="no-request-count"),
        pytest.param(lambda db: db.delete(b"m:format"), id="data-without-format"),
        pytest.param(lambda db: db.delete(b"m:topic"), id="no-topic"),
    ],
)
def test_suspect_metadata_is_rebuilt(two_sessions: Path, open_store: Callable[..., ShardStore],
                                     change: Callable[[plyvel.DB], None]) -> None:
    _tamper(two_sessions, change)
    assert_rebuilt(open_store())


def test_directory_of_format_1_is_rebuilt(two_sessions: Path, open_store: Callable[..., ShardStore]) -> None:
    """Format 1 kept request ids without their time: it cannot say what to forget when."""
    assert FORMAT_VERSION == b"4"
    _tamper(two_sessions, lambda db: db.put(b"m:format", b"1"))
    store = open_store()
    assert store.rebuilt_reason == "format b'1', expected b'4'"
    assert (store.applied_offset, store.evicted_through_ms) == (0, 0)


def test_directory_of_format_2_is_migrated_in_place(tmp_path: Path, open_store: Callable[..., ShardStore]) -> None:
    """Format 2 kept no request kinds: its ids get kind 0 (unknown) in place, nothing else moves,
    so a replica of a truncated WAL needs no rebuild to upgrade (through format 3 to 4)."""
    first = open_store()
    first.apply([(3, put(b"k", rid="rid-a", response=b"a", ms=1_000)), (4, put(b"j", rid="rid-b", ms=2_000))], 6)
    before = (first.digest(), first.applied_offset, first.evicted_through_ms, list(first.requests()))
    first.close()

    def to_format_2(db: plyvel.DB) -> None:  # what format 2 wrote: no kind byte
        for raw_key, raw_value in list(db.iterator(prefix=b"r")):
            db.put(raw_key, raw_value[:16] + raw_value[17:])
        db.put(b"m:format", b"2")

    _tamper(tmp_path / "shard", to_format_2)
    store = open_store()
    assert store.rebuilt_reason is None
    assert (store.digest(), store.applied_offset, store.evicted_through_ms, list(store.requests())) == before
    assert [r.kind for r in store.requests()] == [0, 0]
    assert store.decided() == []
    store.close()
    db = plyvel.DB(str(tmp_path / "shard"))
    try:
        assert db.get(b"m:format") == b"4"
    finally:
        db.close()


def test_directory_of_format_3_is_migrated_in_place(tmp_path: Path, open_store: Callable[..., ShardStore]) -> None:
    """Format 3 kept no decision table: it gets an empty one in place, and keys, request ids
    (with their kinds), locks and checkpoint stay. A decision applied before the upgrade is not
    in the table (that release kept none); its ids in the request-id table still answer for it."""
    prepare = pb.TxnPrepare(txn_id="p", exclusive_keys=[b"x"])
    prepared = pb.WalEntry(request_id=prepare_id("p"), prepare=prepare, leader_unix_ms=1_500).SerializeToString()
    first = open_store()
    first.apply([(3, put(b"k", rid="rid-a", response=b"a", ms=1_000)), (4, prepared),
                 (5, decision("old", ms=2_000, request_id="client"))], 7)
    before = (first.digest(), first.applied_offset, first.evicted_through_ms, list(first.requests()),
              first.prepared_digest())
    first.close()

    def to_format_3(db: plyvel.DB) -> None:  # what format 3 wrote: no decision table
        for raw_key in list(db.iterator(prefix=b"c", include_value=False)):
            db.delete(raw_key)
        db.put(b"m:format", b"3")

    _tamper(tmp_path / "shard", to_format_3)
    store = open_store()
    assert store.rebuilt_reason is None
    assert (store.digest(), store.applied_offset, store.evicted_through_ms, list(store.requests()),
            store.prepared_digest()) == before
    assert store.locks.prepared_txn("p") == PreparedTxn(prepare, 4, 1_500)
    assert store.decided() == [] and store.decided_txn("old") is None
    assert store.request(decision_id("old")) is not None and store.request("client") is not None
    store.apply([(7, decision("new", ms=3_000)), (8, decision("old", ms=3_000))], 9)  # "old": a duplicate id
    assert [d.txn_id for d in store.decided()] == ["new"]
    store.close()
    db = plyvel.DB(str(tmp_path / "shard"))
    try:
        assert db.get(b"m:format") == b"4"
    finally:
        db.close()
    assert [d.txn_id for d in open_store().decided()] == ["new"]


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


def test_the_assumed_marker_slot_is_remembered_until_read(tmp_path: Path) -> None:
    """A leader's commit ending at 10 assumes its marker at 11: the store remembers that slot
    (across a reopen) until a later apply moves the checkpoint on; rewinding reads it again."""
    store = ShardStore(tmp_path / "s", topic="t", shard=0)
    store.apply([], 12, unverified=11)
    assert store.unverified == 11
    store.close()
    store = ShardStore(tmp_path / "s", topic="t", shard=0)
    assert store.unverified == 11 and store.applied_offset == 12
    assert store.rewind_unverified() and store.applied_offset == 11 and store.unverified is None
    assert not store.rewind_unverified()  # nothing left to read again
    store.apply([], 12)  # the replay passed the slot (a marker)
    store.apply([], 15, unverified=14)
    store.apply([], 15)  # a poll that moved nothing: the slot is still unread
    assert store.unverified == 14
    store.apply([], 18)  # the checkpoint moved on past it: read
    assert store.unverified is None and not store.rewind_unverified()
    with pytest.raises(AssertionError):
        store.apply([], 20, unverified=5)  # only the slot just below the new checkpoint
    store.close()


# ---- HeldKeys: lookups of keys a replica never held skip LevelDB, never wrongly ----------------------


def _random_key_workload(rng: random.Random) -> list[tuple[Records, int]]:
    """Chunks (records, checkpoint after them) of puts, deletes, re-puts and malformed records
    over a small and a large key space."""
    chunks, offset = [], 0
    for _ in range(rng.randrange(1, 12)):
        chunk: Records = []
        for _ in range(rng.randrange(0, 40)):
            key = b"k%d" % rng.randrange(12) if rng.random() < 0.6 else rng.randbytes(rng.randrange(0, 20))
            roll = rng.random()
            payload = GARBAGE if roll < 0.03 else delete(key) if roll < 0.3 else put(key, rng.randbytes(3))
            chunk.append((offset, payload))
            offset += rng.randrange(1, 3)
        offset += rng.randrange(0, 2)  # a marker
        chunks.append((chunk, offset))
    return chunks


@pytest.mark.parametrize("seed", range(40))
def test_held_keys_give_the_same_store_as_lookups_in_leveldb(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    chunks = _random_key_workload(rng)
    with_filter = ShardStore(tmp_path / "with", topic=TOPIC, shard=0)
    without = ShardStore(tmp_path / "without", topic=TOPIC, shard=0)
    assert with_filter._held is not None
    without._held = None
    probes: set[bytes] = {rng.randbytes(4) for _ in range(50)}
    for i, (chunk, checkpoint) in enumerate(chunks):
        filtered, looked_up = (store.apply(chunk, checkpoint) for store in (with_filter, without))
        assert (list(filtered.writes.items()), filtered.changes) == (list(looked_up.writes.items()),
                                                                     looked_up.changes)
        probes |= set(filtered.writes)
        if i == len(chunks) // 2:  # a restart in between: the reopened store has keys, so no filter
            with_filter.close()
            with_filter = ShardStore(tmp_path / "with", topic=TOPIC, shard=0)
            assert (with_filter._held is None) == (next(with_filter.keys(), None) is not None)
    assert with_filter.digest() == without.digest()
    assert all(with_filter.get(key) == without.get(key) for key in probes)
    with_filter.close()
    without.close()


def test_held_keys_are_kept_only_from_an_empty_store(open_store: Callable[..., ShardStore], tmp_path: Path) -> None:
    store = open_store()
    assert store._held is not None  # fresh
    store.apply([(0, put(b"a")), (1, put(b"b"))], 2)
    assert store._held is not None and store._held.may_hold(b"a") and store._held.may_hold(b"b")
    store.close()
    store = open_store()
    assert store._held is None and store.get(b"a") is not None  # opened with keys: none kept
    store.apply([(2, delete(b"a")), (3, delete(b"b"))], 4)
    store.close()
    store = open_store()
    assert store._held is not None  # every key deleted: empty again
    store.apply([(4, put(b"c"))], 5)
    store.wipe("test")
    assert store._held is not None and store.get(b"c") is None
    store.apply([(0, put(b"d"))], 1)
    store.load_snapshot([[(b"e", KeyState(b"v", 1, 1, 1).encode())]], [], checkpoint=2, evicted_through_ms=0)
    assert store._held is None  # keys that did not come through apply
    assert store.get(b"e") == KeyState(b"v", 1, 1, 1)


def test_held_keys_that_fill_up_are_dropped(store: ShardStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvstore.storage.shard_store.HeldKeys.MAX_KEYS", 10)
    store.apply([(i, put(b"k%d" % i)) for i in range(12)], 12)
    assert store._held is not None and store._held.full  # dropped at the next apply
    store.apply([(12, put(b"k0", b"again"))], 13)
    assert store._held is None
    assert store.get(b"k0") == KeyState(b"again", 2, 12, 0)
    assert model([(i, put(b"k%d" % i)) for i in range(1, 12)]).items() <= dict(store.keys()).items()


def test_held_keys_never_miss_an_added_key() -> None:
    held = HeldKeys()
    rng = random.Random(7)
    added = [rng.randbytes(rng.randrange(0, 40)) for _ in range(100_000)]
    for key in added:
        held.add(key)
    assert all(held.may_hold(key) for key in added)
    others = [b"other-%d" % i for i in range(20_000)]
    assert sum(held.may_hold(key) for key in others) < len(others) * 0.01  # ~0.3% at this fill


def test_a_request_keeps_its_kind(store: ShardStore) -> None:
    entry = pb.WalEntry(request_id="rid-d", effects=[pb.Effect(delete=pb.DeleteEffect(key=b"k"))], response=b"r",
                        leader_unix_ms=5, request_kind=pb.REQUEST_KIND_DELETE)
    store.apply([(0, entry.SerializeToString())], 1)
    record = store.request("rid-d")
    assert record == RequestRecord("rid-d", 0, b"r", 5, pb.REQUEST_KIND_DELETE)
    assert list(store.requests()) == [record]


@pytest.mark.skipif(os.geteuid() != 0, reason="a small disk (a tmpfs mount) needs root")
def test_a_store_whose_flush_met_a_full_disk_writes_again_once_there_is_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LevelDB keeps a failed flush's error for every later write of its handle, even once the
    disk has room (issue 22's fourth long run: a follower retried its replay for minutes). The
    store reopens its handle, keeping the data, and the retry applies."""
    from kvstore.storage import shard_store

    monkeypatch.setitem(shard_store._DB_OPTIONS, "write_buffer_size", 64 * 1024)  # flushes come soon
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "kvstore-test-disk", str(disk)], check=True)
    try:
        store = ShardStore(disk / "shard", topic=TOPIC, shard=0)
        store.apply([(0, put(b"first"))], 1)
        filler = disk / "filler.bin"
        filler.write_bytes(b"\0" * (shutil.disk_usage(disk).free - 200 * 1024))
        offset, failed = 1, None
        for _ in range(2_000):  # bounded: 200 KiB fills long before
            records = [(offset + i, put(b"k%08d" % (offset + i), random.randbytes(200))) for i in range(20)]
            try:
                store.apply(records, offset + 20)
            except plyvel.Error as exc:
                failed = exc
                break
            offset += 20
        assert failed is not None and "No space left" in str(failed), failed
        filler.unlink()
        store.apply([(offset, put(b"after"))], offset + 1)  # the first retry with room applies
        assert store.applied_offset == offset + 1
        assert store.get(b"first") is not None and store.get(b"after") is not None
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
