"""Snapshots without Spark: the per-shard fold, the format, and loading into a replica.

The fold (`kvstore.pipeline.fold`) is what the Spark job runs per shard; these tests hand it
Arrow tables directly and hold it to the replicas' own apply: folding a log in one go, or a
prefix and then the rest on top of the prefix's snapshot, gives the state (digest, keys, request
ids, evicted-through time, prepared and decided cross-shard transactions) a replica reaches
applying the same records.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvstore.core.state import KeyState, RequestRecord, decision_id, prepare_id, resolve_id
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.pipeline.fold import FOLD_INPUT, FOLD_OUTPUT, FoldError, fold
from kvstore.storage import snapshot
from kvstore.storage.shard_store import ShardStore

TOPIC = "wal-test"
MAX_IDS = 7
HORIZON_MS = 1_000


def entry(rng: random.Random, offset: int) -> bytes:
    effects = []
    for _ in range(rng.randint(1, 3)):
        key = f"k{rng.randint(0, 15)}".encode()
        if rng.random() < 0.25:
            effects.append(pb.Effect(delete=pb.DeleteEffect(key=key)))
        else:
            effects.append(pb.Effect(put=pb.PutEffect(key=key, value=f"v{offset}".encode())))
    rid = f"r{rng.randint(0, 30)}" if rng.random() < 0.6 else ""
    return pb.WalEntry(request_id=rid, effects=effects, response=f"resp{offset}".encode(),
                       leader_unix_ms=10_000 + offset * 97).SerializeToString()


def wal_log(seed: int, n: int = 120) -> list[tuple[int, bytes]]:
    """Records at increasing offsets with gaps (markers, rejected records) and one non-entry."""
    rng = random.Random(seed)
    out, offset = [], 0
    for i in range(n):
        offset += rng.choice((1, 1, 1, 2))
        out.append((offset, b"\xff not an entry" if i == n // 2 else entry(rng, offset)))
    return out


def rows(shard: int, cut: int, wal: list[tuple[int, bytes]], base: pa.Table | None = None, base_offset: int = 0,
         evicted_ms: int = 0, digest_at: list[int] | None = None) -> pa.Table:
    cols: dict[str, list[Any]] = {name: [] for name in FOLD_INPUT.names}

    def add(**values: Any) -> None:
        for name, column in cols.items():
            column.append(values.get(name))

    add(shard=shard, kind="control", offset=cut, base_offset=base_offset, evicted_through_ms=evicted_ms,
        digest_at=digest_at or [])
    for offset, payload in wal:
        add(shard=shard, kind="wal", offset=offset, payload=payload)
    if base is not None:
        for r in base.to_pylist():
            if r["kind"] in ("key", "request", "decided"):
                add(**{k: v for k, v in r.items() if k in cols})
            elif r["kind"] == "prepared":  # out: the prepare in `response`; in: in `payload`
                add(**{k: v for k, v in r.items() if k in cols and k not in ("response", "payload")},
                    payload=r["response"])
    return pa.table(cols, schema=FOLD_INPUT)


def replica(tmp_path: Path, records: list[tuple[int, bytes]], checkpoint: int) -> ShardStore:
    store = ShardStore(tmp_path / "replica", topic=TOPIC, shard=0, max_request_ids=MAX_IDS,
                       request_id_horizon_ms=HORIZON_MS)
    store.apply(records, checkpoint)
    return store


def meta(out: pa.Table, offset: int | None = None) -> dict[str, Any]:
    metas = [r for r in out.to_pylist() if r["kind"] == "meta" and (r["is_cut"] if offset is None
                                                                      else r["offset"] == offset)]
    assert len(metas) == 1
    return metas[0]


def run(table: pa.Table) -> pa.Table:
    return fold(table, topic=TOPIC, max_request_ids=MAX_IDS, request_id_horizon_ms=HORIZON_MS)


@pytest.mark.parametrize("seed", range(6))
def test_fold_in_two_steps_equals_one_step_and_the_replica(tmp_path: Path, seed: int) -> None:
    wal = wal_log(seed)
    cut = wal[-1][0] + 2  # a marker after the last record
    split = wal[len(wal) // 3][0]  # a snapshot cut inside the log (the record at `split` comes after)

    whole = run(rows(0, cut, wal))
    prefix = run(rows(0, split, [r for r in wal if r[0] < split]))
    m = meta(prefix)
    on_top = run(rows(0, cut, [r for r in wal if r[0] >= split], base=prefix, base_offset=split,
                      evicted_ms=m["evicted_through_ms"]))
    store = replica(tmp_path, wal, cut)
    digest, keys = store.digest()
    expected = {"offset": cut, "digest": digest, "keys": keys, "requests": store.request_count,
                "evicted_through_ms": store.evicted_through_ms}
    for out in (whole, on_top):
        assert {k: meta(out)[k] for k in expected} == expected
        assert out.schema == FOLD_OUTPUT
        state = {r["key"]: (r["value"], r["version"], r["mod_revision"], r["create_revision"])
                 for r in out.to_pylist() if r["kind"] == "key"}
        assert state == {k: tuple(s) for k, s in store.keys()}  # noqa: SIM118
        ids = [(r["request_id"], r["revision"], r["response"], r["leader_unix_ms"])
               for r in out.to_pylist() if r["kind"] == "request"]
        assert sorted(ids, key=lambda x: x[1]) == [(q.request_id, q.revision, q.response, q.leader_unix_ms)
                                                   for q in store.requests()]
    assert meta(whole)["malformed_entries"] == 1
    store.close()


def test_digest_points_match_a_replica_at_that_checkpoint(tmp_path: Path) -> None:
    wal = wal_log(42)
    cut = wal[-1][0] + 1
    point = wal[40][0]  # a replica whose checkpoint is here has applied records below it
    out = run(rows(0, cut, wal, digest_at=[point, cut + 100, -1]))  # out-of-range points are ignored
    store = replica(tmp_path, [r for r in wal if r[0] < point], point)
    assert meta(out, point)["digest"] == store.digest()[0] and not meta(out, point)["is_cut"]
    assert len([r for r in out.to_pylist() if r["kind"] == "meta"]) == 2
    store.close()


def test_fold_refuses_inconsistent_input() -> None:
    wal = wal_log(1, 10)
    with pytest.raises(FoldError, match="outside"):
        run(rows(0, wal[3][0], wal))  # records at and beyond the cut
    table = pa.concat_tables([rows(0, 100, []), rows(0, 100, [])])
    with pytest.raises(FoldError, match="2 control rows"):
        run(table)


# ---- the format and loading ----------------------------------------------------------------------------


# The fold's output columns of each snapshot table's columns (as snapshot_job selects them).
_RENAMED = {"prepared": {"txn_id": "request_id", "prepare": "response"},
            "decided": {"txn_id": "request_id", "decision": "payload"}}


def write_snapshot(root: Path, name: str, out: pa.Table, cut: int, shards: int = 1, topic: str = TOPIC,
                   manifest_digest: str | None = None, format_1: bool = False,
                   txn_tables: bool = False) -> snapshot.Manifest:
    """Lay out the fold's output as the Spark job does (Hive-style shard directories); with
    `txn_tables`, the prepared and decided tables and their digests too."""
    data = out.to_pylist()
    requests_schema = pa.schema([f for f in snapshot.REQUESTS_SCHEMA if f.name != "request_kind"]) if format_1 \
        else snapshot.REQUESTS_SCHEMA
    tables = [("keys", "key", snapshot.KEYS_SCHEMA), ("requests", "request", requests_schema)]
    if txn_tables:
        tables += [("prepared", "prepared", snapshot.PREPARED_SCHEMA), ("decided", "decided", snapshot.DECIDED_SCHEMA)]
    for table, kind, schema in tables:
        part = [r for r in data if r["kind"] == kind]
        renamed = _RENAMED.get(table, {})
        if part:
            directory = root / name / table / "shard=0"
            directory.mkdir(parents=True)
            pq.write_table(pa.Table.from_pylist([{c: r[renamed.get(c, c)] for c in schema.names} for r in part],
                                                schema=schema),
                           directory / "part-0.parquet")
    m = meta(out)
    txn_meta = {k: m[k] for k in ("prepared", "prepared_digest", "decided", "decided_digest")} if txn_tables else {}
    manifest = snapshot.Manifest(
        name=name, topic=topic, shard_count=shards, created_unix_ms=1, base=None, max_request_ids=MAX_IDS,
        request_id_horizon_ms=HORIZON_MS,
        shards=tuple(snapshot.ShardSnapshot(shard=s, offset=cut, keys=m["keys"] if s == 0 else 0,
                                            digest=(manifest_digest or m["digest"]) if s == 0 else "",
                                            requests=m["requests"] if s == 0 else 0,
                                            evicted_through_ms=m["evicted_through_ms"],
                                            requests_digest="" if format_1 or s else m["requests_digest"],
                                            **(txn_meta if s == 0 else {}))
                     for s in range(shards)),
        format=1 if format_1 else snapshot.FORMAT)
    snapshot.write_manifest(str(root), manifest)
    return manifest


def fresh(tmp_path: Path, name: str = "fresh") -> ShardStore:
    return ShardStore(tmp_path / name, topic=TOPIC, shard=0, max_request_ids=MAX_IDS,
                      request_id_horizon_ms=HORIZON_MS)


def test_encoding_whole_columns_equals_key_state_encode() -> None:
    states = [KeyState(b"", 1, 0, 0), KeyState(b"v" * 300, 7, 2**40, 3), KeyState(b"\x00\xff", 2**62, 5, 1)]
    columns = [pa.array([getattr(s, f) for s in states], t) for f, t in
               (("value", pa.binary()), ("version", pa.int64()), ("mod_revision", pa.int64()),
                ("create_revision", pa.int64()))]
    assert snapshot.encode_states(*columns) == [s.encode() for s in states]
    assert snapshot.encode_states(*(c.slice(0, 0) for c in columns)) == []


def test_load_into_a_replica_gives_the_snapshots_state(tmp_path: Path) -> None:
    wal = wal_log(7)
    cut = wal[-1][0] + 1
    out = run(rows(0, cut, wal))
    manifest = write_snapshot(tmp_path / "snaps", snapshot.new_name(5), out, cut)
    store = fresh(tmp_path)
    progress: list[tuple[int, int]] = []
    snapshot.load_into(store, str(tmp_path / "snaps"), manifest, batch_rows=3,
                       on_progress=lambda k, r: progress.append((k, r)))
    reference = replica(tmp_path, wal, cut)
    assert store.digest() == reference.digest() and store.applied_offset == cut
    assert list(store.requests()) == list(reference.requests())
    assert store.evicted_through_ms == reference.evicted_through_ms
    assert progress and progress[-1] == (meta(out)["keys"], meta(out)["requests"])
    # A retry of an id kept in the snapshot is recognised by the loaded replica.
    kept = next(reference.requests())
    assert store.request(kept.request_id) == kept
    store.close()
    reopened = fresh(tmp_path)
    assert reopened.rebuilt_reason is None and reopened.digest() == reference.digest()
    reopened.close()
    reference.close()


def test_a_snapshot_that_does_not_reproduce_its_digest_is_refused_and_wiped(tmp_path: Path) -> None:
    wal = wal_log(8)
    cut = wal[-1][0] + 1
    manifest = write_snapshot(tmp_path / "snaps", snapshot.new_name(5), run(rows(0, cut, wal)), cut,
                              manifest_digest="0" * 64)
    store = fresh(tmp_path)
    with pytest.raises(snapshot.SnapshotFormatError, match="its manifest says"):
        snapshot.load_into(store, str(tmp_path / "snaps"), manifest)
    assert store.applied_offset == 0 and store.digest()[1] == 0
    store.close()


def test_other_request_id_bounds_are_refused(tmp_path: Path) -> None:
    cut = 3
    manifest = write_snapshot(tmp_path / "snaps", snapshot.new_name(5), run(rows(0, cut, [])), cut)
    store = ShardStore(tmp_path / "other", topic=TOPIC, shard=0)  # the default bounds
    with pytest.raises(snapshot.SnapshotFormatError, match="request ids"):
        snapshot.load_into(store, str(tmp_path / "snaps"), manifest)
    store.close()


def test_a_load_cut_short_is_never_trusted(tmp_path: Path) -> None:
    store = fresh(tmp_path)

    def keys() -> Any:
        yield [(b"a", KeyState(b"1", 1, 5, 5).encode())]
        raise OSError("disk gone")

    with pytest.raises(OSError):
        store.load_snapshot(keys(), [[RequestRecord("r", 5, b"", 1)]], checkpoint=10, evicted_through_ms=0)
    store.close()
    again = fresh(tmp_path)
    assert again.rebuilt_reason == "a snapshot load did not finish" and again.applied_offset == 0
    again.close()


def test_listing_newest_first_and_skipping_what_cannot_be_used(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    older = write_snapshot(root, snapshot.new_name(1_000), run(rows(0, 1, [])), 1)
    newer = write_snapshot(root, snapshot.new_name(2_000), run(rows(0, 2, [])), 2)
    write_snapshot(root, snapshot.new_name(3_000), run(rows(0, 3, [])), 3, topic="another.wal")
    (root / snapshot.new_name(4_000) / "keys").mkdir(parents=True)  # a job that never finished
    (root / "not-a-snapshot").mkdir()
    listed = snapshot.list_snapshots(str(root))
    assert [m.name if m else None for m, _ in listed] == [None, snapshot.new_name(3_000), newer.name, older.name]
    assert "no manifest.json" in listed[0][1]
    assert snapshot.newest(str(root), TOPIC, 1) == newer
    assert snapshot.newest(str(root), TOPIC, 2) is None  # another shard count: not this cluster's
    assert snapshot.newest(str(tmp_path / "absent"), TOPIC, 1) is None


@pytest.mark.parametrize(("edit", "message"), [
    (lambda b: b.update(format=99), "format 99"),
    (lambda b: b["shards"].pop(), "shards"),
    (lambda b: b.pop("topic"), "not a snapshot manifest"),
])
def test_bad_manifests_are_named(tmp_path: Path, edit: Any, message: str) -> None:
    root = tmp_path / "snaps"
    manifest = write_snapshot(root, snapshot.new_name(1), run(rows(0, 1, [])), 1, shards=2)
    path = root / manifest.name / snapshot.MANIFEST
    body = json.loads(path.read_text())
    edit(body)
    path.write_text(json.dumps(body))
    with pytest.raises(snapshot.SnapshotFormatError, match=message):
        snapshot.read_manifest(str(root), manifest.name)


def test_the_request_table_is_covered_by_its_own_digest(tmp_path: Path) -> None:
    """Issue 18: a snapshot whose requests/ files were lost or altered is refused wherever it is
    depended on (a node's load, `verify_shard` before truncation), not loaded as a self-consistent
    state that would apply retries inside the window a second time."""
    wal = wal_log(11)
    cut = wal[-1][0] + 1
    out = run(rows(0, cut, wal))
    reference = replica(tmp_path, wal, cut)
    assert meta(out)["requests_digest"] == reference.requests_digest()  # the fold's digest is the replica's
    assert meta(out)["requests"] > 0
    root = tmp_path / "snaps"
    lost = write_snapshot(root, snapshot.new_name(1), out, cut)
    altered = write_snapshot(root, snapshot.new_name(2), out, cut)
    for path in (root / lost.name / "requests").rglob("*.parquet"):
        path.unlink()
    [path] = (root / altered.name / "requests").rglob("*.parquet")
    table = pq.read_table(path)
    responses = table.column("response").to_pylist()
    responses[0] = b"forged"  # as many ids, the same keys: only the table's digest tells
    pq.write_table(table.set_column(table.schema.get_field_index("response"), "response",
                                    pa.array(responses, pa.binary())), path)
    for manifest, message in ((lost, "request ids"), (altered, "request-id table digest")):
        store = fresh(tmp_path, manifest.name)
        with pytest.raises(snapshot.SnapshotFormatError, match=message):
            snapshot.load_into(store, str(root), manifest)
        assert store.applied_offset == 0
        store.close()
        with pytest.raises(snapshot.SnapshotFormatError, match=message):
            snapshot.verify_shard(str(root), manifest, 0, scratch_dir=str(tmp_path))
    reference.close()


def test_a_format_1_snapshot_loads_with_unknown_request_kinds(tmp_path: Path) -> None:
    wal = wal_log(12)
    cut = wal[-1][0] + 1
    manifest = write_snapshot(tmp_path / "snaps", snapshot.new_name(1), run(rows(0, cut, wal)), cut, format_1=True)
    again = snapshot.read_manifest(str(tmp_path / "snaps"), manifest.name)
    assert (again.format, again.shard(0).requests_digest) == (1, "")
    store = fresh(tmp_path)
    snapshot.load_into(store, str(tmp_path / "snaps"), again)
    reference = replica(tmp_path, wal, cut)
    assert store.digest() == reference.digest()
    assert [(r.request_id, r.revision, r.kind) for r in store.requests()] == [
        (r.request_id, r.revision, 0) for r in reference.requests()]
    store.close()
    reference.close()


@pytest.mark.parametrize(("found", "expected"), [
    (("d", 3, 2, "q", 9), None),
    (("x", 3, 2, "q", 9), "3 keys with digest x"),
    (("d", 4, 2, "q", 9), "4 keys"),
    (("d", 3, 1, "q", 9), "1 request ids, its manifest says 2"),
    (("d", 3, 2, "other", 9), "request-id table digest other"),
    (("d", 3, 2, "q", 8), "forgotten through 8 ms"),
])
def test_mismatch_names_every_difference(found: tuple[str, int, int, str, int], expected: str | None) -> None:
    meta_ = snapshot.ShardSnapshot(shard=0, offset=5, keys=3, digest="d", requests=2, evicted_through_ms=9,
                                   requests_digest="q")
    why = snapshot.mismatch(meta_, *found)
    assert (why is None) if expected is None else (why is not None and expected in why), why
    legacy = dataclasses.replace(meta_, requests_digest="")  # format 1: only the count covers the table
    assert snapshot.mismatch(legacy, "d", 3, 2, "anything", 9) is None


# ---- cross-shard transactions' tables --------------------------------------------------------------------


def txn_log(seed: int, n: int = 80) -> list[tuple[int, bytes]]:
    """Shard 0's WAL as a coordinator (decisions, some with its own part, and forgets) and as a
    participant (prepares and resolves), among plain writes; some decisions stay undecided or
    unforgotten at any cut."""
    rng = random.Random(seed)
    out, offset = [], 0
    for i in range(n):
        offset += rng.choice((1, 1, 2))
        txn_id = f"t{rng.randrange(12)}"
        ms = 10_000 + offset * 97
        choice = rng.random()
        if choice < 0.3:
            out.append((offset, entry(rng, offset)))
        elif choice < 0.55:
            commit = rng.random() < 0.7
            body = pb.TxnDecision(txn_id=txn_id, commit=commit, succeeded=commit, participants=[0, 1, 2],
                                  request_id=f"c{i}" if rng.random() < 0.5 else "", answer=b"a" if commit else b"",
                                  kept=True)
            effects = [pb.Effect(put=pb.PutEffect(key=b"k-coord", value=b"%d" % offset))] if commit else []
            out.append((offset, pb.WalEntry(request_id=decision_id(txn_id), decision=body, effects=effects,
                                            response=pb.TxnDecided(commit=commit).SerializeToString(),
                                            leader_unix_ms=ms).SerializeToString()))
        elif choice < 0.7:
            forgotten = [f"t{rng.randrange(12)}" for _ in range(rng.randint(1, 3))]
            out.append((offset, pb.WalEntry(forget=pb.TxnForget(txn_ids=forgotten), leader_unix_ms=ms)
                        .SerializeToString()))
        elif choice < 0.85:
            prepare = pb.TxnPrepare(txn_id=f"p{txn_id}", coordinator=1, participants=[1, 0], exclusive_keys=[b"k1"])
            out.append((offset, pb.WalEntry(request_id=prepare_id(f"p{txn_id}"), prepare=prepare, leader_unix_ms=ms)
                        .SerializeToString()))
        else:
            resolve = pb.TxnResolve(txn_id=f"p{txn_id}", commit=True, succeeded=True)
            out.append((offset, pb.WalEntry(request_id=resolve_id(f"p{txn_id}"), resolve=resolve, leader_unix_ms=ms,
                                            effects=[pb.Effect(put=pb.PutEffect(key=b"k1", value=b"r"))])
                        .SerializeToString()))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_a_snapshot_round_trips_the_decision_table(tmp_path: Path, seed: int) -> None:
    """The fold keeps the coordinator's decision table (and the prepared table) exactly as a
    replica does, in one step or on top of a snapshot of a prefix; a snapshot with its decided/
    table loads into a replica with the same table, and one that lost it is refused."""
    wal = txn_log(seed)
    cut = wal[-1][0] + 1
    split = wal[len(wal) // 2][0]
    reference = replica(tmp_path, wal, cut)
    assert reference.decided() and reference.locks.has_locks(), "the log should leave both tables non-empty"
    whole = run(rows(0, cut, wal))
    prefix = run(rows(0, split, [r for r in wal if r[0] < split]))
    on_top = run(rows(0, cut, [r for r in wal if r[0] >= split], base=prefix, base_offset=split,
                      evicted_ms=meta(prefix)["evicted_through_ms"]))
    for out in (whole, on_top):
        m = meta(out)
        assert (m["decided"], m["decided_digest"]) == (len(reference.decided()), reference.decided_digest())
        assert (m["prepared"], m["prepared_digest"]) == (reference.locks.prepared_count(), reference.prepared_digest())
        assert m["digest"] == reference.digest()[0] and m["requests_digest"] == reference.requests_digest()

    root = tmp_path / "snaps"
    manifest = write_snapshot(root, snapshot.new_name(1), on_top, cut, txn_tables=True)
    assert snapshot.read_manifest(str(root), manifest.name) == manifest
    assert manifest.format == snapshot.FORMAT == 4 and manifest.shard(0).decided == len(reference.decided())
    assert snapshot.decided(str(root), manifest.name, 0) == reference.decided()
    store = fresh(tmp_path)
    snapshot.load_into(store, str(root), manifest)
    assert store.decided() == reference.decided() and store.decided_digest() == reference.decided_digest()
    clients = {d.decision.request_id for d in reference.decided()} | {"absent"}
    assert all(store.decided_request(c) == reference.decided_request(c) for c in clients)
    assert store.prepared_digest() == reference.prepared_digest()
    # The loaded replica goes on exactly as the reference: a forget of every decision there is.
    gone = pb.WalEntry(forget=pb.TxnForget(txn_ids=[d.txn_id for d in reference.decided()]), leader_unix_ms=1)
    for shard in (store, reference):
        shard.apply([(cut, gone.SerializeToString())], cut + 1)
        assert shard.decided() == []
    store.close()
    snapshot.verify_shard(str(root), manifest, 0, scratch_dir=str(tmp_path))

    for path in (root / manifest.name / "decided").rglob("*.parquet"):
        path.unlink()
    with pytest.raises(snapshot.SnapshotFormatError, match="decisions with digest"):
        snapshot.verify_shard(str(root), manifest, 0, scratch_dir=str(tmp_path))
    reference.close()


def test_a_format_3_snapshot_loads_with_an_empty_decision_table(tmp_path: Path) -> None:
    """Format 3 kept no decision table: its manifest has no `decided` fields, it has no decided/
    directory, and a replica loaded from it has an empty table (as one migrated in place)."""
    wal = wal_log(13)
    cut = wal[-1][0] + 1
    root = tmp_path / "snaps"
    written = write_snapshot(root, snapshot.new_name(1), run(rows(0, cut, wal)), cut)
    path = root / written.name / snapshot.MANIFEST
    body = json.loads(path.read_text())
    body["format"] = 3
    for shard in body["shards"]:
        del shard["decided"], shard["decided_digest"]
    path.write_text(json.dumps(body))
    manifest = snapshot.read_manifest(str(root), written.name)
    assert (manifest.format, manifest.shard(0).decided, manifest.shard(0).decided_digest) == (3, 0, "")
    assert snapshot.decided(str(root), manifest.name, 0) == []
    store = fresh(tmp_path)
    snapshot.load_into(store, str(root), manifest)
    assert store.decided() == [] and store.applied_offset == cut
    store.close()


def test_mismatch_checks_the_decision_table_only_where_the_manifest_has_its_digest() -> None:
    meta_ = snapshot.ShardSnapshot(shard=0, offset=5, keys=3, digest="d", requests=2, evicted_through_ms=9,
                                   requests_digest="q", decided=1, decided_digest="t")
    assert snapshot.mismatch(meta_, "d", 3, 2, "q", 9, decided=1, decided_digest="t") is None
    why = snapshot.mismatch(meta_, "d", 3, 2, "q", 9, decided=0, decided_digest="e")
    assert why is not None and "0 decisions with digest e, its manifest says 1 with t" in why
    older = dataclasses.replace(meta_, decided=0, decided_digest="")  # format 3 and before
    assert snapshot.mismatch(older, "d", 3, 2, "q", 9, decided=4, decided_digest="x") is None
