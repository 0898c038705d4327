"""`kvstore wal truncate --dir DIR [--dry-run] [--force]`: drop WAL records nobody needs any more.

Per shard, records are deleted (Kafka DeleteRecords, `wal.delete_below`) below the smaller of
two bounds, and only after the newest complete snapshot was verified whole:

1. **The snapshot's cut minus one.** The snapshot plus the WAL from its cut is the whole history,
   so everything below the cut is redundant, except the one slot just below it, which is kept on
   purpose. Why: a leader that commits a batch whose last record is at `last` assumes its commit
   marker took `last + 1` without reading it; its replica records `m:unverified = last + 1` and
   the checkpoint `last + 2`, and on its next resign, rebalance, restart or aborted batch
   (`ShardStore.rewind_unverified`) moves the checkpoint back to `last + 1` to read that slot
   (docs/design.md §4, W2). On a quiet shard the cut is exactly that checkpoint. Deleting below the
   cut would put the rewound checkpoint below the log start: the replica would reload the whole
   snapshot for nothing (with `--snapshot-dir`) or refuse the shard for good (without), although
   its state was complete.
   Proof that one slot is enough: a replica's unverified slot is always its checkpoint - 1
   (`ShardStore.apply` asserts it). A replica whose checkpoint is >= the cut has its unverified
   slot >= cut - 1, still in the log. A replica whose checkpoint is below the cut needs the
   snapshot anyway (its next position is deleted whatever we keep). Readers that start at the
   cut are unaffected. The extra slot costs one offset: the marker, or a record the snapshot
   already folded (a reader from cut - 1 applies nothing twice: replay starts at its checkpoint).
2. **The oldest position of every registered reader** (`wal.readers`: each change feed, any
   reader that registers). A reader still needs everything from its position on; deleting it
   would lose it for good, so truncation stops there and names the reader. `--force` ignores the
   readers (and lists the ones it overrode, loudly: they will fail with a gap). A reader whose
   position is already below the log start lost its records before this run: it is reported as
   broken and holds nothing back (else one abandoned reader would block truncation forever);
   `kvstore wal readers remove NAME` deregisters it.

Before anything is deleted, every shard of the snapshot is loaded into a scratch replica and
checked against its manifest (`snapshot.verify_shard`: keys, digest, request ids): after the
deletion that snapshot is the only copy of the history below the cut. Any failure refuses the
whole run, names the shard and the reason, and deletes nothing. `--dry-run` verifies too.

A replica whose checkpoint falls below the new log start (a node that was down, a new node)
finds its position out of range and loads that snapshot by itself when it runs with
`--snapshot-dir DIR` (without it, it refuses to lead the shard and says why).

What is kept: everything from cut - 1 on (or from the oldest reader's position), the snapshot
directory, and older snapshots (remove those by hand; the newest is all a replica or the next
snapshot needs). Nothing here needs Spark.

Races: reader positions only move forward, so a registry read before the deletion is at worst
more careful than needed. A reader that registers for the first time while a truncation runs is
not seen by it: its start may be deleted under it, which it reports as a gap on its first batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvstore.output import Printer, format_table
from kvstore.pipeline.errors import PipelineError, SnapshotError
from kvstore.pipeline.target import WalTarget
from kvstore.storage import snapshot

if TYPE_CHECKING:
    from wal.readers import ReaderList


# ---- the decision (pure) -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Holder:
    """A reader that needs a shard's records from `position` on."""

    reader: str
    position: int


@dataclasses.dataclass(frozen=True)
class ShardDecision:
    shard: int
    log_start: int
    cut: int
    cut_allows: int  # what the snapshot alone allows: deleting below cut - 1 (`kept_below_cut`)
    delete_below: int  # what this run deletes below; <= log_start means nothing
    held_by: tuple[Holder, ...]  # readers below cut_allows that stopped it there, oldest first
    overridden: tuple[Holder, ...]  # with --force: those readers, deleted past
    broken: tuple[Holder, ...]  # readers whose position is below the log start: their records are gone

    @property
    def deletes(self) -> bool:
        return self.delete_below > self.log_start


def kept_below_cut(cut: int) -> int:
    """The first offset truncation keeps for a snapshot cut: the slot just below the cut, which
    on a quiet shard is the commit marker the leader assumed (module docstring, item 1)."""
    assert cut >= 0, cut
    return max(0, cut - 1)


def decide(shards: Mapping[int, tuple[int, int]], readers: Mapping[str, Mapping[int, int]], *,
           force: bool) -> list[ShardDecision]:
    """How far each shard may be deleted, and who holds it back.

    `shards`: shard -> (log start now, the snapshot's cut). `readers`: name -> (shard -> next
    offset it still needs); a shard a reader does not list it does not hold. Per shard the
    deletion goes below min(cut - 1, every reader position at or above the log start), or below
    cut - 1 with `force`. Never moves a log start back (DeleteRecords cannot either)."""
    out: list[ShardDecision] = []
    for shard, (log_start, cut) in sorted(shards.items()):
        assert log_start >= 0 and cut >= 0, (shard, log_start, cut)
        allows = kept_below_cut(cut)
        positions = sorted((position, name) for name, held in readers.items()
                           if (position := held.get(shard)) is not None)
        broken = tuple(Holder(name, p) for p, name in positions if p < log_start)
        behind = tuple(Holder(name, p) for p, name in positions if log_start <= p < allows)
        delete_below = allows if force or not behind else behind[0].position
        out.append(ShardDecision(shard, log_start, cut, allows, max(log_start, delete_below),
                                 held_by=() if force else behind, overridden=behind if force else (),
                                 broken=broken))
    return out


# ---- the shell -----------------------------------------------------------------------------------------


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


def verify(root: str, manifest: snapshot.Manifest, shards: int, *, scratch_dir: str | None = None,
           say: Callable[[str], None]) -> None:
    """Every shard of `manifest` recomputed from its files and checked against the manifest;
    SnapshotError naming the first shard that fails and why."""
    for shard in range(shards):
        meta = manifest.shard(shard)
        say(f"verifying snapshot {manifest.name} shard {shard}: {meta.keys} keys, {meta.requests} request ids")
        started = time.monotonic()
        try:
            snapshot.verify_shard(root, manifest, shard, scratch_dir=scratch_dir)
        except snapshot.SnapshotFormatError as exc:
            raise SnapshotError(f"snapshot {manifest.name} failed verification at shard {shard}: {exc}; "
                                "nothing was deleted (take a new snapshot)") from exc
        say(f"shard {shard}: verified in {time.monotonic() - started:.1f} s")


def registered_readers(target: WalTarget, timeout_s: float = 30.0) -> ReaderList:
    """Who still reads the WAL (`wal.readers`). PipelineError when the registry cannot be read."""
    from wal import ReaderRegistry, RegistryError

    with ReaderRegistry(target.bootstrap_servers, target.topic, security=target.security,
                        timeout_s=timeout_s) as registry:
        try:
            return registry.list()
        except RegistryError as exc:
            raise PipelineError(f"cannot read who still reads the WAL: {exc}") from exc


def _stderr(text: str) -> None:
    print(f"kvstore: wal truncate: {text}", file=sys.stderr, flush=True)


def truncate(target: WalTarget, root: str, *, dry_run: bool = False, force: bool = False,
             scratch_dir: str | None = None, notice: Callable[[str], None] | None = None) -> dict[str, Any]:
    from wal import UnavailableError, delete_below

    say = notice or _stderr
    manifest, ends = plan(target, root)
    verify(root, manifest, target.shards, scratch_dir=scratch_dir, say=say)
    try:
        registered = registered_readers(target)
    except PipelineError as exc:
        if not force:
            raise PipelineError(f"{exc}; nothing was deleted (--force deletes without asking)") from exc
        say(f"WARNING: --force: {exc}; deleting without knowing who still reads")
        from wal import ReaderList

        registered = ReaderList((), ())
    readers = registered.by_name()
    decisions = decide({s: (start, cut) for s, (start, _, cut) in ends.items()},
                       {name: r.positions for name, r in readers.items()}, force=force)
    for d in decisions:
        for h in d.overridden:
            say(f"WARNING: --force: shard {d.shard}: deleting below {d.delete_below} although reader {h.reader} "
                f"({readers[h.reader].kind}, {readers[h.reader].where}) still needs it from {h.position}: "
                "that reader will fail, its records are gone")
    for m in registered.malformed:
        say(f"WARNING: the readers registry has an unreadable record at offset {m.offset} (key {m.key!r}): "
            f"{m.why}; whatever reader wrote it holds nothing back")
    targets = {d.shard: d.delete_below for d in decisions if d.deletes}
    after: dict[int, int] = {}
    if targets and not dry_run:
        try:
            after = delete_below(target.bootstrap_servers, target.topic, targets, security=target.security)
        except UnavailableError as exc:
            raise PipelineError(f"{exc} (run it again: deleting below a cut is idempotent)") from exc
    shards = []
    for d in decisions:
        new_start = d.delete_below if dry_run else after.get(d.shard, d.log_start)
        assert new_start <= d.cut_allows or new_start == d.log_start, (
            f"shard {d.shard}: log start {new_start} above cut - 1 = {d.cut_allows}")

        def holders(hs: tuple[Holder, ...]) -> list[dict[str, Any]]:
            return [{"reader": h.reader, "position": h.position, "kind": readers[h.reader].kind,
                     "where": readers[h.reader].where} for h in hs]

        shards.append({"shard": d.shard, "log_start_before": d.log_start, "log_start_after": new_start,
                       "cut": d.cut, "cut_allows": d.cut_allows, "offsets_deleted": new_start - d.log_start,
                       "verified": True, "held_by": holders(d.held_by), "overridden": holders(d.overridden),
                       "broken_readers": holders(d.broken)})
    return {"snapshot": manifest.name, "dry_run": dry_run, "force": force, "shards": shards,
            "readers": sorted(readers),
            "malformed_readers": [{"offset": m.offset, "key": m.key, "why": m.why} for m in registered.malformed]}


def command(args: argparse.Namespace, target: WalTarget, printer: Printer) -> int:
    result = truncate(target, args.dir, dry_run=args.dry_run, force=args.force, scratch_dir=args.scratch_dir)
    if printer.json:
        printer.record(result)
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    printer.line(f"{target.topic}: {verb} the records below snapshot {result['snapshot']}'s cut - 1 "
                 "(verified), or below the oldest registered reader")
    printer.line(format_table(("SHARD", "CUT", "LOG START BEFORE", "LOG START AFTER", "OFFSETS DROPPED", "HELD BY"),
                              [(r["shard"], r["cut"], r["log_start_before"], r["log_start_after"],
                                r["offsets_deleted"], ", ".join(h["reader"] for h in r["held_by"]) or "-")
                               for r in result["shards"]]))
    for r in result["shards"]:
        for h in r["held_by"]:
            printer.line(f"shard {r['shard']}: reader {h['reader']} ({h['kind']}, {h['where']}) still needs it from "
                         f"{h['position']}; the snapshot alone would allow deleting below {r['cut_allows']}")
        for h in r["overridden"]:
            printer.line(f"shard {r['shard']}: --force deleted records reader {h['reader']} ({h['kind']}, "
                         f"{h['where']}) still needed from {h['position']}: it will fail")
        for h in r["broken_readers"]:
            printer.line(f"shard {r['shard']}: reader {h['reader']} ({h['kind']}, {h['where']}) is already broken: "
                         f"it needs {h['position']}, below the log start {r['log_start_before']}; remove it with "
                         f"`kvstore wal readers remove {h['reader']}`")
    return 0
