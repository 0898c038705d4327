"""The checks every run ends with: the WAL invariants, the client's guarantees, convergence.

Why an oracle: the final partition logs are the truth (docs/design.md §5: LevelDB is a cache of the
WAL). The oracle replays each log the way any reader must (read_committed, then W3 through
`wal.record.judge`, then `kvstore.core.request_window.MemoryShard`, whose apply is
`kvstore.core.state.apply_entries`) and every other check compares against it:

* **W1/W2** every batch a leader's guard reported committed sits in the log at the offsets it
  was reported at, committed, with the same payloads; and no record of the shard's own
  transactional producer was committed at an offset other than the one it expected;
* **W3/W5** every record any replica ever applied is an accepted record of the log at that
  offset (nothing applied before its commit, nothing aborted, nothing W3 rejects);
* **W4** the writer terms of accepted records never go back (one leadership after another);
* **W7 and the client** every acknowledged write is in the log, applied at the revision its
  answer named; every write reported as definitely failed is not; no request id was appended
  (and accepted) twice, nor applied twice (a retry let through after its id was forgotten);
  and the history is linearizable, per key;
* **convergence** once the faults stopped and everything caught up, every replica of a shard
  holds exactly the oracle's keys and request table, at the log's end.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

from kvstore.core.request_window import MemoryShard
from kvstore.core.sharding import shard_of
from kvstore.core.state import RequestRecord, decode_entry
from tests.sim import linearizability
from tests.sim.client import Kind, Operation, Outcome
from tests.sim.kafka import Broker, Partition
from tests.sim.node import Node
from tests.sim.world import Audit
from tests.sim.writer import TOPIC
from wal.clients import shard_transactional_id
from wal.record import Verdict, judge

FOREIGN_WRITER = "foreign"  # the writer id of records a foreign producer appends


@dataclasses.dataclass
class Oracle:
    """One shard's log replayed by the book."""

    accepted: dict[int, bytes]  # offset -> payload, every record W3 accepts
    store: MemoryShard
    applied: dict[str, RequestRecord]  # every request id ever applied, even if forgotten since
    request_ids: collections.Counter[str]  # request ids among accepted records
    violations: list[str]


def replay(shard: int, partition: Partition, producer_id: int | None, store: MemoryShard) -> Oracle:
    """Replay `partition` into `store` (empty, with the replicas' request-id bounds)."""
    accepted: dict[int, bytes] = {}
    records: list[tuple[int, bytes]] = []
    ids: collections.Counter[str] = collections.Counter()
    violations: list[str] = []
    previous_term = -1  # of the previous accepted record, as the Spark audit compares (one report per regression)
    for entry in partition.log:
        if entry.control or not entry.committed:
            continue
        verdict, record = judge(entry.offset, entry.value, entry.headers)
        if verdict is Verdict.MISMATCH and entry.pid == producer_id and producer_id is not None:
            violations.append(f"W2: shard {shard} offset {entry.offset}: a record of the shard's producer was "
                              f"committed where it did not expect to land")
        if verdict is not Verdict.ACCEPTED:
            continue
        assert record is not None
        accepted[entry.offset] = record.payload
        records.append((entry.offset, record.payload))
        if record.writer.id != FOREIGN_WRITER:
            if record.writer.term < previous_term:
                violations.append(f"W4: shard {shard} offset {entry.offset}: writer {record.writer.id} term "
                                  f"{record.writer.term} after term {previous_term}")
            previous_term = record.writer.term
        decoded = decode_entry(record.payload)
        if decoded is not None and decoded.request_id:
            ids[decoded.request_id] += 1
    applied: dict[str, RequestRecord] = {}
    for request in store.apply(records, partition.high_watermark).requests:
        if request.request_id in applied:
            violations.append(f"shard {shard}: request id {request.request_id} applied twice, at "
                              f"{applied[request.request_id].revision} and {request.revision}")
        applied[request.request_id] = request
    return Oracle(accepted, store, applied, ids, violations)


def check_run(broker: Broker, nodes: Sequence[Node], history: Sequence[Operation], audit: Audit,
              new_disk: Callable[[], MemoryShard], *, converged: bool) -> list[str]:
    """Every check that applies; the violations found (empty: the run is correct)."""
    shards = len(broker.partitions)
    violations: list[str] = []
    oracles: list[Oracle] = []
    for shard, partition in enumerate(broker.partitions):
        txn = broker.txns.get(shard_transactional_id(TOPIC, shard))
        oracle = replay(shard, partition, txn.pid if txn is not None else None, new_disk())
        oracles.append(oracle)
        violations += oracle.violations
        for request_id, count in sorted(oracle.request_ids.items()):
            if count > 1:
                violations.append(f"shard {shard}: request id {request_id} accepted {count} times in the WAL")

    for commit in audit.leader_commits:  # W1: where the leader's guard said its batch landed
        log = broker.partitions[commit.shard].log
        for offset, payload in zip(commit.offsets, commit.payloads, strict=True):
            entry = log[offset] if offset < len(log) else None
            if entry is None or entry.control or not entry.committed or oracles[commit.shard].accepted.get(offset) \
                    != payload:
                violations.append(f"W1: {commit.node} committed a record of shard {commit.shard} at offset {offset}, "
                                  f"but no accepted record with its payload is there")
                break

    for (name, shard), applied in sorted(audit.applied.items()):  # W3 + W5 at every replica
        accepted = oracles[shard].accepted
        for offset, payload in applied:
            if accepted.get(offset) != payload:
                violations.append(f"W3/W5: {name} applied a record at shard {shard} offset {offset} that the WAL "
                                  f"does not accept there")
                break

    for op in history:  # acknowledged writes, definite failures
        if op.kind is Kind.GET or not op.request_id:
            continue
        shard = shard_of(op.key, shards)
        applied_at = oracles[shard].applied.get(op.request_id)
        if op.outcome is Outcome.OK and op.revision is not None:
            if applied_at is None:
                violations.append(f"lost write: {linearizability.describe(op)} was acknowledged at revision "
                                  f"{op.revision} but is not in the WAL")
            elif applied_at.revision != op.revision:
                violations.append(f"{linearizability.describe(op)} answered revision {op.revision}, applied at "
                                  f"{applied_at.revision}")
        if op.outcome is Outcome.FAILED and applied_at is not None:
            violations.append(f"W7: {linearizability.describe(op)} was answered as definitely failed but the WAL "
                              f"applied it at {applied_at.revision}")

    by_key: dict[bytes, list[Operation]] = collections.defaultdict(list)
    for op in linearizability.relevant(history):
        by_key[op.key].append(op)
    for key in sorted(by_key):
        why = linearizability.check(sorted(by_key[key], key=lambda o: o.invoke))
        if why is not None:
            violations.append(f"not linearizable on key {key!r}: {why}")

    if converged:
        for shard, oracle in enumerate(oracles):
            end = broker.partitions[shard].high_watermark
            holders = [node for node in nodes if shard in node.stores]
            if not holders:
                violations.append(f"no node holds shard {shard} after healing")
            for node in holders:
                store, truth = node.stores[shard], oracle.store
                if (store.applied_offset, store.keys, store.requests, store.evicted_through_ms) != (
                        end, truth.keys, truth.requests, truth.evicted_through_ms):
                    violations.append(f"divergence: {node.name} shard {shard} at {store.applied_offset} "
                                      f"({len(store.keys)} keys) differs from the WAL's replay at {end} "
                                      f"({len(oracle.store.keys)} keys)")
    return violations
