"""`kvstore.core.request_window`: the request-id bounds in memory (`MemoryShard`) are exactly
LevelDB's (`ShardStore`), whatever the batching: the simulation's replicas stand for real ones."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstore.core.request_window import MemoryShard
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.storage.shard_store import ShardStore

HORIZON_MS, LIMIT = 1_000, 6


def entry(rng: random.Random, ms: int) -> bytes:
    key = f"k{rng.randrange(8)}".encode()
    effect = (pb.Effect(put=pb.PutEffect(key=key, value=rng.randbytes(3))) if rng.random() < 0.8
              else pb.Effect(delete=pb.DeleteEffect(key=key)))
    rid = f"r{rng.randrange(30)}" if rng.random() < 0.8 else ""  # repeats: retries, some long after
    return pb.WalEntry(request_id=rid, effects=[effect], response=rid.encode(), leader_unix_ms=ms).SerializeToString()


@pytest.mark.parametrize("seed", range(20))
def test_memory_shard_equals_the_leveldb_store(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    store = ShardStore(tmp_path / "s", topic="t", shard=0, max_request_ids=LIMIT, request_id_horizon_ms=HORIZON_MS)
    memory = MemoryShard(max_request_ids=LIMIT, request_id_horizon_ms=HORIZON_MS)
    try:
        offset, ms = 0, 1_000_000
        for _ in range(40):
            records = []
            for _ in range(rng.randrange(0, 6)):
                ms += rng.choice([0, 10, 100, 400, HORIZON_MS + 1])  # sometimes past the horizon at once
                records.append((offset, entry(rng, ms if rng.random() < 0.95 else 0)))
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
            assert dict(store.keys()) == memory.keys
            assert [r.request_id for r in store.requests()] == list(memory.requests)
            assert list(store.requests()) == list(memory.requests.values())
            assert (store.request_count, store.evicted_through_ms, store.applied_offset) == (
                len(memory.requests), memory.evicted_through_ms, memory.applied_offset)
    finally:
        store.close()


def test_copy_is_independent() -> None:
    memory = MemoryShard(max_request_ids=LIMIT, request_id_horizon_ms=HORIZON_MS)
    memory.apply([(0, entry(random.Random(1), 5))], 2)
    durable = memory.copy()
    memory.apply([(2, entry(random.Random(2), 6))], 4)
    assert durable.applied_offset == 2 and memory.applied_offset == 4
    assert durable.keys != memory.keys or durable.requests != memory.requests
