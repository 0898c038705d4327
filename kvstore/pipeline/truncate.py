"""`kvstore wal truncate --dir DIR [--dry-run]`: drop WAL records the newest snapshot makes redundant.

Per shard, every record below the newest complete snapshot's cut is deleted (Kafka
DeleteRecords, `wal.delete_below`), never one at or above it: the snapshot plus the WAL from its
cut is then the whole history. A replica whose checkpoint falls below the new log start (a node
that was down, a new node) finds its position out of range and loads that snapshot by itself
when it runs with `--snapshot-dir DIR` (without it, it refuses to lead the shard and says why).

What is kept: everything from the cut on, the snapshot directory, and older snapshots (remove
those by hand; the newest is all a replica or the next snapshot needs). Nothing here needs Spark.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstore.pipeline.commands import Printer
from kvstore.pipeline.errors import PipelineError, SnapshotError
from kvstore.pipeline.target import WalTarget
from kvstore.server import snapshot


def plan(target: WalTarget, root: str) -> tuple[snapshot.Manifest, dict[int, tuple[int, int, int]]]:
    """The newest snapshot and, per shard, (log start now, high watermark, the snapshot's cut).
    Refuses a snapshot whose cut lies beyond the partition's end: it cannot be of this WAL."""
    from confluent_kafka import KafkaException

    from wal.clients import PartitionEnds

    try:
        manifest = snapshot.newest(root, target.topic, target.shards)
    except snapshot.SnapshotFormatError as exc:
        raise SnapshotError(str(exc)) from exc
    if manifest is None:
        raise SnapshotError(f"no complete snapshot of {target.topic} ({target.shards} shards) in {root}: "
                            "run `kvstore snapshot create --dir` first; nothing was deleted")
    ends = PartitionEnds(target.bootstrap_servers, 30.0, target.security)
    out: dict[int, tuple[int, int, int]] = {}
    try:
        for shard in range(target.shards):
            start = ends.log_start(target.topic, shard)
            high = ends.high_watermark(target.topic, shard)
            cut = manifest.shard(shard).offset
            if cut > high:
                raise SnapshotError(f"shard {shard}: snapshot {manifest.name} ends at {cut}, beyond the WAL's end "
                                    f"{high}: it is not of this WAL (recreated topic?); nothing was deleted")
            out[shard] = (start, high, cut)
    except KafkaException as exc:
        raise PipelineError(f"cannot read the WAL's offsets ({target.topic}): {exc}") from exc
    return manifest, out


def truncate(target: WalTarget, root: str, *, dry_run: bool = False) -> dict[str, Any]:
    from wal import UnavailableError, delete_below

    manifest, ends = plan(target, root)
    targets = {s: cut for s, (start, _, cut) in ends.items() if cut > start}
    after: dict[int, int] = {}
    if targets and not dry_run:
        try:
            after = delete_below(target.bootstrap_servers, target.topic, targets, security=target.security)
        except UnavailableError as exc:
            raise PipelineError(f"{exc} (run it again: deleting below a cut is idempotent)") from exc
    shards = []
    for s, (start, _, cut) in sorted(ends.items()):
        new_start = after.get(s, start) if not dry_run else max(start, cut)
        assert new_start <= cut or new_start == start, f"shard {s}: log start {new_start} above the cut {cut}"
        shards.append({"shard": s, "log_start_before": start, "log_start_after": new_start, "cut": cut,
                       "offsets_deleted": new_start - start})
    return {"snapshot": manifest.name, "dry_run": dry_run, "shards": shards}


def command(args: argparse.Namespace, target: WalTarget, printer: Printer) -> int:
    result = truncate(target, args.dir, dry_run=args.dry_run)
    if printer.json:
        printer.record(result)
        return 0
    from kvstore.cli import format_table

    verb = "would delete" if args.dry_run else "deleted"
    printer.line(f"{target.topic}: {verb} the records below snapshot {result['snapshot']}'s cut")
    printer.line(format_table(("SHARD", "LOG START BEFORE", "LOG START AFTER", "OFFSETS DROPPED"),
                              [(r["shard"], r["log_start_before"], r["log_start_after"], r["offsets_deleted"])
                               for r in result["shards"]]))
    return 0
