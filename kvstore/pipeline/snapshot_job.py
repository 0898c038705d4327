"""`kvstore snapshot create|list`: per-shard snapshots built by Spark from the newest one + the WAL.

The cut of each shard is its last stable offset when the job starts (everything below it is
committed or aborted, so a read_committed read up to it is final). The job reads the accepted
records between the newest usable snapshot's cut and the new cut (W3 in SQL,
`kvstore.pipeline.wal_source`), folds them per shard onto that snapshot's state in one Spark
task per shard (`kvstore.pipeline.fold`: the replicas' own apply code), writes the state as
Parquet, then the manifest (`kvstore.storage.snapshot`). Cost: the WAL since the last snapshot plus
one pass over the state, never the whole history once a snapshot exists.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from kvstore.limits import MAX_REQUEST_IDS, REQUEST_ID_HORIZON_MS
from kvstore.output import Printer, format_table
from kvstore.pipeline import fold, wal_source
from kvstore.pipeline.commands import spark_for, stderr_progress
from kvstore.pipeline.errors import PipelineError, SnapshotError, WalGapError
from kvstore.pipeline.target import WalTarget
from kvstore.storage import snapshot

log = logging.getLogger(__name__)


def wal_ends(target: WalTarget, timeout_s: float = 30.0) -> dict[int, tuple[int, int]]:
    """Per shard (log start, last stable offset), read through `wal/`."""
    from confluent_kafka import KafkaException

    from wal.clients import PartitionEnds

    ends = PartitionEnds(target.bootstrap_servers, timeout_s, target.security)
    out: dict[int, tuple[int, int]] = {}
    try:
        for shard in range(target.shards):
            out[shard] = (ends.log_start(target.topic, shard), ends.stable_offset(target.topic, shard))
    except KafkaException as exc:
        raise PipelineError(f"cannot read the WAL's offsets ({target.topic}): {exc}") from exc
    return out


def check_range(target: WalTarget, base: snapshot.Manifest | None, ends: Mapping[int, tuple[int, int]]) -> None:
    """Refuse a range the WAL cannot supply: records truncated away that no snapshot covers."""
    for shard, (log_start, stable) in sorted(ends.items()):
        start = base.shard(shard).offset if base else 0
        if log_start > start:
            covered = f"the newest snapshot {base.name} ends at {start}" if base else "there is no snapshot"
            raise WalGapError(f"shard {shard}: the WAL starts at {log_start} (truncated) but {covered}; the records "
                              "in between are gone. Use the snapshot directory the WAL was truncated with.")
        if stable < start:
            name = base.name if base else ""
            raise SnapshotError(f"shard {shard}: the WAL ends at {stable}, below snapshot {name}'s cut {start}: is "
                                f"this the same topic ({target.topic}), or was it recreated?")


def build_states(spark: SparkSession, target: WalTarget, root: str, base: snapshot.Manifest | None,
                 cuts: Mapping[int, int], digest_at: Mapping[int, Sequence[int]] | None = None,
                 *, kafka_extra: Mapping[str, str] | None = None, emit_state: bool = True) -> DataFrame:
    """Every shard's state at `cuts` (FOLD_OUTPUT rows), from `base` plus the WAL after it, and
    digests at the offsets of `digest_at` (per shard) on the way; only those digests (`meta`
    rows) with `emit_state` False."""
    base_offsets = {s: (base.shard(s).offset if base else 0) for s in range(target.shards)}
    frames: list[DataFrame] = []
    control_rows = [
        (s, "control", cuts[s], base_offsets[s], base.shard(s).evicted_through_ms if base else 0,
         list((digest_at or {}).get(s, ())))
        for s in range(target.shards)
    ]
    control = spark.createDataFrame(
        control_rows, "shard int, kind string, offset bigint, base_offset bigint, evicted_through_ms bigint, "
                      "digest_at array<bigint>")
    frames.append(control)
    ranges = {s: (base_offsets[s], cuts[s]) for s in range(target.shards) if cuts[s] > base_offsets[s]}
    if ranges:
        raw = wal_source.read_wal(spark, target.bootstrap_servers, target.topic, ranges, kafka_extra=kafka_extra,
                                  security=target.security)
        accepted = wal_source.accepted(wal_source.judged(raw))
        frames.append(accepted.select("shard", F.lit("wal").alias("kind"), "offset", "payload"))
    if base is not None:
        # Read with the format's schemas, never inferred: a table Spark wrote without rows (a
        # directory holding only _SUCCESS, e.g. no request ids yet) has no file to infer from, and
        # a format-1 base has no request kinds (read as NULL: unknown, 0, as a migrated replica).
        uri = snapshot.snapshot_uri(root, base.name)
        if snapshot.has_table(root, base.name, "keys"):
            frames.append(spark.read.schema(_ddl(snapshot.KEYS_SCHEMA)).parquet(f"{uri}/keys").select(
                F.col("shard").cast("int"), F.lit("key").alias("kind"), "key", "value", "version", "mod_revision",
                "create_revision"))
        if snapshot.has_table(root, base.name, "prepared"):
            frames.append(spark.read.schema(_ddl(snapshot.PREPARED_SCHEMA)).parquet(f"{uri}/prepared").select(
                F.col("shard").cast("int"), F.lit("prepared").alias("kind"), F.col("txn_id").alias("request_id"),
                "revision", "leader_unix_ms", F.col("prepare").alias("payload")))
        if snapshot.has_table(root, base.name, "decided"):  # format 4: a base of an older format has none
            frames.append(spark.read.schema(_ddl(snapshot.DECIDED_SCHEMA)).parquet(f"{uri}/decided").select(
                F.col("shard").cast("int"), F.lit("decided").alias("kind"), F.col("txn_id").alias("request_id"),
                "revision", "leader_unix_ms", F.col("decision").alias("payload"), "response"))
        if snapshot.has_table(root, base.name, "requests"):
            frames.append(spark.read.schema(_ddl(snapshot.REQUESTS_SCHEMA)).parquet(f"{uri}/requests").select(
                F.col("shard").cast("int"), F.lit("request").alias("kind"), "request_id", "revision",
                "leader_unix_ms", "response", F.coalesce(F.col("request_kind"), F.lit(0)).cast("int")
                .alias("request_kind")))
    rows = functools.reduce(lambda a, b: a.unionByName(b), [_as_fold_input(f) for f in frames])
    topic = target.topic
    # A lambda, not functools.partial: pyspark infers applyInArrow's flavour from the function's
    # type hints, and a partial of an annotated function with keywords makes it fail.
    return rows.groupBy("shard").applyInArrow(
        lambda table: fold.fold(table, topic=topic, max_request_ids=MAX_REQUEST_IDS,
                                request_id_horizon_ms=REQUEST_ID_HORIZON_MS, emit_state=emit_state),
        fold.FOLD_OUTPUT_DDL)


_SPARK_TYPES = {"binary": "binary", "string": "string", "int64": "bigint", "int32": "int"}


def _ddl(schema: Any) -> str:
    """A snapshot table's pyarrow schema as Spark DDL, with its partition column `shard`."""
    return ", ".join([*(f"{f.name} {_SPARK_TYPES[str(f.type)]}" for f in schema), "shard int"])


def _as_fold_input(frame: DataFrame) -> DataFrame:
    """Every FOLD_INPUT column, in order, typed; NULL where this kind of row has none."""
    types = dict(part.strip().split(" ", 1) for part in fold.FOLD_INPUT_DDL.split(", "))
    have = set(frame.columns)
    return frame.select(*[(F.col(name) if name in have else F.lit(None)).cast(types[name]).alias(name)
                          for name in fold.FOLD_INPUT.names])


def create(spark: SparkSession, target: WalTarget, root: str, *,
           kafka_extra: Mapping[str, str] | None = None) -> tuple[snapshot.Manifest, bool]:
    """Build a new snapshot in `root`; returns it and True, or the newest existing one and
    False when no shard has anything new since its cut."""
    base = snapshot.newest(root, target.topic, target.shards)
    ends = wal_ends(target)
    check_range(target, base, ends)
    cuts = {s: stable for s, (_, stable) in ends.items()}
    if base is not None and all(base.shard(s).offset == cuts[s] for s in cuts):
        return base, False
    name = snapshot.new_name()
    uri = snapshot.snapshot_uri(root, name)
    started = time.monotonic()
    # Digest the base too (its keys and its request-id table): a snapshot built on a base that does
    # not reproduce its own manifest would carry the damage forward under fresh, self-consistent
    # digests (a base that lost its requests/ files would let retries inside the window apply twice).
    digest_at = {sh: [base.shard(sh).offset] for sh in range(target.shards)} if base else None
    states = build_states(spark, target, root, base, cuts, digest_at, kafka_extra=kafka_extra).persist()
    try:
        all_metas = states.where(F.col("kind") == "meta").collect()
        if base is not None:
            for m in all_metas:
                expected = base.shard(int(m["shard"]))
                if int(m["offset"]) != expected.offset:
                    continue
                why = snapshot.mismatch(expected, str(m["digest"]), int(m["keys"]), int(m["requests"]),
                                        str(m["requests_digest"]), int(m["evicted_through_ms"]),
                                        prepared=int(m["prepared"]), prepared_digest=str(m["prepared_digest"]),
                                        decided=int(m["decided"]), decided_digest=str(m["decided_digest"]))
                if why is not None:
                    raise SnapshotError(
                        f"the newest snapshot {base.name} does not reproduce its own manifest for shard {m['shard']} "
                        f"({why}): not building on it. Move it aside and run again (the next older one, or the "
                        "WAL, is then the base)")
                if not expected.requests_digest:
                    log.warning("snapshot %s (format %d) shard %s: no digest covers its request-id table, only its "
                                "count (%d): building on it; the new snapshot's table is covered", base.name,
                                base.format, m["shard"], expected.requests)
        metas = [m for m in all_metas if m["is_cut"]]
        (states.where(F.col("kind") == "key").select("shard", *snapshot.KEYS_SCHEMA.names)
         .write.partitionBy("shard").parquet(f"{uri}/keys"))
        (states.where(F.col("kind") == "request").select("shard", *snapshot.REQUESTS_SCHEMA.names)
         .write.partitionBy("shard").parquet(f"{uri}/requests"))
        (states.where(F.col("kind") == "prepared")
         .select("shard", F.col("request_id").alias("txn_id"), "revision", "leader_unix_ms",
                 F.col("response").alias("prepare"))
         .write.partitionBy("shard").parquet(f"{uri}/prepared"))
        (states.where(F.col("kind") == "decided")
         .select("shard", F.col("request_id").alias("txn_id"), "revision", "leader_unix_ms",
                 F.col("payload").alias("decision"), "response")
         .write.partitionBy("shard").parquet(f"{uri}/decided"))
    finally:
        states.unpersist()
    by_shard = {int(m["shard"]): m for m in metas}
    if sorted(by_shard) != list(range(target.shards)):
        raise SnapshotError(f"the job returned shards {sorted(by_shard)} of {target.shards}: not writing a manifest")
    manifest = snapshot.Manifest(
        name=name, topic=target.topic, shard_count=target.shards, created_unix_ms=int(time.time() * 1000),
        base=base.name if base else None, max_request_ids=MAX_REQUEST_IDS,
        request_id_horizon_ms=REQUEST_ID_HORIZON_MS,
        shards=tuple(snapshot.ShardSnapshot(shard=s, offset=int(m["offset"]), keys=int(m["keys"]),
                                            digest=str(m["digest"]), requests=int(m["requests"]),
                                            evicted_through_ms=int(m["evicted_through_ms"]),
                                            requests_digest=str(m["requests_digest"]), prepared=int(m["prepared"]),
                                            prepared_digest=str(m["prepared_digest"]), decided=int(m["decided"]),
                                            decided_digest=str(m["decided_digest"]))
                     for s, m in sorted(by_shard.items())))
    snapshot.write_manifest(root, manifest)
    log.info("snapshot %s: %d shards, %d keys, %.1fs", name, target.shards, sum(s.keys for s in manifest.shards),
             time.monotonic() - started)
    return manifest, True


def manifest_record(root: str, manifest: snapshot.Manifest) -> dict[str, Any]:
    return {"dir": snapshot.snapshot_uri(root, manifest.name), "name": manifest.name,
            "created_unix_ms": manifest.created_unix_ms, "base": manifest.base,
            "shards": [{"shard": s.shard, "offset": s.offset, "keys": s.keys, "digest": s.digest,
                        "requests": s.requests} for s in manifest.shards]}


def create_command(args: argparse.Namespace, target: WalTarget, printer: Printer) -> int:
    progress = stderr_progress("snapshot create")
    progress(f"starting Spark ({args.master or 'local[*]'})")
    spark = spark_for(args, "kvstore-snapshot")
    progress(f"snapshotting {target.shards} shard(s) of {target.topic} at their committed ends into {args.dir}")
    try:
        manifest, created = create(spark, target, args.dir)
    except snapshot.SnapshotFormatError as exc:
        raise SnapshotError(str(exc)) from exc
    progress("done")
    record = manifest_record(args.dir, manifest) | {"created": created}
    if printer.json:
        printer.record(record)
        return 0
    what = "created" if created else "nothing new since"
    printer.line(f"{what} {record['dir']}")
    printer.line(_table(manifest))
    return 0


def list_command(args: argparse.Namespace, target: object, printer: Printer) -> int:
    try:
        found = snapshot.list_snapshots(args.dir)
    except snapshot.SnapshotFormatError as exc:
        raise SnapshotError(str(exc)) from exc
    records = []
    for manifest, name in found:
        if manifest is None:
            print(f"kvstore: snapshot list: skipping {name}", file=sys.stderr)
            continue
        records.append(manifest_record(args.dir, manifest) | {"topic": manifest.topic})
    if printer.json:
        printer.record({"dir": args.dir, "snapshots": records})
        return 0
    if not records:
        printer.line(f"no snapshots in {args.dir}")
    for manifest, _ in found:
        if manifest is not None:
            printer.line(f"{manifest.name}  topic {manifest.topic}  base {manifest.base or '-'}")
            printer.line(_table(manifest))
    return 0


def _table(manifest: snapshot.Manifest) -> str:
    return format_table(("SHARD", "CUT", "KEYS", "REQUEST IDS", "DIGEST"),
                        [(s.shard, s.offset, s.keys, s.requests, s.digest[:16]) for s in manifest.shards])
