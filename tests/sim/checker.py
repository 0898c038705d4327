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
  holds exactly the oracle's keys and request table, at the log's end;
* **cross-shard transactions** (`check_txns`, docs/design.md §10) T1: at most one decision record
  per transaction; T2 and atomicity: a committed transaction is applied in every participant
  (which prepared it) with the decided branch, an aborted or undecided one in none; T3: nothing
  stays prepared once the run healed; T5: no client request committed twice; and the bank's
  answers: every sum a read-only Txn saw is 0, every acknowledged transfer committed, none
  reported failed did, and the accounts sum to 0 at the end;
* **strict serializability** of the bank's acknowledged Txns (`check_serializable`): each says
  which version of each account it read and wrote, which orders it on that account; those
  orders and real time (an operation answered before another was invoked comes first) must
  admit one total order, i.e. form no cycle.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

from kvstore.core.entries import decode_entry
from kvstore.core.request_window import MemoryShard
from kvstore.core.sharding import shard_of
from kvstore.core.state import TXN_ID_PREFIX, RequestRecord
from kvstore.internal.v1 import wal_entry_pb2
from tests.sim import linearizability
from tests.sim.bank import BankKind, BankOp, balance
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


def _resolve_id(request_id: str) -> bool:
    """A resolve's id may be appended again once the request-id table forgot it (a finisher
    resolving a decision again, after a leader's fast clock made the table forget early): a
    resolve is never refused as expired (a participant must always be able to resolve, T3), and
    a second one finds nothing prepared and applies nothing (an orphan). What a resolve applies is
    held by the atomicity checks and the bank's sums, not by its id."""
    return request_id.startswith(f"{TXN_ID_PREFIX}r/")


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
        if request.request_id in applied and not _resolve_id(request.request_id):
            violations.append(f"shard {shard}: request id {request.request_id} applied twice, at "
                              f"{applied[request.request_id].revision} and {request.revision}")
        applied[request.request_id] = request
    return Oracle(accepted, store, applied, ids, violations)


def check_run(broker: Broker, nodes: Sequence[Node], history: Sequence[Operation], audit: Audit,
              new_disk: Callable[[], MemoryShard], *, converged: bool, bank: Sequence[BankOp] = (),
              accounts: Sequence[bytes] = (), keeps_decisions: bool = True, shards: int | None = None) -> list[str]:
    """Every check that applies; the violations found (empty: the run is correct). `shards`: the
    shards' partitions are the first so many (the placement log's comes after them)."""
    shards = len(broker.partitions) if shards is None else shards
    violations: list[str] = []
    oracles: list[Oracle] = []
    for shard, partition in enumerate(broker.partitions[:shards]):
        txn = broker.txns.get(shard_transactional_id(TOPIC, shard))
        oracle = replay(shard, partition, txn.pid if txn is not None else None, new_disk())
        oracles.append(oracle)
        violations += oracle.violations
        for request_id, count in sorted(oracle.request_ids.items()):
            if count > 1 and not _resolve_id(request_id):
                violations.append(f"shard {shard}: request id {request_id} accepted {count} times in the WAL")

    for commit in audit.leader_commits:  # W1: where the leader's guard said its batch landed
        if commit.shard >= shards:
            continue  # the placement log's (tests.sim.placement_checker)
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

    violations += check_txns(oracles, bank, accounts, converged=converged, keeps_decisions=keeps_decisions)

    if converged:
        for shard, oracle in enumerate(oracles):
            end = broker.partitions[shard].high_watermark
            holders = [node for node in nodes if shard in node.stores]
            if not holders:
                violations.append(f"no node holds shard {shard} after healing")
            for node in holders:
                store, truth = node.stores[shard], oracle.store
                if (store.applied_offset, store.keys, store.requests, store.evicted_through_ms,
                        sorted(p.txn_id for p in store.locks.prepared()), store.decisions) != (
                        end, truth.keys, truth.requests, truth.evicted_through_ms,
                        sorted(p.txn_id for p in truth.locks.prepared()), truth.decisions):
                    violations.append(f"divergence: {node.name} shard {shard} at {store.applied_offset} "
                                      f"({len(store.keys)} keys) differs from the WAL's replay at {end} "
                                      f"({len(oracle.store.keys)} keys)")
    return violations


@dataclasses.dataclass
class _Resolved:
    commit: bool
    succeeded: bool
    applied: bool  # the transaction was prepared there when its resolve was applied


def check_txns(oracles: Sequence[Oracle], bank: Sequence[BankOp], accounts: Sequence[bytes], *,
               converged: bool, keeps_decisions: bool = True) -> list[str]:
    """T1, T2 and atomicity, T3, T5, and the bank's answers, from the WALs (the module docstring)."""
    violations: list[str] = []
    decisions: dict[str, list[tuple[int, int, wal_entry_pb2.TxnDecision]]] = collections.defaultdict(list)
    resolves: dict[str, dict[int, _Resolved]] = collections.defaultdict(dict)
    for shard, oracle in enumerate(oracles):
        prepared: set[str] = set()
        for offset in sorted(oracle.accepted):
            entry = decode_entry(oracle.accepted[offset])
            if entry is None:
                continue
            if entry.HasField("prepare"):
                prepared.add(entry.prepare.txn_id)
            elif entry.HasField("decision"):
                decisions[entry.decision.txn_id].append((shard, offset, entry.decision))
            elif entry.HasField("resolve") and shard not in resolves[entry.resolve.txn_id]:
                txn_id = entry.resolve.txn_id
                resolves[txn_id][shard] = _Resolved(entry.resolve.commit, entry.resolve.succeeded, txn_id in prepared)
                prepared.discard(txn_id)
    for txn_id, records in sorted(decisions.items()):
        if len(records) > 1:
            violations.append(f"T1: transaction {txn_id} has {len(records)} decision records: "
                              f"{[(s, o, d.commit) for s, o, d in records]}")
        _, _, decision = records[0]
        for shard, resolved in sorted(resolves.get(txn_id, {}).items()):
            if decision.commit and resolved.commit and not resolved.applied:
                violations.append(f"atomicity: transaction {txn_id} committed, but shard {shard} never prepared it "
                                  "(its resolve applied nothing)")
            elif decision.commit and (not resolved.commit or resolved.succeeded != decision.succeeded):
                violations.append(f"atomicity: transaction {txn_id} committed ({decision.succeeded}), shard {shard} "
                                  f"resolved it as commit={resolved.commit} succeeded={resolved.succeeded}")
            elif not decision.commit and resolved.commit and resolved.applied:
                violations.append(f"T2: shard {shard} applied transaction {txn_id}, whose decision is abort")
        if decision.commit and converged:
            for shard in decision.participants[1:]:  # the coordinator applied its part with the decision
                if shard not in resolves.get(txn_id, {}):
                    violations.append(f"T3: transaction {txn_id} committed, shard {shard} never resolved it")
    for txn_id, by_shard in sorted(resolves.items()):
        if txn_id not in decisions:
            for shard, resolved in sorted(by_shard.items()):
                if resolved.commit and resolved.applied:
                    violations.append(f"T2: shard {shard} applied transaction {txn_id}, which has no decision")
    commits = collections.Counter(records[0][2].request_id for records in decisions.values()
                                  if records[0][2].commit and records[0][2].request_id)
    for request_id, count in sorted(commits.items()):
        if count > 1:
            violations.append(f"T5: request {request_id} committed by {count} transactions")
    # T5: a client request's first recorded outcome is its outcome: no commit after an abort recorded it.
    for shard, oracle in enumerate(oracles):
        outcome: dict[str, bool] = {}
        for offset in sorted(oracle.accepted):
            entry = decode_entry(oracle.accepted[offset])
            if entry is None or not entry.HasField("decision") or not entry.decision.request_id:
                continue
            rid = entry.decision.request_id
            if rid in outcome and not outcome[rid] and entry.decision.commit:
                violations.append(f"T5: request {rid} committed at shard {shard} offset {offset}, after an abort "
                                  "recorded it as failed")
            outcome.setdefault(rid, entry.decision.commit)
    if converged:
        for shard, oracle in enumerate(oracles):
            if oracle.store.locks.has_locks():
                left = [p.txn_id for p in oracle.store.locks.prepared()]
                violations.append(f"T3: shard {shard} still holds prepared transactions after healing: {left[:5]}")
            if oracle.store.decisions and keeps_decisions:
                left = sorted(oracle.store.decisions)
                violations.append(f"T3: shard {shard} still holds decisions after healing: {left[:5]}")

    def committed(request_id: str) -> bool:
        aborted = wal_entry_pb2.REQUEST_KIND_TXN_ABORTED
        return any(request_id in oracle.applied and oracle.applied[request_id].kind != aborted for oracle in oracles)

    for op in bank:
        if op.kind is BankKind.CHECK:
            continue  # a single read: judged with the others by check_serializable
        if op.kind in (BankKind.SUM, BankKind.SCAN):
            if op.outcome is Outcome.OK and op.balances is not None and sum(op.balances.values()) != 0:
                what = "read-only Txn" if op.kind is BankKind.SUM else "linearizable Scan"
                violations.append(f"bank: a {what} of client {op.client} saw the accounts sum to "
                                  f"{sum(op.balances.values())}: {op.balances}")
            continue
        if op.outcome is Outcome.OK and not committed(op.request_id):
            violations.append(f"bank: transfer {op.request_id} was acknowledged but never committed")
        if op.outcome is Outcome.FAILED and committed(op.request_id):
            violations.append(f"W7: bank transfer {op.request_id} was answered as definitely failed but committed")
    why = check_serializable(bank)
    if why is not None:
        violations.append(f"not strictly serializable: {why}")
    if converged and accounts:
        total = 0
        for key in accounts:
            state = oracles[shard_of(key, len(oracles))].store.keys.get(key)
            total += balance(state.value) if state is not None else 0
        if total != 0:
            violations.append(f"bank: the accounts sum to {total} after healing")
    return violations


def check_serializable(bank: Sequence[BankOp]) -> str | None:
    """A cycle among the acknowledged bank operations, described, or None.

    Per account, versions count its writes (a transfer that wrote version v read v - 1). So an
    operation that read version v comes after the writer of v and before the writer of v + 1,
    and the writer of v comes before the writer of v + 1: the account's history is one chain.
    Writers known only by the version they left (a transfer whose answer was lost) are
    placeholders in that chain. Real time adds an edge from every operation answered before
    another was invoked. A strictly serializable history has a total order containing every
    edge: the graph has no cycle (checked with an iterative depth-first search)."""
    ok = [op for op in bank if op.outcome is Outcome.OK and (op.read_versions or op.wrote_versions)]
    nodes: list[str] = [f"{op.kind.value} {op.request_id or f'c{op.client}@{op.invoke}'}" for op in ok]
    edges: dict[int, set[int]] = collections.defaultdict(set)
    writers: dict[tuple[bytes, int], int] = {}
    for i, op in enumerate(ok):
        for key, version in op.wrote_versions.items():
            if (key, version) in writers:
                return f"{nodes[writers[(key, version)]]} and {nodes[i]} both wrote version {version} of {key!r}"
            writers[(key, version)] = i

    def writer(key: bytes, version: int) -> int:
        if (key, version) not in writers:  # a write whose answer was lost: known by its version only
            writers[(key, version)] = len(nodes)
            nodes.append(f"the write of {key!r} v{version}")
        return writers[(key, version)]

    for i, op in enumerate(ok):
        for key, version in op.wrote_versions.items():
            if version > 1:
                edges[writer(key, version - 1)].add(i)
        for key, version in op.read_versions.items():
            if key in op.wrote_versions:
                continue
            if version > 0:
                edges[writer(key, version)].add(i)
            edges[i].add(writer(key, version + 1))
    by_key: dict[bytes, list[int]] = collections.defaultdict(list)
    for key, version in writers:
        by_key[key].append(version)
    for key, seen in by_key.items():  # each account's versions, one chain
        present = set(seen)
        for version in seen:
            if version + 1 in present:
                edges[writers[(key, version)]].add(writers[(key, version + 1)])
    for i, a in enumerate(ok):  # real time: answered before the other was invoked
        for j, b in enumerate(ok):
            if a.complete is not None and a.complete < b.invoke:
                edges[i].add(j)
    return _cycle(nodes, edges)


def _cycle(nodes: Sequence[str], edges: dict[int, set[int]]) -> str | None:
    state = [0] * len(nodes)  # 0 new, 1 on the stack, 2 done
    for root in range(len(nodes)):
        if state[root]:
            continue
        stack: list[tuple[int, list[int]]] = [(root, sorted(edges.get(root, ())))]
        state[root] = 1
        path = [root]
        while stack:
            node, todo = stack[-1]
            if not todo:
                state[node] = 2
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop()
            if state[nxt] == 1:
                cycle = [*path[path.index(nxt):], nxt]
                return " -> ".join(nodes[n] for n in cycle[:8])
            if state[nxt] == 0:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, sorted(edges.get(nxt, ()))))
    return None
