"""Snapshots: a shard's replica state as of a WAL offset (the *cut*), as Parquet plus a manifest.

Written by the Spark job (`kvstore snapshot create`, `kvstore.pipeline.snapshot_job`), read by
nodes that bootstrap from one (`kvstore serve --snapshot-dir`), by the next snapshot (built from
this one plus the WAL since its cut) and by `kvstore wal truncate` and `kvstore audit`. This
module is the format's one definition and needs no Spark: pyarrow only.

Layout of a snapshot directory DIR (a local path, `file://`, or any URI pyarrow's filesystems
take: `s3://`, `gs://`, `hdfs://`; Spark's `s3a://` is read as `s3://`):

    DIR/snap-<created unix ms, 13 digits>/
        keys/shard=<s>/*.parquet       key, value, version, mod_revision, create_revision
        requests/shard=<s>/*.parquet   request_id, revision, leader_unix_ms, response, request_kind
        prepared/shard=<s>/*.parquet   txn_id, revision, leader_unix_ms, prepare (format 3)
        decided/shard=<s>/*.parquet    txn_id, revision, leader_unix_ms, decision, response (format 4)
        manifest.json                  written last: a snapshot without one is incomplete

What a replica needs to continue exactly where the WAL left it (W5 at the cut): every live key
with its full state (so versions and revisions continue), and the request-id table with each
id's revision, leader time and original answer, the table's `evicted_through_ms`, and the
bounds it was kept with (so a retry of a request made before the cut is still answered once,
and an expired one still refused). The checkpoint is the cut: every record below it is in.

The manifest per shard: `offset` (the cut), `keys`, `digest` (`ShardStore.digest`, equal to
`ClusterService.ShardDigest` of a replica whose checkpoint is the cut), `requests`,
`evicted_through_ms`, `requests_digest` (`ShardStore.requests_digest`: the request-id table and
its horizon state), and the schema version `format`. Both digests are checked wherever a snapshot
is depended on: when a node loads it (`load_into`), when the next snapshot is built on it, and
before `kvstore wal truncate` deletes the WAL below it (`verify_shard`).

Format 4 added the coordinator shards' decision tables at the cut (`decided/`, and per shard
`decided` and `decided_digest`, `ShardStore.decided_digest`): the decisions not forgotten yet,
each with its offset, leader time and recorded answer, which a replica loaded from it answers
resolvers and finishes from (docs/design.md §10). A snapshot of an older format has none: it was
taken before decisions were kept, and loads with an empty table (a node that upgraded in place
has the same, `kvstore.storage.shard_store`); nothing checks the table of such a snapshot.
Format 3 added the cross-shard transactions prepared at the cut (`prepared/`, and per shard
`prepared` and `prepared_digest`, `ShardStore.prepared_digest`): a snapshot never holds half a
transaction, since a replica loaded from it keeps their locks and applies their resolves
(docs/design.md §10). A format-2 snapshot has none (it was taken before there were any).
Format 2 added `requests_digest` and the requests' `request_kind`. A format-1 snapshot still
loads (its ids' kinds are unknown: 0), but nothing covers its request table but the count: it is
used with a warning, and the next snapshot built on it is format 2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from kvstore.core.state import DecidedTxn, KeyState, PreparedTxn, RequestRecord
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.storage.shard_store import ShardStore, decided_digest

log = logging.getLogger(__name__)

FORMAT = 4
READABLE_FORMATS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
_NAME = re.compile(r"^snap-(\d{13})$")

KEYS_SCHEMA = pa.schema([
    ("key", pa.binary()), ("value", pa.binary()), ("version", pa.int64()), ("mod_revision", pa.int64()),
    ("create_revision", pa.int64()),
])
REQUESTS_SCHEMA = pa.schema([
    ("request_id", pa.string()), ("revision", pa.int64()), ("leader_unix_ms", pa.int64()), ("response", pa.binary()),
    ("request_kind", pa.int32()),  # format 2 (absent from format 1: read as 0)
])
PREPARED_SCHEMA = pa.schema([  # format 3
    ("txn_id", pa.string()), ("revision", pa.int64()), ("leader_unix_ms", pa.int64()), ("prepare", pa.binary()),
])
DECIDED_SCHEMA = pa.schema([  # format 4
    ("txn_id", pa.string()), ("revision", pa.int64()), ("leader_unix_ms", pa.int64()), ("decision", pa.binary()),
    ("response", pa.binary()),
])


class SnapshotFormatError(Exception):
    """A snapshot (or its directory) cannot be used: the message says which and why."""


@dataclasses.dataclass(frozen=True)
class ShardSnapshot:
    shard: int
    offset: int  # the cut: every WAL record below it is in the state, none at or above it
    keys: int
    digest: str
    requests: int
    evicted_through_ms: int
    requests_digest: str = ""  # format 2; "" in a format-1 manifest (nothing covers its request table)
    prepared: int = 0  # format 3: cross-shard transactions prepared at the cut
    prepared_digest: str = ""  # format 3; "" before (no transaction could be prepared then)
    decided: int = 0  # format 4: decisions in the shard's decision table at the cut
    decided_digest: str = ""  # format 4; "" before (no table was kept: nothing checks it)


@dataclasses.dataclass(frozen=True)
class Manifest:
    name: str
    topic: str
    shard_count: int
    created_unix_ms: int
    base: str | None  # the snapshot this one was built from (plus the WAL since its cut)
    max_request_ids: int
    request_id_horizon_ms: int
    shards: tuple[ShardSnapshot, ...]
    format: int = FORMAT

    def shard(self, shard: int) -> ShardSnapshot:
        for s in self.shards:
            if s.shard == shard:
                return s
        raise SnapshotFormatError(f"snapshot {self.name} has no shard {shard}")

    def to_json(self) -> str:
        body = dataclasses.asdict(self)
        body["shards"] = [dataclasses.asdict(s) for s in self.shards]
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @staticmethod
    def from_json(text: str, where: str) -> Manifest:
        try:
            body: dict[str, Any] = json.loads(text)
            if body.get("format") not in READABLE_FORMATS:
                raise SnapshotFormatError(f"{where}: format {body.get('format')!r}, this version reads "
                                          f"{', '.join(map(str, READABLE_FORMATS))}")
            shards = tuple(ShardSnapshot(**s) for s in body.pop("shards"))
            manifest = Manifest(shards=shards, **body)
        except (ValueError, TypeError, KeyError) as exc:
            raise SnapshotFormatError(f"{where}: not a snapshot manifest: {exc}") from exc
        if sorted(s.shard for s in shards) != list(range(manifest.shard_count)):
            raise SnapshotFormatError(f"{where}: shards {[s.shard for s in shards]} of {manifest.shard_count}")
        return manifest


def new_name(now_ms: int | None = None) -> str:
    return f"snap-{int(time.time() * 1000) if now_ms is None else now_ms:013d}"


# ---- where snapshots live -------------------------------------------------------------------------


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for a snapshot URI. `s3a://` is Hadoop's name for S3."""
    if uri.startswith("s3a://"):
        uri = "s3://" + uri[len("s3a://"):]
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def snapshot_uri(root: str, name: str) -> str:
    return _join(root, name)


def list_snapshots(root: str) -> list[tuple[Manifest | None, str]]:
    """Every snapshot directory under `root`, newest first, with its manifest or, for an
    incomplete or unreadable one, None and why."""
    fs, path = _filesystem(root)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError as exc:
        raise SnapshotFormatError(f"cannot list {root}: {exc}") from exc
    names = sorted((i.base_name for i in infos if i.type == pafs.FileType.Directory and _NAME.match(i.base_name)),
                   reverse=True)
    out: list[tuple[Manifest | None, str]] = []
    for name in names:
        try:
            out.append((read_manifest(root, name), name))
        except SnapshotFormatError as exc:
            out.append((None, f"{name}: {exc}"))
    return out


def read_manifest(root: str, name: str) -> Manifest:
    fs, path = _filesystem(_join(root, name, MANIFEST))
    try:
        with fs.open_input_stream(path) as stream:
            text = stream.read().decode("utf-8")
    except FileNotFoundError as exc:
        raise SnapshotFormatError(f"{name} has no {MANIFEST} (incomplete: its job did not finish)") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SnapshotFormatError(f"{name}: cannot read {MANIFEST}: {exc}") from exc
    manifest = Manifest.from_json(text, f"{name}/{MANIFEST}")
    if manifest.name != name:
        raise SnapshotFormatError(f"{name}: its manifest names {manifest.name}")
    return manifest


def write_manifest(root: str, manifest: Manifest) -> None:
    """Written last, in one piece: its presence is what makes the snapshot complete."""
    fs, path = _filesystem(_join(root, manifest.name, MANIFEST))
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp = path + ".tmp"
    with fs.open_output_stream(tmp) as stream:
        stream.write(manifest.to_json().encode())
    fs.move(tmp, path)


def newest(root: str, topic: str, shard_count: int) -> Manifest | None:
    """The newest complete snapshot of this WAL, or None. Snapshots of another topic or shard
    count in the same directory are skipped loudly: they cannot be this cluster's state."""
    for manifest, name in list_snapshots(root):
        if manifest is None:
            log.warning("skipping snapshot %s", name)
            continue
        if manifest.topic != topic or manifest.shard_count != shard_count:
            log.warning("skipping snapshot %s: it is of %s with %d shards, not %s with %d", name, manifest.topic,
                        manifest.shard_count, topic, shard_count)
            continue
        return manifest
    return None


# ---- reading a shard's rows ---------------------------------------------------------------------------


def has_table(root: str, name: str, table: str) -> bool:
    """Whether Spark wrote `table` at all (it writes nothing for a DataFrame without rows... or
    an empty directory: both read as no rows)."""
    fs, path = _filesystem(_join(root, name, table))
    return bool(fs.get_file_info(path).type == pafs.FileType.Directory)


def _shard_batches(root: str, name: str, table: str, shard: int, schema: pa.Schema,
                   batch_rows: int) -> Iterator[pa.RecordBatch]:
    fs, path = _filesystem(_join(root, name, table, f"shard={shard}"))
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return  # Spark writes no directory for a shard without rows
    dataset = pads.dataset(path, filesystem=fs, format="parquet", schema=schema)
    yield from dataset.to_batches(batch_size=batch_rows)


def key_states(root: str, name: str, shard: int, batch_rows: int = 65_536) -> Iterator[list[tuple[bytes, KeyState]]]:
    """The shard's keys in batches; order is Parquet's, not the keys'."""
    for batch in _shard_batches(root, name, "keys", shard, KEYS_SCHEMA, batch_rows):
        cols = [batch.column(i).to_pylist() for i in range(5)]
        yield [(k, KeyState(v, ver, mod, create)) for k, v, ver, mod, create in zip(*cols, strict=True)]


def encoded_key_states(root: str, name: str, shard: int,
                       batch_rows: int = 65_536) -> Iterator[list[tuple[bytes, bytes]]]:
    """The shard's keys with their states encoded as LevelDB stores them, in batches."""
    for batch in _shard_batches(root, name, "keys", shard, KEYS_SCHEMA, batch_rows):
        encoded = encode_states(batch.column(1), batch.column(2), batch.column(3), batch.column(4))
        yield list(zip(batch.column(0).to_pylist(), encoded, strict=True))


def encode_states(value: pa.Array, version: pa.Array, mod_revision: pa.Array, create_revision: pa.Array) -> list[bytes]:
    """`KeyState.encode` for whole columns at once (Arrow and numpy do the packing): a bootstrap
    from a snapshot is bound by this loop, and one Python object per field per key cost more
    than LevelDB's own writes."""
    n = len(value)
    if n == 0:
        return []
    header = np.empty((n, 3), dtype=">i8")
    for i, column in enumerate((version, mod_revision, create_revision)):
        header[:, i] = column.to_numpy(zero_copy_only=False)
    fixed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(24), n, [None, pa.py_buffer(header.tobytes())])
    joined = pc.binary_join_element_wise(fixed.cast(pa.binary()), value.cast(pa.binary()),
                                         pa.scalar(b"", pa.binary()))
    out: list[bytes] = joined.to_pylist()
    return out


def prepared(root: str, name: str, shard: int) -> list[PreparedTxn]:
    """The shard's prepared cross-shard transactions at the cut (none before format 3)."""
    out: list[PreparedTxn] = []
    for batch in _shard_batches(root, name, "prepared", shard, PREPARED_SCHEMA, 65_536):
        for txn_id, revision, leader_ms, body in zip(*(batch.column(i).to_pylist() for i in range(4)), strict=True):
            prepare = wal_entry_pb2.TxnPrepare.FromString(body)
            if prepare.txn_id != txn_id:
                raise SnapshotFormatError(f"snapshot {name} shard {shard}: a prepared row of {txn_id} holds "
                                          f"{prepare.txn_id}'s prepare")
            out.append(PreparedTxn(prepare, revision, leader_ms))
    return out


def decided(root: str, name: str, shard: int) -> list[DecidedTxn]:
    """The shard's decision table at the cut (empty before format 4), oldest decision first."""
    out: list[DecidedTxn] = []
    for batch in _shard_batches(root, name, "decided", shard, DECIDED_SCHEMA, 65_536):
        for txn_id, revision, leader_ms, body, response in zip(*(batch.column(i).to_pylist() for i in range(5)),
                                                               strict=True):
            decision = wal_entry_pb2.TxnDecision.FromString(body)
            if decision.txn_id != txn_id:
                raise SnapshotFormatError(f"snapshot {name} shard {shard}: a decided row of {txn_id} holds "
                                          f"{decision.txn_id}'s decision")
            out.append(DecidedTxn(decision, revision, leader_ms or 0, response or b""))
    out.sort(key=lambda row: row.revision)
    return out


def requests(root: str, name: str, shard: int, batch_rows: int = 65_536) -> Iterator[list[RequestRecord]]:
    """The shard's request-id table in batches (a format-1 snapshot's have no kind: 0)."""
    for batch in _shard_batches(root, name, "requests", shard, REQUESTS_SCHEMA, batch_rows):
        cols = [batch.column(i).to_pylist() for i in range(5)]
        yield [RequestRecord(rid, rev, resp, ms, kind or 0) for rid, rev, ms, resp, kind in zip(*cols, strict=True)]


# ---- loading into a replica -----------------------------------------------------------------------


def load_into(store: ShardStore, root: str, manifest: Manifest, *, batch_rows: int = 65_536,
              on_progress: Callable[[int, int], None] | None = None) -> ShardSnapshot:
    """Replace `store`'s state by the snapshot's for its shard, then check it: key count and
    digest must be the manifest's, or the store is wiped again and SnapshotFormatError raised
    (a snapshot that does not reproduce its own digest is not a state to serve)."""
    if manifest.topic != store.topic:
        raise SnapshotFormatError(f"snapshot {manifest.name} is of topic {manifest.topic}, not {store.topic}")
    if (manifest.max_request_ids, manifest.request_id_horizon_ms) != (store.max_request_ids,
                                                                       store.request_id_horizon_ms):
        # Replicas with other bounds would keep other ids: their states would drift apart.
        raise SnapshotFormatError(
            f"snapshot {manifest.name} kept {manifest.max_request_ids} request ids for "
            f"{manifest.request_id_horizon_ms} ms; this replica keeps {store.max_request_ids} for "
            f"{store.request_id_horizon_ms} ms")
    meta = manifest.shard(store.shard)
    store.load_snapshot(encoded_key_states(root, manifest.name, store.shard, batch_rows),
                        requests(root, manifest.name, store.shard, batch_rows),
                        checkpoint=meta.offset, evicted_through_ms=meta.evicted_through_ms, on_progress=on_progress,
                        prepared=prepared(root, manifest.name, store.shard),
                        decided=decided(root, manifest.name, store.shard))
    table = store.decided()
    why = mismatch(meta, *store.digest(), store.request_count, store.requests_digest(), store.evicted_through_ms,
                   prepared=store.locks.prepared_count(), prepared_digest=store.prepared_digest(),
                   decided=len(table), decided_digest=decided_digest(table))
    if why is not None:
        store.wipe(f"snapshot {manifest.name} did not load to its own digests")
        raise SnapshotFormatError(f"snapshot {manifest.name} shard {store.shard}: {why}")
    if not meta.requests_digest:
        log.warning("snapshot %s (format %d) shard %d: no digest covers its request-id table (only its count, %d): "
                    "the next snapshot will", manifest.name, manifest.format, store.shard, meta.requests)
    return meta


def mismatch(meta: ShardSnapshot, digest: str, keys: int, requests: int, requests_digest: str,
             evicted_through_ms: int, *, prepared: int = 0, prepared_digest: str = "", decided: int = 0,
             decided_digest: str = "") -> str | None:
    """How a state recomputed from a snapshot's files (or from its base plus the WAL) differs
    from what its manifest says, or None. Pure: the loader, the snapshot job and the audit say
    the same thing the same way."""
    found: list[str] = []
    if (digest, keys) != (meta.digest, meta.keys):
        found.append(f"{keys} keys with digest {digest[:12]}, its manifest says {meta.keys} with {meta.digest[:12]}")
    if requests != meta.requests:
        found.append(f"{requests} request ids, its manifest says {meta.requests}")
    if evicted_through_ms != meta.evicted_through_ms:
        found.append(f"request ids forgotten through {evicted_through_ms} ms, its manifest says "
                     f"{meta.evicted_through_ms}")
    if meta.requests_digest and requests_digest != meta.requests_digest:
        found.append(f"request-id table digest {requests_digest[:12]}, its manifest says {meta.requests_digest[:12]}")
    if meta.prepared_digest and (prepared, prepared_digest) != (meta.prepared, meta.prepared_digest):
        found.append(f"{prepared} prepared transactions with digest {prepared_digest[:12]}, its manifest says "
                     f"{meta.prepared} with {meta.prepared_digest[:12]}")
    if meta.decided_digest and (decided, decided_digest) != (meta.decided, meta.decided_digest):
        found.append(f"{decided} decisions with digest {decided_digest[:12]}, its manifest says "
                     f"{meta.decided} with {meta.decided_digest[:12]}")
    return "; ".join(found) if found else None


def verify_shard(root: str, manifest: Manifest, shard: int, scratch_dir: str | None = None) -> ShardSnapshot:
    """Load one shard of a snapshot into a scratch replica and check it against its manifest
    (`load_into`: the same check a node runs before it serves a loaded snapshot). For whoever
    is about to depend on a snapshot without loading it for real (`kvstore wal truncate` deletes
    the WAL below its cut): it must be whole first. Raises SnapshotFormatError saying what is
    wrong; leaves nothing behind."""
    import shutil
    import tempfile
    from pathlib import Path

    scratch = Path(tempfile.mkdtemp(prefix=f"kvstore-verify-{shard}-", dir=scratch_dir))
    store = ShardStore(scratch / "db", topic=manifest.topic, shard=shard, max_request_ids=manifest.max_request_ids,
                       request_id_horizon_ms=manifest.request_id_horizon_ms)
    try:
        try:
            return load_into(store, root, manifest)
        except (OSError, pa.ArrowException) as exc:
            raise SnapshotFormatError(f"snapshot {manifest.name} shard {shard}: cannot read its files: {exc}") from exc
    finally:
        store.close()
        shutil.rmtree(scratch, ignore_errors=True)
