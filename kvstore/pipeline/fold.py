"""The per-shard fold that Spark runs in a task: base snapshot + accepted WAL records -> state.

A shard's state is a fold over its log, which is sequential by nature; Spark gives the
parallelism across shards (one group per shard) and does the I/O (the Kafka read, W3, Parquet).
Inside the task the fold is the replicas' own code: a `ShardStore` in a scratch directory,
loaded with `ShardStore.load_snapshot` (what a node bootstrapping from a snapshot runs) and
advanced with `ShardStore.apply` (what every replica runs), digested with `ShardStore.digest`
(what `ClusterService.ShardDigest` answers). So a snapshot cannot disagree with a replica at the same
offset unless one of them was altered, which is what the audit looks for.

Input rows (FOLD_INPUT, one Arrow table per shard): one `control` row (the cut, the base's cut
and evicted-through time, offsets to digest at), the base snapshot's `key`, `request`,
`prepared` rows (a prepared cross-shard transaction: its txn id in `request_id`, its prepare in
`payload`) and `decided` rows (a decision of the coordinator's decision table: its txn id in
`request_id`, the decision in `payload`, its recorded answer in `response`), and the accepted
`wal` records in [base cut, cut). Output rows (FOLD_OUTPUT): the state at the cut as `key`,
`request`, `prepared` (the prepare in `response`) and `decided` rows (the decision in `payload`,
its answer in `response`), and one `meta` row per digest point (the cut's marked).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvstore.core.state import DecidedTxn, KeyState, PreparedTxn, RequestRecord
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.storage.shard_store import ShardStore, decided_digest
from kvstore.storage.snapshot import encode_states

APPLY_CHUNK_RECORDS = 10_000  # records per LevelDB write batch while folding

FOLD_INPUT = pa.schema([
    ("shard", pa.int32()), ("kind", pa.string()), ("offset", pa.int64()), ("payload", pa.binary()),
    ("key", pa.binary()), ("value", pa.binary()), ("version", pa.int64()), ("mod_revision", pa.int64()),
    ("create_revision", pa.int64()), ("request_id", pa.string()), ("revision", pa.int64()),
    ("leader_unix_ms", pa.int64()), ("response", pa.binary()), ("base_offset", pa.int64()),
    ("evicted_through_ms", pa.int64()), ("digest_at", pa.list_(pa.int64())), ("request_kind", pa.int32()),
])
FOLD_OUTPUT = pa.schema([
    ("shard", pa.int32()), ("kind", pa.string()),
    ("key", pa.binary()), ("value", pa.binary()), ("version", pa.int64()), ("mod_revision", pa.int64()),
    ("create_revision", pa.int64()), ("request_id", pa.string()), ("revision", pa.int64()),
    ("leader_unix_ms", pa.int64()), ("response", pa.binary()),
    ("offset", pa.int64()), ("digest", pa.string()), ("keys", pa.int64()), ("requests", pa.int64()),
    ("evicted_through_ms", pa.int64()), ("wal_records", pa.int64()), ("duplicates", pa.int64()),
    ("malformed_entries", pa.int64()), ("is_cut", pa.bool_()), ("request_kind", pa.int32()),
    ("requests_digest", pa.string()), ("prepared", pa.int64()), ("prepared_digest", pa.string()),
    ("payload", pa.binary()), ("decided", pa.int64()), ("decided_digest", pa.string()),
])
# The same schemas as Spark DDL, for createDataFrame and applyInArrow.
FOLD_INPUT_DDL = ("shard int, kind string, offset bigint, payload binary, key binary, value binary, version bigint, "
                  "mod_revision bigint, create_revision bigint, request_id string, revision bigint, "
                  "leader_unix_ms bigint, response binary, base_offset bigint, evicted_through_ms bigint, "
                  "digest_at array<bigint>, request_kind int")
FOLD_OUTPUT_DDL = ("shard int, kind string, key binary, value binary, version bigint, mod_revision bigint, "
                   "create_revision bigint, request_id string, revision bigint, leader_unix_ms bigint, "
                   "response binary, offset bigint, digest string, keys bigint, requests bigint, "
                   "evicted_through_ms bigint, wal_records bigint, duplicates bigint, malformed_entries bigint, "
                   "is_cut boolean, request_kind int, requests_digest string, prepared bigint, prepared_digest string, "
                   "payload binary, decided bigint, decided_digest string")


class FoldError(Exception):
    """The rows handed to a shard's fold do not describe one consistent range of its log."""


def fold(table: pa.Table, *, topic: str, max_request_ids: int, request_id_horizon_ms: int,
         scratch_dir: str | None = None, emit_state: bool = True) -> pa.Table:
    """Fold one shard's rows (FOLD_INPUT) into its state at the cut (FOLD_OUTPUT); with
    `emit_state` False only the `meta` rows (an audit needs the digests, not the state)."""
    shards = pc.unique(table.column("shard")).to_pylist()
    if len(shards) != 1:
        raise FoldError(f"a fold is one shard's, got shards {sorted(shards)}")
    shard = int(shards[0])
    (cuts, base_offsets, evicted, digest_at) = _columns(table, "control", "offset", "base_offset",
                                                        "evicted_through_ms", "digest_at")
    if len(cuts) != 1:
        raise FoldError(f"shard {shard}: {len(cuts)} control rows, expected 1")
    cut, base_offset = int(cuts[0]), int(base_offsets[0])
    offsets, payloads = _columns(table, "wal", "offset", "payload")
    wal = sorted(zip(offsets, payloads, strict=True))
    if wal and not (base_offset <= wal[0][0] and wal[-1][0] < cut):
        raise FoldError(f"shard {shard}: WAL records [{wal[0][0]}, {wal[-1][0]}] outside [{base_offset}, {cut})")
    points = sorted({p for p in (digest_at[0] or ()) if base_offset <= p <= cut} | {cut})

    scratch = Path(tempfile.mkdtemp(prefix=f"kvstore-fold-{shard}-", dir=scratch_dir))
    store = ShardStore(scratch / "db", topic=topic, shard=shard, max_request_ids=max_request_ids,
                       request_id_horizon_ms=request_id_horizon_ms)
    try:
        key_rows = table.filter(pc.equal(table.column("kind"), "key"))
        base_keys = list(zip(key_rows.column("key").to_pylist(),
                             encode_states(*(key_rows.column(c).combine_chunks() for c in
                                             ("value", "version", "mod_revision", "create_revision"))),
                             strict=True))
        req_cols = _columns(table, "request", "request_id", "revision", "response", "leader_unix_ms", "request_kind")
        base_requests = sorted((RequestRecord(rid, rev, resp, ms, kind or 0)  # a format-1 base has no kind
                                for rid, rev, resp, ms, kind in zip(*req_cols, strict=True)),
                               key=lambda q: q.revision)
        prepared_cols = _columns(table, "prepared", "request_id", "revision", "leader_unix_ms", "payload")
        base_prepared = [PreparedTxn(wal_entry_pb2.TxnPrepare.FromString(body), rev, ms or 0)
                         for _tid, rev, ms, body in zip(*prepared_cols, strict=True)]
        decided_cols = _columns(table, "decided", "request_id", "revision", "leader_unix_ms", "payload", "response")
        base_decided = [DecidedTxn(wal_entry_pb2.TxnDecision.FromString(body), rev, ms or 0, resp or b"")
                        for _tid, rev, ms, body, resp in zip(*decided_cols, strict=True)]
        del key_rows, req_cols
        store.load_snapshot([base_keys], [base_requests], checkpoint=base_offset,
                            evicted_through_ms=int(evicted[0] or 0), prepared=base_prepared, decided=base_decided)
        del base_keys, base_requests
        out = _Output(shard)
        duplicates = malformed = 0
        i = 0
        for point in points:
            while i < len(wal) and wal[i][0] < point:
                chunk = [rec for rec in wal[i:i + APPLY_CHUNK_RECORDS] if rec[0] < point]
                i += len(chunk)
                done = i >= len(wal) or wal[i][0] >= point
                applied = store.apply(chunk, point if done else chunk[-1][0] + 1)
                duplicates += applied.duplicates
                malformed += applied.malformed
            if store.applied_offset < point:
                store.apply([], point)
            digest, keys = store.digest()
            decided = store.decided()
            out.meta(offset=point, digest=digest, keys=keys, requests=store.request_count,
                     evicted_through_ms=store.evicted_through_ms, wal_records=len(wal), duplicates=duplicates,
                     malformed_entries=malformed, is_cut=point == cut, requests_digest=store.requests_digest(),
                     prepared=store.locks.prepared_count(), prepared_digest=store.prepared_digest(),
                     decided=len(decided), decided_digest=decided_digest(decided))
        if emit_state:
            out.keys(store.keys())
            out.requests(store.requests())
            out.prepared(store.locks.prepared())
            out.decided(store.decided())
        return out.table()
    finally:
        store.close()
        shutil.rmtree(scratch, ignore_errors=True)


class _Output:
    """FOLD_OUTPUT rows, kept column-wise per kind (a Python list per column, no per-row dict:
    this runs once per key of the shard) and laid side by side with NULLs at the end."""

    def __init__(self, shard: int) -> None:
        self._shard = shard
        self._keys: dict[str, list[Any]] = {c: [] for c in ("key", "value", "version", "mod_revision",
                                                            "create_revision")}
        self._requests: dict[str, list[Any]] = {c: [] for c in ("request_id", "revision", "leader_unix_ms",
                                                                "response", "request_kind")}
        self._metas: dict[str, list[Any]] = {c: [] for c in ("offset", "digest", "keys", "requests",
                                                             "evicted_through_ms", "wal_records", "duplicates",
                                                             "malformed_entries", "is_cut", "requests_digest",
                                                             "prepared", "prepared_digest", "decided",
                                                             "decided_digest")}
        self._prepared: dict[str, list[Any]] = {c: [] for c in ("request_id", "revision", "leader_unix_ms",
                                                                "response")}
        self._decided: dict[str, list[Any]] = {c: [] for c in ("request_id", "revision", "leader_unix_ms",
                                                               "payload", "response")}

    def keys(self, states: Iterator[tuple[bytes, KeyState]]) -> None:
        key, value, version, mod, create = self._keys.values()
        for k, state in states:
            key.append(k)
            value.append(state.value)
            version.append(state.version)
            mod.append(state.mod_revision)
            create.append(state.create_revision)

    def requests(self, requests: Iterator[RequestRecord]) -> None:
        rid, revision, leader_ms, response, kind = self._requests.values()
        for req in requests:
            rid.append(req.request_id)
            revision.append(req.revision)
            leader_ms.append(req.leader_unix_ms)
            response.append(req.response)
            kind.append(req.kind)

    def prepared(self, prepared: list[PreparedTxn]) -> None:
        tid, revision, leader_ms, body = self._prepared.values()
        for txn in prepared:
            tid.append(txn.txn_id)
            revision.append(txn.revision)
            leader_ms.append(txn.leader_unix_ms)
            body.append(txn.prepare.SerializeToString())

    def decided(self, decided: list[DecidedTxn]) -> None:
        tid, revision, leader_ms, body, response = self._decided.values()
        for row in decided:
            tid.append(row.txn_id)
            revision.append(row.revision)
            leader_ms.append(row.leader_unix_ms)
            body.append(row.decision.SerializeToString())
            response.append(row.response)

    def meta(self, **values: Any) -> None:
        assert values.keys() == self._metas.keys(), f"meta fields {sorted(values)}"
        for name, value in values.items():
            self._metas[name].append(value)

    def table(self) -> pa.Table:
        parts = []
        for kind, columns in (("key", self._keys), ("request", self._requests), ("prepared", self._prepared),
                              ("decided", self._decided), ("meta", self._metas)):
            n = len(next(iter(columns.values())))
            arrays = []
            for field in FOLD_OUTPUT:
                if field.name == "shard":
                    arrays.append(pa.array([self._shard] * n, field.type))
                elif field.name == "kind":
                    arrays.append(pa.array([kind] * n, field.type))
                elif field.name in columns:
                    arrays.append(pa.array(columns[field.name], field.type))
                else:
                    arrays.append(pa.nulls(n, field.type))
            parts.append(pa.Table.from_arrays(arrays, schema=FOLD_OUTPUT))
        return pa.concat_tables(parts)


def _columns(table: pa.Table, kind: str, *names: str) -> list[list[Any]]:
    """The named columns of the rows of one kind, as Python lists (column-wise: one list per
    column costs far less than a dict per row)."""
    rows = table.filter(pc.equal(table.column("kind"), kind))
    return [rows.column(name).to_pylist() for name in names]
