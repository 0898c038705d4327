"""`kvstore audit --dir DIR`: is the WAL clean, does the newest snapshot follow from it, and does
every live replica hold the state the WAL says it should? Exit 1 on any anomaly.

What counts as an anomaly, and why a healthy cluster has none:

- *Rejected records* (W3 mismatch: landed elsewhere than they expected) and *malformed records*
  (not a WAL envelope). The store's own writer checks every delivered offset before it commits
  (W2) and aborts on a mismatch, and the audit reads read_committed, where aborted records never
  appear. So no committed record of the store's own writer can mismatch; one that does was
  written around the guard (a rogue or foreign producer, a writer without the shard's
  transactional id). W3 makes it harmless ("no effect"), but its writer must be found.
- *Malformed entries*: accepted records whose payload is not a WalEntry (same reasoning).
- *Writer terms going backwards* among accepted records in offset order: a leader's term is the
  partition end when it fenced in, plus one (`kvstore.server.replica`), so terms only grow across
  takeovers, and a fenced leader can no longer commit (W4).
- *Request ids accepted twice*: the store applies an id at most once (W7) and a leader checks its
  table before it appends, so the WAL should never carry an id twice; replay skips the second
  (counted by the fold as `duplicates_skipped`), but a leader that appended it misbehaved.
- *Transactions not atomic* (cross-shard transactions, docs/design.md §10): more than one decision
  for a transaction (T1); a committed transaction resolved differently at a participant, or
  resolved there without its prepare (its effects never applied); an aborted or undecided one
  applied somewhere (T2). Read from the accepted records of every shard with the apply rule's
  bookkeeping (`atomicity`). The coordinator shard (the lowest participant) applies its own part
  with a commit decision and resolves nothing; only a coordinator that prepared the transaction
  (a record of a release before the decision table) must resolve it too. A transaction decided
  but not yet resolved everywhere at the cut is in doubt, a note, not an anomaly (its resolvers
  finish it); so is a decision forgotten (`TxnForget`) before a participant's resolve is below
  the cut, since the cuts of two shards are not read at one instant.
- *Digests that differ*: the newest snapshot's manifest against the same state recomputed from
  its own base plus the WAL, and every replica (ClusterService.ShardDigest) against the WAL's state at
  that replica's checkpoint. Both sides run the same `ShardStore` code (`kvstore.pipeline.fold`),
  so a difference means a snapshot or a replica was altered or lost a write.

- *The placement log* (`<wal topic>.placement`, docs/design.md §9) is read and folded with the
  one apply every node uses (`kvstore.core.placement_log`): its epoch, controller, members and the
  records it skipped are reported (`placement`). Skipped records are a note, not an anomaly: any
  byte there may be hostile, and every node skipped them alike.
Not anomalies, but said (`notes`): a snapshot that cannot be recomputed because the WAL was
truncated above its base; a replica below the audit's start (the WAL before it is not folded) or
above its cut; a node that did not answer.

Order matters: replica digests are collected *before* the cut is taken, so every replica's
checkpoint is at or below the cut and its state can be computed by the same fold that reads up
to the cut (`digest_at`). A leader's checkpoint includes the commit marker's slot, which the
broker writes just after `commit_transaction` returns, so the last stable offset is re-read
(bounded) until it covers every replica.

Cost: one fold from the start (the newest snapshot's base, else offset 0) to the cut, and one
more read of the same range for the W3 statistics, which Spark computes without Python workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from confluent_kafka import KafkaException
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

import wal
from kvstore.output import Printer, format_table
from kvstore.pipeline import wal_source
from kvstore.pipeline.commands import spark_for, stderr_progress
from kvstore.pipeline.errors import SnapshotError
from kvstore.pipeline.session import ENTRY_UDF
from kvstore.pipeline.snapshot_job import build_states, check_range, wal_ends
from kvstore.pipeline.target import WalTarget
from kvstore.storage import snapshot

log = logging.getLogger(__name__)

OFFSETS_LIMIT = 100  # offsets listed per kind of finding per shard; the count is always complete
DUPLICATE_EXAMPLES = 10  # request ids listed per shard
CUT_WAIT_S = 10.0  # how long the last stable offset may take to cover every replica's checkpoint

# Kinds of per-record findings, as the statistics job names them.
MISMATCH = "mismatch"
MALFORMED = "malformed"
MALFORMED_ENTRY = "malformed_entry"
TERM_REGRESSION = "term_regression"


@dataclasses.dataclass(frozen=True)
class NodeDigest:
    """One replica of one shard, as its node answered `ClusterService.ShardDigest`."""

    node: str
    address: str
    shard: int
    applied_offset: int
    digest: str
    keys: int


class TxnRecord(NamedTuple):
    """One accepted record of a cross-shard transaction (the JVM decoder's `entry.txn`)."""

    shard: int
    offset: int
    kind: str  # prepare | decision | resolve | forget
    txn_id: str  # "" for a forget (it names its decisions in txn_ids)
    commit: bool
    succeeded: bool
    participants: tuple[int, ...]
    records: int  # how many of the four the entry holds (the apply rule skips it unless 1)
    effects: int = 0  # the entry's effects (a commit decision's are the coordinator's part)
    txn_ids: tuple[str, ...] = ()  # a forget's: the decisions it removes from its shard's table


class FoldPoint(NamedTuple):
    """The WAL's state at one offset, from the fold (`kvstore.pipeline.fold` meta rows); the
    counters are cumulative from the fold's start."""

    offset: int
    digest: str
    keys: int
    wal_records: int
    duplicates: int
    malformed_entries: int
    requests: int = 0  # the request-id table there: ids kept, its digest, forgotten through (ms)
    requests_digest: str = ""
    evicted_through_ms: int = 0
    prepared: int = 0  # cross-shard transactions prepared there, and their digest
    prepared_digest: str = ""
    decided: int = 0  # the decision table there, and its digest
    decided_digest: str = ""


@dataclasses.dataclass
class ShardStats:
    """W3 verdicts and per-record findings over [start, cut) of one shard."""

    accepted: int = 0
    rejected: int = 0
    malformed: int = 0
    malformed_entries: int = 0
    term_regressions: int = 0
    duplicate_request_ids: int = 0
    offsets: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # kind -> first OFFSETS_LIMIT
    duplicate_examples: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    txn_records: list[TxnRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Start:
    """Where the audit's fold starts: a snapshot's state at its cut, or the empty state at 0.

    `recompute`: whether the newest snapshot's state can be recomputed from this start (its own
    base, or offset 0); if not, `why_not` says per shard why, and the fold starts at the newest
    snapshot itself (so its files are still checked against its manifest)."""

    manifest: snapshot.Manifest | None
    recompute: bool
    why_not: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def offset(self, shard: int) -> int:
        return self.manifest.shard(shard).offset if self.manifest else 0

    def describe(self) -> str:
        return f"snapshot {self.manifest.name}" if self.manifest else "the empty state at offset 0"


# ---- planning (pure) ------------------------------------------------------------------------------


def plan_start(newest: snapshot.Manifest | None, base: snapshot.Manifest | None, base_problem: str | None,
               ends: Mapping[int, tuple[int, int]]) -> Start:
    """Choose the fold's start so that the newest snapshot can be recomputed if the WAL allows.

    Preference: the snapshot's own base (cheapest full check), then offset 0 with an empty state
    (the base is gone but the WAL is whole: replaying from 0 reaches the same state), else the
    newest snapshot itself. One start for every shard: the fold takes one base snapshot."""
    if newest is None:
        return Start(None, recompute=False)
    log_starts = {s: start for s, (start, _) in ends.items()}
    if base is not None and all(log_starts[s] <= base.shard(s).offset for s in log_starts):
        return Start(base, recompute=True)
    if all(start == 0 for start in log_starts.values()):
        return Start(None, recompute=True)
    if newest.base is None:
        source, base_offsets = "offset 0 (it has no base)", dict.fromkeys(log_starts, 0)
    elif base is None:
        source, base_offsets = (f"offset 0 (its base {newest.base} is unusable: {base_problem})",
                                dict.fromkeys(log_starts, 0))
    else:
        source, base_offsets = f"its base {base.name}", {s: base.shard(s).offset for s in log_starts}
    truncated = sorted(s for s, start in log_starts.items() if start > base_offsets[s])
    why: dict[int, str] = {}
    for s in sorted(log_starts):
        if s in truncated:
            why[s] = (f"not verifiable: snapshot {newest.name} cannot be recomputed from {source}: the WAL starts at "
                      f"{log_starts[s]} (truncated above {base_offsets[s]}), the records in between are gone")
        else:
            why[s] = (f"not recomputed: the audit folds every shard from one start, and the WAL of shard(s) "
                      f"{', '.join(map(str, truncated))} is truncated")
    return Start(newest, recompute=False, why_not=why)


def digest_points(shards: int, start: Start, newest: snapshot.Manifest | None, cuts: Mapping[int, int],
                  nodes: Sequence[NodeDigest]) -> dict[int, list[int]]:
    """Offsets at which the fold must digest: the start (to check a start snapshot's files), the
    newest snapshot's cut, and every comparable replica checkpoint."""
    points: dict[int, set[int]] = {s: {start.offset(s)} for s in range(shards)}
    for s in range(shards):
        if newest is not None:
            points[s].add(newest.shard(s).offset)
    for node in nodes:
        if start.offset(node.shard) <= node.applied_offset <= cuts[node.shard]:
            points[node.shard].add(node.applied_offset)
    return {s: sorted(p) for s, p in points.items()}


# ---- atomicity of cross-shard transactions (pure) ---------------------------------------------------------


def atomicity(records: Sequence[TxnRecord], prepared_at_start: Mapping[int, set[str]], *,
              from_zero: bool) -> tuple[list[str], list[str], dict[str, int]]:
    """(anomalies, notes, counts) of the transactions in `records` (every shard's, in any
    order), judged by the apply rule's bookkeeping (`kvstore.core.state.txn_record_rule`): a
    resolve applies only what its shard prepared, and each kind of record has its own branch (a
    kind this audit does not know is never taken for another). `prepared_at_start`: per shard,
    the transactions prepared in the state the audit starts from; `from_zero`: the audit reads
    every shard from offset 0 (else a decision may lie before its start: an undecided resolve is
    a note).

    Which participants must resolve a decision: every one but the coordinator (the lowest), which
    applied its part with the decision; the coordinator too only where it prepared the
    transaction (a record of a release before the decision table, whose coordinator prepared and
    resolved like any participant)."""
    anomalies: list[str] = []
    notes: list[str] = []
    decisions: dict[str, list[TxnRecord]] = {}
    resolves: dict[tuple[str, int], tuple[TxnRecord, bool]] = {}  # (txn, shard) -> the first resolve, applied?
    ever_prepared: set[tuple[str, int]] = {(t, s) for s, ids in prepared_at_start.items() for t in ids}
    forgotten: dict[str, TxnRecord] = {}  # txn -> the forget that removed its decision from its shard's table
    for shard in sorted({r.shard for r in records} | set(prepared_at_start)):
        prepared = set(prepared_at_start.get(shard, ()))
        resolved: set[str] = set()
        table: set[str] = set()  # this shard's decision table, as far as the audited range shows it
        for record in sorted((r for r in records if r.shard == shard), key=lambda r: r.offset):
            if record.records != 1:
                continue  # skipped by every replica (and by the fold, which counts it)
            if record.kind == "forget":
                if record.effects:
                    continue  # skipped by the rule
                for txn_id in record.txn_ids:
                    if txn_id in table:
                        table.discard(txn_id)
                        forgotten.setdefault(txn_id, record)
                continue
            if not record.txn_id:
                continue  # skipped by the rule
            if record.kind == "prepare":
                if record.txn_id not in resolved and not record.effects:
                    prepared.add(record.txn_id)
                    ever_prepared.add((record.txn_id, shard))
            elif record.kind == "decision":
                if (record.effects and not record.commit) or len(record.participants) < 2:
                    continue  # skipped by the rule
                decisions.setdefault(record.txn_id, []).append(record)
                table.add(record.txn_id)
            elif record.kind == "resolve" and (record.txn_id, shard) not in resolves:
                resolves[(record.txn_id, shard)] = (record, record.txn_id in prepared)
                prepared.discard(record.txn_id)
                resolved.add(record.txn_id)
            # else: a repeated resolve (a duplicate id: applies nothing), or a kind this release does
            # not know, which it never takes for another
    counts = {"decided": len(decisions), "committed": 0, "aborted": 0, "in_doubt": 0, "forgotten": 0}
    for txn_id, found in sorted(decisions.items()):
        decision = found[0]
        if len(found) > 1:
            anomalies.append(f"transaction {txn_id}: {len(found)} decisions (T1), at "
                             f"{[(r.shard, r.offset, r.commit) for r in found][:4]}")
        counts["committed" if decision.commit else "aborted"] += 1
        coordinator = decision.participants[0]
        unresolved = []
        for shard in decision.participants:
            if shard == coordinator and (txn_id, shard) not in ever_prepared:
                continue  # the coordinator's part was applied with the decision: nothing to resolve there
            entry = resolves.get((txn_id, shard))
            if entry is None:
                unresolved.append(shard)
                continue
            resolve, applied = entry
            if decision.commit and resolve.commit and not applied:
                anomalies.append(f"transaction {txn_id} committed, but shard {shard} resolved it at {resolve.offset} "
                                 "without its prepare: its effects were never applied there")
            elif decision.commit and (not resolve.commit or resolve.succeeded != decision.succeeded):
                anomalies.append(f"transaction {txn_id} committed ({'success' if decision.succeeded else 'failure'} "
                                 f"branch), shard {shard} resolved it at {resolve.offset} as "
                                 f"{'commit' if resolve.commit else 'abort'}")
            elif not decision.commit and resolve.commit and applied:
                anomalies.append(f"transaction {txn_id} was aborted, but shard {shard} applied it at {resolve.offset} "
                                 "(T2)")
        if unresolved:
            counts["in_doubt"] += 1
        forget = forgotten.get(txn_id)
        if forget is not None:
            counts["forgotten"] += 1
            if unresolved:
                notes.append(f"transaction {txn_id}: its decision was forgotten at shard {forget.shard} offset "
                             f"{forget.offset}, but shard(s) {unresolved} have no resolve of it by the cut (one "
                             "appended as the cut was taken, or a decision forgotten too early)")
    for (txn_id, shard), (resolve, applied) in sorted(resolves.items()):
        if txn_id in decisions or not (resolve.commit and applied):
            continue
        if from_zero:
            anomalies.append(f"shard {shard} applied transaction {txn_id} at {resolve.offset}, which has no decision "
                             "in any WAL (T2)")
        else:
            notes.append(f"shard {shard} applied transaction {txn_id} at {resolve.offset}; its decision is not in the "
                         "audited range (before its start)")
    if counts["in_doubt"]:
        notes.append(f"{counts['in_doubt']} transaction(s) decided but not resolved at every participant by the cut: "
                     "in doubt, their resolvers finish them")
    return anomalies, notes, counts


# ---- the report (pure) ----------------------------------------------------------------------------


def build_report(shards: int, newest: snapshot.Manifest | None, start: Start, cuts: Mapping[int, int],
                 folds: Mapping[int, Mapping[int, FoldPoint]], stats: Mapping[int, ShardStats],
                 nodes: Sequence[NodeDigest], notes: Sequence[str],
                 prepared_at_start: Mapping[int, set[str]] | None = None) -> dict[str, Any]:
    """The audit's result: every finding per shard, anomalies as sentences, `ok` iff none."""
    all_anomalies: list[str] = []
    all_notes = list(notes)
    if newest is None:
        all_notes.append("no snapshot: the WAL was audited from offset 0")
    shard_reports = []
    for s in range(shards):
        report, anomalies, shard_notes = _shard_report(s, newest, start, cuts[s], folds.get(s, {}),
                                                       stats.get(s, ShardStats()),
                                                       [n for n in nodes if n.shard == s])
        all_anomalies += anomalies
        all_notes += shard_notes
        shard_reports.append(report)
    txn_anomalies, txn_notes, txn_counts = atomicity(
        [r for s in range(shards) for r in stats.get(s, ShardStats()).txn_records], prepared_at_start or {},
        from_zero=start.manifest is None)
    all_anomalies += txn_anomalies
    all_notes += txn_notes
    return {
        "ok": not all_anomalies,
        "transactions": txn_counts,
        "cut": {str(s): cuts[s] for s in range(shards)},
        "start": {"from": start.manifest.name if start.manifest else None,
                  "offsets": {str(s): start.offset(s) for s in range(shards)}},
        "snapshot": newest.name if newest else None,
        "nodes": [{"node": node, "address": address} for node, address in sorted({(n.node, n.address) for n in nodes})],
        "anomalies": all_anomalies,
        "notes": all_notes,
        "shards": shard_reports,
    }


def _shard_report(s: int, newest: snapshot.Manifest | None, start: Start, cut: int, fold: Mapping[int, FoldPoint],
                  stats: ShardStats, nodes: Sequence[NodeDigest]) -> tuple[dict[str, Any], list[str], list[str]]:
    anomalies: list[str] = []
    notes: list[str] = []
    begin = start.offset(s)
    at_cut = fold.get(cut)
    if at_cut is None:
        anomalies.append(f"shard {s}: the fold returned no state at the cut {cut} (pipeline error)")

    def offsets(kind: str) -> list[int]:
        return stats.offsets.get(kind, [])

    if stats.rejected:
        anomalies.append(f"shard {s}: {stats.rejected} committed record(s) rejected by W3 (landed elsewhere than "
                         f"expected: written around the guard), first at {_first(offsets(MISMATCH))}")
    if stats.malformed:
        anomalies.append(f"shard {s}: {stats.malformed} malformed record(s) (not a WAL envelope), first at "
                         f"{_first(offsets(MALFORMED))}")
    if stats.malformed_entries:
        anomalies.append(f"shard {s}: {stats.malformed_entries} accepted record(s) whose payload is not a WalEntry, "
                         f"first at {_first(offsets(MALFORMED_ENTRY))}")
    if stats.term_regressions:
        anomalies.append(f"shard {s}: the writer term goes backwards {stats.term_regressions} time(s) among accepted "
                         f"records, first at {_first(offsets(TERM_REGRESSION))}")
    if stats.duplicate_request_ids:
        ids = ", ".join(repr(rid) for rid, _ in stats.duplicate_examples[:3])
        anomalies.append(f"shard {s}: {stats.duplicate_request_ids} request id(s) accepted more than once ({ids})")
    duplicates_skipped = at_cut.duplicates if at_cut else None
    if at_cut is not None:
        if at_cut.duplicates and not stats.duplicate_request_ids:
            anomalies.append(f"shard {s}: {at_cut.duplicates} accepted entr(y/ies) repeat a request id applied before "
                             f"offset {begin}")
        if (at_cut.wal_records, at_cut.malformed_entries) != (stats.accepted, stats.malformed_entries):
            anomalies.append(f"shard {s}: the fold saw {at_cut.wal_records} accepted records "
                             f"({at_cut.malformed_entries} malformed entries), the W3 statistics {stats.accepted} "
                             f"({stats.malformed_entries}) (pipeline error)")

    if start.manifest is not None:
        loaded = fold.get(begin)
        why = None if loaded is None else snapshot.mismatch(
            start.manifest.shard(s), loaded.digest, loaded.keys, loaded.requests, loaded.requests_digest,
            loaded.evicted_through_ms, prepared=loaded.prepared, prepared_digest=loaded.prepared_digest,
            decided=loaded.decided, decided_digest=loaded.decided_digest)
        if why is not None:
            anomalies.append(f"shard {s}: snapshot {start.manifest.name}'s files do not reproduce its manifest ({why})")

    digest_snapshot = digest_wal = None
    digest_wal_note = None
    snapshot_cut = None
    if newest is None:
        digest_wal_note = "no snapshot to compare"
    else:
        meta = newest.shard(s)
        snapshot_cut, digest_snapshot = meta.offset, meta.digest
        recomputed = fold.get(meta.offset)
        if not start.recompute:
            digest_wal_note = start.why_not.get(s, "not verifiable")
            notes.append(f"shard {s}: snapshot digest {digest_wal_note}")
        elif recomputed is None:
            anomalies.append(f"shard {s}: the fold returned no state at snapshot {newest.name}'s cut {meta.offset} "
                             "(pipeline error)")
        else:
            digest_wal = recomputed.digest
            digest_wal_note = f"recomputed from {start.describe()} plus the WAL to {meta.offset}"
            why = snapshot.mismatch(meta, recomputed.digest, recomputed.keys, recomputed.requests,
                                    recomputed.requests_digest, recomputed.evicted_through_ms,
                                    prepared=recomputed.prepared, prepared_digest=recomputed.prepared_digest,
                                    decided=recomputed.decided, decided_digest=recomputed.decided_digest)
            if why is not None:
                anomalies.append(f"shard {s}: snapshot {newest.name} differs from the WAL at its cut {meta.offset}: "
                                 f"recomputed {why}")

    node_entries = []
    for node in sorted(nodes, key=lambda n: (n.node, n.address)):
        entry: dict[str, Any] = {"node": node.node, "address": node.address, "applied_offset": node.applied_offset,
                                 "digest": node.digest, "keys": node.keys, "expected": None, "expected_keys": None,
                                 "equal": None, "note": None}
        point = fold.get(node.applied_offset)
        if node.applied_offset < begin:
            entry["note"] = f"below the audit's start {begin} ({start.describe()}): cannot be compared"
        elif node.applied_offset > cut:
            entry["note"] = f"above the cut {cut} (the last stable offset did not reach it): cannot be compared"
        elif point is None:
            anomalies.append(f"shard {s}: the fold returned no state at node {node.node}'s offset "
                             f"{node.applied_offset} (pipeline error)")
        else:
            equal = (point.digest, point.keys) == (node.digest, node.keys)
            entry.update(expected=point.digest, expected_keys=point.keys, equal=equal)
            if not equal:
                anomalies.append(f"shard {s}: node {node.node} ({node.address}) at offset {node.applied_offset} has "
                                 f"digest {node.digest[:12]} ({node.keys} keys); the WAL there gives "
                                 f"{point.digest[:12]} ({point.keys} keys)")
        if entry["note"]:
            notes.append(f"shard {s}: node {node.node} at {node.applied_offset}: {entry['note']}")
        node_entries.append(entry)

    report = {
        "shard": s, "start": begin, "cut": cut,
        "accepted": stats.accepted, "rejected": stats.rejected, "rejected_offsets": offsets(MISMATCH),
        "malformed": stats.malformed, "malformed_offsets": offsets(MALFORMED),
        "malformed_entries": stats.malformed_entries, "malformed_entry_offsets": offsets(MALFORMED_ENTRY),
        "term_regressions": stats.term_regressions, "term_regression_offsets": offsets(TERM_REGRESSION),
        "duplicate_request_ids": stats.duplicate_request_ids,
        "duplicate_request_id_examples": [{"request_id": rid, "offsets": offs}
                                          for rid, offs in stats.duplicate_examples],
        "duplicates_skipped": duplicates_skipped,
        "digest_cut": at_cut.digest if at_cut else None, "keys_cut": at_cut.keys if at_cut else None,
        "snapshot_cut": snapshot_cut, "digest_snapshot": digest_snapshot, "digest_wal": digest_wal,
        "digest_wal_note": digest_wal_note,
        "digest_nodes": node_entries,
        "anomalies": anomalies,
    }
    return report, anomalies, notes


def _first(offsets: Sequence[int]) -> str:
    return str(offsets[0]) if offsets else "?"


# ---- gathering ------------------------------------------------------------------------------------


def node_digests(endpoints: Sequence[str], target: WalTarget, timeout_s: float) -> tuple[list[NodeDigest], list[str]]:
    """Every answering node's digest of every shard, and notes on what could not be asked.

    Nodes come from the cluster's shard map (every node that answered the fan-out). A node that
    serves another topic is not asked: its state is not this WAL's."""
    import grpc

    from kvstore.client import Client, KvError
    from kvstore.client.security import open_channel
    from kvstore.v1 import cluster_pb2, cluster_pb2_grpc

    notes: list[str] = []
    try:
        with Client(list(endpoints), timeout_s=timeout_s) as client:
            smap = client.shard_map(timeout_s=timeout_s)
    except KvError as exc:
        return [], [f"no node answered at {', '.join(endpoints)} ({type(exc).__name__}): no replica was compared"]
    if smap.topic != target.topic or smap.shard_count != target.shards:
        return [], [f"the nodes at {', '.join(endpoints)} serve {smap.topic} ({smap.shard_count} shards), not "
                    f"{target.topic} ({target.shards} shards): no replica was compared"]
    nodes = [(n.node_id, n.address) for n in smap.nodes] or [("", e) for e in endpoints]
    out: list[NodeDigest] = []
    for node_id, address in nodes:
        with open_channel(address) as channel:  # TLS and credentials from the KVSTORE_* environment
            stub = cluster_pb2_grpc.ClusterServiceStub(channel)  # type: ignore[no-untyped-call]
            for shard in range(target.shards):
                try:
                    reply = stub.ShardDigest(cluster_pb2.ShardDigestRequest(shard=shard), timeout=timeout_s)
                except grpc.RpcError as exc:
                    notes.append(f"node {node_id or address} ({address}) did not answer ShardDigest for shard {shard} "
                                 f"({exc.code().name}): its replicas were not compared")
                    break
                out.append(NodeDigest(reply.node_id or node_id or address, address, shard, reply.applied_offset,
                                      reply.sha256, reply.keys))
    return out, notes


def ends_covering(target: WalTarget, nodes: Sequence[NodeDigest],
                  wait_s: float = CUT_WAIT_S) -> dict[int, tuple[int, int]]:
    """The WAL's (log start, last stable offset) per shard, re-read until every replica's
    checkpoint is at or below the last stable offset, or `wait_s` passed (then those replicas
    are reported as above the cut)."""
    deadline = time.monotonic() + wait_s
    highest: dict[int, int] = {}
    for node in nodes:
        highest[node.shard] = max(highest.get(node.shard, 0), node.applied_offset)
    while True:
        ends = wal_ends(target)
        behind = {s for s, offset in highest.items() if offset > ends[s][1]}
        if not behind or time.monotonic() >= deadline:
            return ends
        time.sleep(0.2)


def fold_points(spark: SparkSession, target: WalTarget, root: str, start: Start, cuts: Mapping[int, int],
                points: Mapping[int, Sequence[int]], *,
                kafka_extra: Mapping[str, str] | None = None) -> dict[int, dict[int, FoldPoint]]:
    """The WAL's state digested at `points`, folded from `start` to `cuts` by the replicas' code."""
    states = build_states(spark, target, root, start.manifest, cuts, points, kafka_extra=kafka_extra,
                          emit_state=False)
    rows = (states.where(F.col("kind") == "meta")
            .select("shard", "offset", "digest", "keys", "wal_records", "duplicates", "malformed_entries",
                    "requests", "requests_digest", "evicted_through_ms", "prepared", "prepared_digest", "decided",
                    "decided_digest")
            .collect())
    out: dict[int, dict[int, FoldPoint]] = {s: {} for s in range(target.shards)}
    for row in rows:
        out[int(row["shard"])][int(row["offset"])] = FoldPoint(
            int(row["offset"]), str(row["digest"]), int(row["keys"]), int(row["wal_records"]),
            int(row["duplicates"]), int(row["malformed_entries"]), int(row["requests"]), str(row["requests_digest"]),
            int(row["evicted_through_ms"]), int(row["prepared"]), str(row["prepared_digest"]), int(row["decided"]),
            str(row["decided_digest"]))
    return out


def slim_records(judged: DataFrame) -> DataFrame:
    """What the statistics need of each record: no payloads, the entry's request id only."""
    is_accepted = F.col("verdict") == wal_source.ACCEPTED
    with_entry = judged.select(
        "shard", "offset", "verdict", "writer_term",
        F.when(is_accepted, F.call_function(ENTRY_UDF, F.col("payload"))).alias("entry"))
    return with_entry.select(
        "shard", "offset", "verdict", "writer_term",
        (is_accepted & F.col("entry").isNull()).alias("bad_entry"),
        F.col("entry")["request_id"].alias("request_id"),
        F.col("entry")["txn"].alias("txn"),
        F.when(F.col("entry")["txn"].isNotNull(), F.size(F.col("entry")["effects"])).alias("effects"))


def findings(slim: DataFrame, limit: int = OFFSETS_LIMIT) -> DataFrame:
    """Per-record findings (shard, kind, offset) with each kind's total, the first `limit` of
    each kind per shard. Term regressions compare each accepted record with the previous
    accepted one: a single rogue term shows once, not at every record after it."""
    by_offset = Window.partitionBy("shard").orderBy("offset")
    accepted = slim.where(F.col("verdict") == wal_source.ACCEPTED)
    regressions = (accepted.withColumn("previous_term", F.lag("writer_term").over(by_offset))
                   .where(F.col("writer_term") < F.col("previous_term"))
                   .select("shard", F.lit(TERM_REGRESSION).alias("kind"), "offset"))
    rejected = slim.where(F.col("verdict") != wal_source.ACCEPTED).select(
        "shard",
        F.when(F.col("verdict") == wal_source.MISMATCH, F.lit(MISMATCH)).otherwise(F.lit(MALFORMED)).alias("kind"),
        "offset")
    bad_entries = slim.where(F.col("bad_entry")).select("shard", F.lit(MALFORMED_ENTRY).alias("kind"), "offset")
    events = rejected.unionByName(bad_entries).unionByName(regressions)
    per_kind = Window.partitionBy("shard", "kind")
    return (events.withColumn("n", F.row_number().over(per_kind.orderBy("offset")))
            .withColumn("total", F.count(F.lit(1)).over(per_kind))
            .where(F.col("n") <= limit))


def duplicate_ids(slim: DataFrame, limit: int = DUPLICATE_EXAMPLES) -> DataFrame:
    """Request ids on more than one accepted record: per shard the total and the first `limit`
    (by first offset) with their offsets."""
    with_id = slim.where((F.col("verdict") == wal_source.ACCEPTED) & (F.coalesce(F.col("request_id"), F.lit("")) != ""))
    repeated = (with_id.groupBy("shard", "request_id")
                .agg(F.count(F.lit(1)).alias("times"), F.sort_array(F.collect_list("offset")).alias("offsets"))
                .where(F.col("times") > 1))
    per_shard = Window.partitionBy("shard")
    return (repeated.withColumn("n", F.row_number().over(per_shard.orderBy(F.col("offsets")[0])))
            .withColumn("total", F.count(F.lit(1)).over(per_shard))
            .where(F.col("n") <= limit)
            .select("shard", "request_id", F.slice("offsets", 1, limit).alias("offsets"), "total", "n"))


def wal_stats(spark: SparkSession, target: WalTarget, ranges: Mapping[int, tuple[int, int]], *,
              kafka_extra: Mapping[str, str] | None = None) -> dict[int, ShardStats]:
    """W3 verdicts and findings per shard over `ranges` ([start, cut)), in SQL (no Python worker)."""
    out = {s: ShardStats() for s in range(target.shards)}
    ranges = {s: r for s, r in ranges.items() if r[1] > r[0]}
    if not ranges:
        return out
    raw = wal_source.read_wal(spark, target.bootstrap_servers, target.topic, ranges, kafka_extra=kafka_extra,
                              security=target.security)
    # Three queries over the same records: keep the slim rows rather than read Kafka three times.
    slim = slim_records(wal_source.judged(raw)).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        verdict = F.col("verdict")
        counts = slim.groupBy("shard").agg(
            F.count_if(verdict == wal_source.ACCEPTED).alias("accepted"),
            F.count_if(verdict == wal_source.MISMATCH).alias("rejected"),
            F.count_if(verdict == wal_source.MALFORMED).alias("malformed"),
            F.count_if(F.col("bad_entry")).alias("malformed_entries")).collect()
        for row in counts:
            stats = out[int(row["shard"])]
            stats.accepted, stats.rejected = int(row["accepted"]), int(row["rejected"])
            stats.malformed, stats.malformed_entries = int(row["malformed"]), int(row["malformed_entries"])
        for row in findings(slim).orderBy("shard", "kind", "offset").collect():
            stats = out[int(row["shard"])]
            stats.offsets.setdefault(str(row["kind"]), []).append(int(row["offset"]))
            if row["kind"] == TERM_REGRESSION:
                stats.term_regressions = int(row["total"])
        for row in duplicate_ids(slim).orderBy("shard", "n").collect():
            stats = out[int(row["shard"])]
            stats.duplicate_request_ids = int(row["total"])
            stats.duplicate_examples.append((str(row["request_id"]), [int(o) for o in row["offsets"]]))
        # Cross-shard transactions' records: a few per transaction and shard, few next to the WAL.
        txn = F.col("txn")
        for row in (slim.where((F.col("verdict") == wal_source.ACCEPTED) & txn.isNotNull())
                    .select("shard", "offset", txn["kind"].alias("kind"), txn["txn_id"].alias("txn_id"),
                            txn["commit"].alias("commit"), txn["succeeded"].alias("succeeded"),
                            txn["participants"].alias("participants"), txn["records"].alias("records"),
                            "effects", txn["txn_ids"].alias("txn_ids"))
                    .collect()):
            out[int(row["shard"])].txn_records.append(TxnRecord(
                int(row["shard"]), int(row["offset"]), str(row["kind"]), str(row["txn_id"] or ""),
                bool(row["commit"]), bool(row["succeeded"]), tuple(int(p) for p in row["participants"] or ()),
                int(row["records"] or 0), int(row["effects"] or 0), tuple(str(t) for t in row["txn_ids"] or ())))
    finally:
        slim.unpersist()
    return out


def _base_of(root: str, newest: snapshot.Manifest | None) -> tuple[snapshot.Manifest | None, str | None]:
    """The newest snapshot's base, or None and why it cannot be used."""
    if newest is None or newest.base is None:
        return None, None
    try:
        base = snapshot.read_manifest(root, newest.base)
    except snapshot.SnapshotFormatError as exc:
        return None, str(exc)
    if (base.topic, base.shard_count) != (newest.topic, newest.shard_count):
        return None, f"{base.name} is of {base.topic} with {base.shard_count} shards"
    return base, None


def audit(spark: SparkSession, target: WalTarget, root: str, endpoints: Sequence[str], timeout_s: float, *,
          kafka_extra: Mapping[str, str] | None = None, cut_wait_s: float = CUT_WAIT_S,
          progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run the audit; the report of `build_report`. Raises PipelineError when the WAL cannot be
    audited at all (truncated with no snapshot covering the gap, or behind the snapshot).
    `progress` hears each phase as it starts (the command prints them on stderr)."""
    started = time.monotonic()
    progress(f"asking {len(endpoints)} node(s) for their replicas' digests")
    try:
        newest = snapshot.newest(root, target.topic, target.shards)
    except snapshot.SnapshotFormatError as exc:
        raise SnapshotError(str(exc)) from exc
    base, base_problem = _base_of(root, newest)
    nodes, notes = node_digests(endpoints, target, timeout_s)  # before the cut: see the module's docstring
    ends = ends_covering(target, nodes, cut_wait_s)
    check_range(target, newest, ends)
    start = plan_start(newest, base, base_problem, ends)
    if start.manifest is not None and start.manifest is not newest:
        check_range(target, start.manifest, ends)
    cuts = {s: stable for s, (_, stable) in ends.items()}
    points = digest_points(target.shards, start, newest, cuts, nodes)
    origin = start.manifest.name if start.manifest else "offset 0"
    progress(f"folding {target.shards} shard(s) of {target.topic} from {origin} to their stable ends (Spark)")
    folds = fold_points(spark, target, root, start, cuts, points, kafka_extra=kafka_extra)
    progress("judging every record (W3), request ids and transactions")
    stats = wal_stats(spark, target, {s: (start.offset(s), cuts[s]) for s in range(target.shards)},
                      kafka_extra=kafka_extra)
    prepared_at_start = ({s: {p.txn_id for p in snapshot.prepared(root, start.manifest.name, s)}
                          for s in range(target.shards)} if start.manifest is not None else {})
    report = build_report(target.shards, newest, start, cuts, folds, stats, nodes, notes, prepared_at_start)
    progress("reading the placement log")
    report["placement"], placement_notes = placement_summary(target, timeout_s)
    report["notes"] += placement_notes
    log.info("audit of %s: %s in %.1fs", target.topic, "ok" if report["ok"] else "ANOMALIES",
             time.monotonic() - started)
    return report


def placement_summary(target: WalTarget, timeout_s: float) -> tuple[dict[str, Any] | None, list[str]]:
    """The placement log folded as every node folds it: a summary, and notes (None and a note if
    it cannot be read: a cluster of a release before the log, or no rights to read it)."""
    from kvstore.core.placement_log import PlacementState
    from wal.topic import placement_topic

    topic = placement_topic(target.topic)
    state = PlacementState()
    try:
        with wal.Replayer(target.bootstrap_servers, topic, 0, 0, security=target.security) as replayer:
            for record in replayer.read_to_end(timeout_s):
                state.apply(record.offset, record.payload)
    except (wal.WalError, KafkaException) as exc:
        return None, [f"placement log {topic} not read: {exc}"]
    notes = []
    if state.skipped:
        notes.append(f"placement log {topic}: {sum(state.skipped.values())} records skipped by every reader "
                     f"({', '.join(f'{why}: {n}' for why, n in sorted(state.skipped.items()))})")
    copies = {str(shard): {node: held.value for node, held in sorted(held_by.items())}
              for shard, held_by in sorted(state.copies.items()) if held_by}
    return {"topic": topic, "records": state.applied, "epoch": state.epoch,
            "controller": state.controller.node_id if state.controller else None,
            "members": sorted(state.nodes), "drained": sorted(state.drained), "copies": copies,
            "targets": {str(s): list(t) for s, t in enumerate(state.targets())},
            "skipped": dict(state.skipped)}, notes


def command(args: argparse.Namespace, target: WalTarget, printer: Printer) -> int:
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    progress = stderr_progress("audit")
    progress(f"starting Spark ({args.master or 'local[*]'})")
    spark = spark_for(args, "kvstore-audit")
    try:
        report = audit(spark, target, args.dir, endpoints, args.timeout, progress=progress)
    except snapshot.SnapshotFormatError as exc:
        raise SnapshotError(str(exc)) from exc
    if printer.json:
        printer.record(report)
    else:
        printer.line(render(report))
    return 0 if report["ok"] else 1


def render(report: Mapping[str, Any]) -> str:
    """The report for people: one table of the WAL, one of the replicas, then the findings."""
    lines = [f"audit from {report['start']['from'] or 'offset 0'} to the last stable offsets; "
             f"newest snapshot: {report['snapshot'] or '(none)'}"]

    def short(digest: str | None) -> str:
        return digest[:12] if digest else "-"

    rows = []
    for s in report["shards"]:
        if s["digest_snapshot"] is None:
            snap = "-"
        elif s["digest_wal"] is None:
            snap = "not verifiable"
        else:
            snap = "equal" if s["digest_wal"] == s["digest_snapshot"] else "DIFFERENT"
        rows.append((s["shard"], s["start"], s["cut"], s["accepted"], s["rejected"], s["malformed"],
                     s["malformed_entries"], s["term_regressions"], s["duplicate_request_ids"], short(s["digest_cut"]),
                     snap))
    lines.append(format_table(("SHARD", "START", "CUT", "ACCEPTED", "REJECTED", "MALFORMED", "BAD ENTRIES",
                               "TERM BACK", "DUP IDS", "DIGEST AT CUT", "SNAPSHOT"), rows))
    node_rows = []
    for s in report["shards"]:
        for n in s["digest_nodes"]:
            verdict = "-" if n["equal"] is None else ("equal" if n["equal"] else "DIFFERENT")
            node_rows.append((n["node"], s["shard"], n["applied_offset"], short(n["digest"]), short(n["expected"]),
                              verdict))
    if node_rows:
        lines.append("")
        lines.append(format_table(("NODE", "SHARD", "APPLIED", "DIGEST", "WAL AT APPLIED", "REPLICA"), node_rows))
    for s in report["shards"]:
        for kind, key in (("rejected", "rejected_offsets"), ("malformed", "malformed_offsets"),
                          ("malformed entries", "malformed_entry_offsets"),
                          ("term regressions", "term_regression_offsets")):
            if s[key]:
                lines.append(f"shard {s['shard']} {kind} at: {', '.join(map(str, s[key]))}")
    txns = report.get("transactions") or {}
    if txns.get("decided"):
        lines.append(f"cross-shard transactions decided: {txns['decided']} ({txns['committed']} committed, "
                     f"{txns['aborted']} aborted, {txns['in_doubt']} in doubt at the cut, "
                     f"{txns.get('forgotten', 0)} forgotten by their coordinator)")
    placement = report.get("placement")
    if placement is not None:
        lines.append(f"placement log: {placement['records']} records, epoch {placement['epoch']}, controller "
                     f"{placement['controller'] or '-'}, members {', '.join(placement['members']) or '-'}"
                     + (f", drained {', '.join(placement['drained'])}" if placement["drained"] else ""))
    lines += [f"note: {n}" for n in report["notes"]]
    lines += [f"ANOMALY: {a}" for a in report["anomalies"]]
    count = len(report["anomalies"])
    lines.append("ok" if report["ok"] else f"{count} anomal{'y' if count == 1 else 'ies'}")
    return "\n".join(lines)

