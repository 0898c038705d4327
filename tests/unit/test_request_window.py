"""`kvstore.core.request_window`: the request-id bounds in memory (`MemoryShard`) are exactly
LevelDB's (`ShardStore`), whatever the batching: the simulation's replicas stand for real ones.
So are the cross-shard transactions' tables (prepared and decided), across reopens."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

import pytest

from kvstore.core.request_window import MemoryShard
from kvstore.core.state import RequestRecord, decision_id, prepare_id, resolve_id
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.storage.shard_store import ShardStore, decided_digest, prepared_digest

HORIZON_MS, LIMIT = 1_000, 6


def effect_of(rng: random.Random) -> pb.Effect:
    key = f"k{rng.randrange(8)}".encode()
    return (pb.Effect(put=pb.PutEffect(key=key, value=rng.randbytes(3))) if rng.random() < 0.8
            else pb.Effect(delete=pb.DeleteEffect(key=key)))


def entry(rng: random.Random, ms: int) -> bytes:
    rid = f"r{rng.randrange(30)}" if rng.random() < 0.8 else ""  # repeats: retries, some long after
    return pb.WalEntry(request_id=rid, effects=[effect_of(rng)], response=rid.encode(),
                       leader_unix_ms=ms).SerializeToString()


def txn_entry(rng: random.Random, ms: int) -> bytes:
    """A cross-shard transaction's record over a few txn ids, in any order and repeated: prepares,
    decisions (a commit with the coordinator's effects, an abort, a client's request id, some
    breaking a rule), resolves and forgets, as a coordinator and a participant see them."""
    txn_id = f"t{rng.randrange(6)}"
    commit = rng.random() < 0.6
    kind = rng.choice(["prepare", "decision", "decision", "resolve", "forget"])
    if kind == "prepare":
        prepare = pb.TxnPrepare(txn_id=txn_id, coordinator=0, participants=[0, 1], exclusive_keys=[b"k1"],
                                success=pb.TxnBranch(effects=[effect_of(rng)]))
        return pb.WalEntry(request_id=prepare_id(txn_id), prepare=prepare, leader_unix_ms=ms).SerializeToString()
    if kind == "decision":
        participants = rng.choice([[0, 1], [0, 1, 2], [0]])  # one participant: skipped by the rule
        client = rng.choice(["", f"c{rng.randrange(4)}"])
        decision = pb.TxnDecision(txn_id=txn_id, commit=commit, succeeded=commit and rng.random() < 0.8,
                                  participants=participants, request_id=client,
                                  answer=rng.randbytes(4) if commit else b"", kept=rng.random() < 0.9)
        effects = [effect_of(rng)] if rng.random() < (0.7 if commit else 0.1) else []  # an abort's: skipped
        response = pb.TxnDecided(commit=commit, succeeded=decision.succeeded).SerializeToString()
        return pb.WalEntry(request_id=decision_id(txn_id), decision=decision, effects=effects, response=response,
                           leader_unix_ms=ms).SerializeToString()
    if kind == "resolve":
        resolve = pb.TxnResolve(txn_id=txn_id, commit=commit, succeeded=commit)
        return pb.WalEntry(request_id=resolve_id(txn_id), resolve=resolve, effects=[effect_of(rng)] if commit else [],
                           leader_unix_ms=ms).SerializeToString()
    forgotten = [f"t{rng.randrange(6)}" for _ in range(rng.randrange(1, 4))]
    return pb.WalEntry(forget=pb.TxnForget(txn_ids=forgotten), leader_unix_ms=ms).SerializeToString()


@pytest.mark.parametrize("txns", [False, True], ids=["writes", "with-txns"])
@pytest.mark.parametrize("seed", range(20))
def test_memory_shard_equals_the_leveldb_store(tmp_path: Path, seed: int, txns: bool) -> None:
    """With transaction records the table is not bounded by count: a decision records two ids at
    one revision (its own and the client's), which the two order differently, so the count bound
    may forget a different one of them (`test_two_ids_at_one_revision_are_forgotten_alike`).
    The time bound forgets both together."""
    rng = random.Random(seed)
    limit = 1_000 if txns else LIMIT

    def open_store() -> ShardStore:
        return ShardStore(tmp_path / "s", topic="t", shard=0, max_request_ids=limit, request_id_horizon_ms=HORIZON_MS)

    def by_revision(requests: Iterable[RequestRecord]) -> list[RequestRecord]:
        return sorted(requests, key=lambda r: (r.revision, r.request_id))

    store = open_store()
    memory = MemoryShard(max_request_ids=limit, request_id_horizon_ms=HORIZON_MS)
    tables_seen = [0, 0]  # applies after which a decision, a prepare was kept
    try:
        offset, ms = 0, 1_000_000
        for _ in range(40):
            records = []
            for _ in range(rng.randrange(0, 6)):
                ms += rng.choice([0, 10, 100, 400, HORIZON_MS + 1])  # sometimes past the horizon at once
                make = txn_entry if txns and rng.random() < 0.4 else entry
                records.append((offset, make(rng, ms if rng.random() < 0.95 else 0)))
                offset += rng.choice([1, 1, 2])  # markers and aborted records leave gaps
            offset += 1
            mark = offset - 1 if rng.random() < 0.3 else None  # a leader's own commit: marker slot assumed
            a = store.apply(records, offset, unverified=mark)
            b = memory.apply(records, offset, unverified=mark)
            assert store.unverified == memory.unverified
            if rng.random() < 0.2:
                assert store.rewind_unverified() == memory.rewind_unverified()
                offset = store.applied_offset
            assert (a.duplicates, a.malformed, a.requests) == (b.duplicates, b.malformed, b.requests)
            assert (a.prepared, a.decided, a.txn_skipped) == (b.prepared, b.decided, b.txn_skipped)
            if rng.random() < 0.1:  # the tables are read back from LevelDB as they were written
                store.close()
                store = open_store()
                assert store.rebuilt_reason is None
            assert store.decided() == memory.decided()
            assert all(store.decided_txn(f"t{i}") == memory.decided_txn(f"t{i}") for i in range(6))
            assert all(store.decided_request(f"c{i}") == memory.decided_request(f"c{i}") for i in range(4))
            assert (sorted(store.locks.prepared(), key=lambda p: p.txn_id)
                    == sorted(memory.locks.prepared(), key=lambda p: p.txn_id))
            assert (store.decided_digest(), store.prepared_digest()) == (
                decided_digest(memory.decided()), prepared_digest(memory.locks.prepared()))
            tables_seen[0] += bool(memory.decisions)
            tables_seen[1] += memory.locks.has_locks()
            assert dict(store.keys()) == memory.keys
            assert by_revision(store.requests()) == by_revision(memory.requests.values())
            if not txns:
                assert [r.request_id for r in store.requests()] == list(memory.requests)
                assert list(store.requests()) == list(memory.requests.values())
            assert (store.request_count, store.evicted_through_ms, store.applied_offset) == (
                len(memory.requests), memory.evicted_through_ms, memory.applied_offset)
        assert not txns or min(tables_seen) > 0, tables_seen
    finally:
        store.close()


def test_two_ids_at_one_revision_are_forgotten_alike(tmp_path: Path) -> None:
    """A decision records two ids at one revision (its own and its client's): MemoryShard keeps
    them in (revision, id) order, as LevelDB's q<revision><id> keys do, so the count bound
    forgets the same one in both."""
    decision = pb.WalEntry(request_id=decision_id("t"), decision=pb.TxnDecision(
        txn_id="t", commit=True, succeeded=True, participants=[0, 1], request_id="a-client", answer=b"ok"),
        leader_unix_ms=5).SerializeToString()
    later = pb.WalEntry(request_id="r", effects=[pb.Effect(delete=pb.DeleteEffect(key=b"k"))],
                        leader_unix_ms=6).SerializeToString()
    store = ShardStore(tmp_path / "s", topic="t", shard=0, max_request_ids=2, request_id_horizon_ms=HORIZON_MS)
    memory = MemoryShard(max_request_ids=2, request_id_horizon_ms=HORIZON_MS)
    try:
        for shard in (store, memory):
            shard.apply([(0, decision)], 1)
            shard.apply([(1, later)], 2)  # one of the decision's two ids is forgotten by count
        assert sorted(r.request_id for r in store.requests()) == sorted(memory.requests)
    finally:
        store.close()


def test_copy_is_independent() -> None:
    memory = MemoryShard(max_request_ids=LIMIT, request_id_horizon_ms=HORIZON_MS)
    memory.apply([(0, entry(random.Random(1), 5))], 2)
    durable = memory.copy()
    memory.apply([(2, entry(random.Random(2), 6))], 4)
    assert durable.applied_offset == 2 and memory.applied_offset == 4
    assert durable.keys != memory.keys or durable.requests != memory.requests
