"""Cross-shard transactions at one shard: locks, prepare, decision, resolve; pure.

docs/design.md §10 is the protocol. This module holds what a shard leader decides about a
transaction's records, and what the driver (`kvstore.core.txn_driver`) computes from their
answers; both the node and the simulation use it as is. The state side (what applying each
record does) is `kvstore.core.state.txn_record_rule`, the one apply function's.

* **Split**: a Txn's participants (the shards of all its keys) and its coordinator shard (the
  lowest: a function of the request, so every attempt and every node picks the same one).
* **Locks** (`kvstore.core.locks`): the prepared table, which the planner checks every write
  against; a write in conflict waits, bounded, then is refused.
* **Prepare** (`evaluate_prepare`): this shard's compares and both branches, evaluated under the
  locks it takes; the vote is its answer.
* **Decision** (`evaluate_decision`): the coordinator's record; the first decision of a txn id is
  the only one (admission replays it to anyone asking again, T1).
* **Resolve** (`evaluate_resolve`): the participant's copy of the decision, with the prepared
  branch's effects when it commits.
* **Answer** (`combine`): the votes into the client's TxnResponse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvstore import errors, limits
from kvstore.core.batch import Horizon, RequestTable, Write
from kvstore.core.evaluate import Evaluation, compare_holds, run_ops
from kvstore.core.locks import LockView
from kvstore.core.sharding import shard_of
from kvstore.core.state import (
    TXN_ID_PREFIX,
    DecidedTxn,
    Lookup,
    PreparedTxn,
    RequestRecord,
    decision_id,
    forgotten_id,
    prepare_id,
    resolve_id,
)
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2

__all__ = ["TXN_ID_PREFIX", "decision_id", "prepare_id", "resolve_id"]

# The commit decision's answer goes into one WAL record (its response, replayed to retries): it
# must leave room in it for the rest of the record (the planner refuses a record past the limit,
# the coordinator's effects included).
MAX_DECIDED_ANSWER_BYTES = min(limits.MAX_RESPONSE_BYTES, limits.MAX_WAL_RECORD_BYTES - 16 * 1024)

# ---- split ---------------------------------------------------------------------------------------------


def txn_keys(req: kv_pb2.TxnRequest) -> list[bytes]:
    """Every key a Txn compares, reads or writes, in request order (the validator has made sure
    every operation has a kind)."""
    keys = [c.key for c in req.compares]
    for op in (*req.success, *req.failure):
        kind = op.WhichOneof("op")
        if kind is not None:
            keys.append(getattr(op, kind).key)
    return keys


def participants(req: kv_pb2.TxnRequest, shard_count: int) -> tuple[int, ...]:
    """The shards of the Txn's keys, ascending: the first is its coordinator shard."""
    return tuple(sorted({shard_of(key, shard_count) for key in txn_keys(req)}))


@dataclasses.dataclass(frozen=True)
class Part:
    """One shard's share of a Txn: its compares and, per branch, its operations with their
    positions in the client's branch (so the answers can be put back in order)."""

    shard: int
    compares: tuple[kv_pb2.Compare, ...]
    success: tuple[tuple[int, kv_pb2.TxnOp], ...]
    failure: tuple[tuple[int, kv_pb2.TxnOp], ...]


def part_of(req: kv_pb2.TxnRequest, shard: int, shard_count: int) -> Part:
    def mine(key: bytes) -> bool:
        return shard_of(key, shard_count) == shard

    def ops(branch: Sequence[kv_pb2.TxnOp]) -> tuple[tuple[int, kv_pb2.TxnOp], ...]:
        return tuple((i, op) for i, op in enumerate(branch)
                     if op.WhichOneof("op") is not None and mine(getattr(op, str(op.WhichOneof("op"))).key))

    return Part(shard, tuple(c for c in req.compares if mine(c.key)), ops(req.success), ops(req.failure))


def read_only(req: kv_pb2.TxnRequest) -> bool:
    """A Txn whose branches only read (gets; its compares read too): it changes nothing, so it
    needs no decision, only a cut (`kvstore.core.cut`)."""
    return not any(op.WhichOneof("op") in ("put", "delete") for op in (*req.success, *req.failure))


def part_keys(part: Part) -> tuple[bytes, ...]:
    """Every key a shard's part compares or reads (what validating its read checks)."""
    keys = [c.key for c in part.compares]
    for _, op in (*part.success, *part.failure):
        kind = op.WhichOneof("op")
        if kind is not None:
            keys.append(getattr(op, kind).key)
    return tuple(dict.fromkeys(keys))


def evaluate_read_part(req: kv_pb2.TxnRequest, shard: int, shard_count: int, lookup: Lookup, *,
                       max_response_bytes: int = limits.MAX_RESPONSE_BYTES) -> wal_entry_pb2.TxnVote:
    """A read-only Txn's part at one shard, read optimistically (no record, no lock): its
    compares and both branches' gets, as a vote the driver combines once the parts are a cut."""
    assert read_only(req), "only a read-only Txn is read optimistically"
    part = part_of(req, shard, shard_count)
    vote = wal_entry_pb2.TxnVote(compares_held=all(compare_holds(c, lookup(c.key)) for c in part.compares))
    write = kv_pb2.WriteResult(shard=shard)
    answer_bytes = 0
    for name, ops in (("success", part.success), ("failure", part.failure)):
        ran = run_ops([op for _, op in ops], lookup, write, branch=name, max_response_bytes=max_response_bytes,
                      answer_bytes=answer_bytes)
        answer_bytes = ran.answer_bytes
        results = kv_pb2.TxnResponse(results=ran.results).SerializeToString()
        getattr(vote, name).CopyFrom(wal_entry_pb2.TxnBranch(op_indices=[index for index, _ in ops], results=results))
    return vote


# ---- the records -----------------------------------------------------------------------------------------


class TxnTables(RequestTable, Protocol):
    """What a transaction's records are built against besides keys and locks: the request-id
    table and, at the coordinator, the decision table (a store, or a memory replica)."""

    def decided_txn(self, txn_id: str) -> DecidedTxn | None: ...

    def decided_request(self, request_id: str) -> DecidedTxn | None:
        """The decision in the table that recorded this client request id as its outcome."""
        ...


def request_outcome(tables: TxnTables, request_id: str,
                    in_batch: Mapping[str, RequestRecord] | None = None) -> RequestRecord | None:
    """The client request's recorded outcome: made by a record earlier in the batch being
    planned, in the request-id table, or, after that forgot it, in a decision the decision table
    still holds (one of its participants has not resolved it: a retry meeting that participant's
    lock is answered with it, however old, T5)."""
    if in_batch and request_id in in_batch:
        return in_batch[request_id]
    recorded = tables.request(request_id)
    if recorded is not None:
        return recorded
    decided = tables.decided_request(request_id)
    if decided is None:
        return None
    if decided.decision.commit:
        return RequestRecord(request_id, decided.revision, decided.decided().answer, decided.leader_unix_ms,
                             wal_entry_pb2.REQUEST_KIND_TXN)
    return _aborted_outcome(request_id, decided.decision.reason, decided.revision, decided.leader_unix_ms)


def _aborted_outcome(request_id: str, reason: str, revision: int, leader_unix_ms: int) -> RequestRecord:
    aborted = wal_entry_pb2.TxnDecided(commit=False, reason=reason, revision=revision)
    return RequestRecord(request_id, revision, aborted.SerializeToString(), leader_unix_ms,
                         wal_entry_pb2.REQUEST_KIND_TXN_ABORTED)


def evaluate_prepare(txn_id: str, req: kv_pb2.TxnRequest, shard: int, shard_count: int, lookup: Lookup,
                     revision: int, *, max_response_bytes: int = limits.MAX_RESPONSE_BYTES,
                     first_attempt_unix_ms: int = 0) -> Evaluation:
    """This shard's prepare of `req`: both branches over its keys, evaluated against the state
    (plus the batch before it) that its locks will keep until the resolve. Its answer is the vote."""
    shards = participants(req, shard_count)
    if shard not in shards[1:]:  # the coordinator evaluates its part with the decision: it never prepares
        raise errors.InvalidRequestError(f"shard {shard} does not prepare this cross-shard Txn (participants {shards}, "
                                         f"the first of them its coordinator)", field="shard")
    part = part_of(req, shard, shard_count)
    held = all(compare_holds(c, lookup(c.key)) for c in part.compares)
    write = kv_pb2.WriteResult(shard=shard)  # revision unset: the effects land at the resolve
    prepare = wal_entry_pb2.TxnPrepare(txn_id=txn_id, coordinator=shards[0], participants=shards,
                                       compares_held=held, request_id=req.request_id,
                                       first_attempt_unix_ms=first_attempt_unix_ms)
    vote = wal_entry_pb2.TxnVote(compares_held=held)
    shared = {c.key: None for c in part.compares}
    exclusive: dict[bytes, None] = {}
    answer_bytes = 0
    for name, ops in (("success", part.success), ("failure", part.failure)):
        ran = run_ops([op for _, op in ops], lookup, write, branch=name, max_response_bytes=max_response_bytes,
                      answer_bytes=answer_bytes)
        answer_bytes = ran.answer_bytes
        shared.update(dict.fromkeys(ran.reads))
        exclusive.update(dict.fromkeys(ran.keys))
        results = kv_pb2.TxnResponse(results=ran.results).SerializeToString()
        indices = [index for index, _ in ops]
        getattr(prepare, name).CopyFrom(wal_entry_pb2.TxnBranch(effects=ran.effects, op_indices=indices,
                                                                results=results))
        getattr(vote, name).CopyFrom(wal_entry_pb2.TxnBranch(op_indices=indices, results=results))
    prepare.exclusive_keys.extend(exclusive)
    prepare.shared_keys.extend(key for key in shared if key not in exclusive)
    entry = wal_entry_pb2.WalEntry(request_id=prepare_id(txn_id), response=vote.SerializeToString(),
                                   prepare=prepare)
    return Evaluation(entry, vote, [], locks=PreparedTxn(prepare, revision, 0))


@dataclasses.dataclass(frozen=True)
class Decide:
    """What the driver asks of the coordinator: `decision` (commit or abort; its `request_id` the
    client's, `reason` an abort's), with a commit the client's Txn and every other participant's
    vote; `first_attempt_unix_ms` the client's first attempt (0: not known)."""

    decision: wal_entry_pb2.TxnDecision
    first_attempt_unix_ms: int = 0
    request: kv_pb2.TxnRequest | None = None
    votes: Mapping[int, wal_entry_pb2.TxnVote] = dataclasses.field(default_factory=dict)


def evaluate_decision(decide: Decide, tables: TxnTables, lookup: Lookup, revision: int, horizon: Horizon, *,
                      shard_count: int, asked_unix_ms: int = 0,
                      max_answer_bytes: int = limits.MAX_RESPONSE_BYTES) -> Evaluation:
    """The coordinator's decision record (docs/design.md §10.2), or the decision recorded before.

    * A decision recorded for the txn id (the decision table, T1): answered with it, nothing
      appended (admission replays one whose id it still remembers before this is asked).
    * A commit: the coordinator's own part evaluated now, under its locks (`Evaluation.keys`
      and `reads`: a conflict parks it like any write), its effects applied with the decision,
      the client's answer built from every vote and its own, at this record's revision. Unless
      the client's request id has an outcome already (another attempt's decision, T5): then this
      transaction aborts and answers with that outcome.
    * An abort: recorded as the client request's outcome too, unless the request has one (a
      commit's answer is replayed, marked `earlier_answer`) or may have had one the request-id
      table forgot (then `request_unrecorded`: the request's outcome stays unknown). An abort is
      refused (`RequestExpiredError`, nothing appended) when it was asked (`asked_unix_ms`: when
      its driver or resolver started, after checking the prepare) so long ago that the decision
      it could contradict may have been forgotten since, its `forgotten_id` too: a resolver that
      checked its prepare and then stalled must check again rather than abort a transaction that
      was decided, resolved everywhere and forgotten meanwhile (T1). This only delays a fresh
      resolver while the request-id table forgets ids stamped within the clock-skew margin.
    """
    decision = decide.decision
    assert decision.txn_id and len(decision.participants) > 1, decision
    recorded = tables.decided_txn(decision.txn_id)
    if recorded is not None:
        return Evaluation(None, recorded.decided())
    forgotten = tables.request(forgotten_id(decision.txn_id))
    if forgotten is not None:  # decided, resolved everywhere and forgotten: still the answer
        return Evaluation(None, wal_entry_pb2.TxnDecided.FromString(forgotten.response))
    client = decision.request_id
    earlier = request_outcome(tables, client, horizon.outcomes) if client else None
    if earlier is not None and earlier.kind not in (wal_entry_pb2.REQUEST_KIND_TXN,
                                                    wal_entry_pb2.REQUEST_KIND_TXN_ABORTED):
        # The client's id answered another kind of request (a Put at this shard, say): never
        # replay that answer as this Txn's (the single-shard path refuses the same way). No
        # attempt of this Txn can commit under that id either: an abort is definite.
        if decision.commit:
            _refuse_kind(earlier)
        return _abort(decision, revision, horizon, reason=f"{decision.reason} (the request id was used before by "
                                                          "another kind of request)")
    if decision.commit:
        if earlier is not None:
            return _abort(decision, revision, horizon, reason="the client's request was decided before, in another "
                                                              "attempt", earlier=earlier)
        if decide.request is None or set(decide.votes) != set(decision.participants[1:]):
            raise errors.InvalidRequestError("a commit decision needs the client's Txn and a vote from every "
                                             "participant but the coordinator; nothing was done")
        return _evaluate_commit(decide, decide.request, lookup, revision, horizon, shard_count, max_answer_bytes)
    late = horizon.expired(asked_unix_ms)
    if late is not None:
        raise errors.RequestExpiredError(
            f"an abort of transaction {decision.txn_id} asked too long ago ({late}): whoever asked must check that "
            "the transaction is still prepared and ask again; nothing was done")
    if earlier is not None:
        return _abort(decision, revision, horizon, reason=decision.reason, earlier=earlier)
    record = bool(client) and not client.startswith(TXN_ID_PREFIX) and horizon.expired(
        decide.first_attempt_unix_ms) is None
    return _abort(decision, revision, horizon, reason=decision.reason, client=client if record else "",
                  unrecorded=bool(client) and not record)


def _evaluate_commit(decide: Decide, req: kv_pb2.TxnRequest, lookup: Lookup, revision: int, horizon: Horizon,
                     shard_count: int, max_answer_bytes: int) -> Evaluation:
    decision = decide.decision
    shards = tuple(decision.participants)
    coordinator = shards[0]
    part = part_of(req, coordinator, shard_count)
    held = all(compare_holds(c, lookup(c.key)) for c in part.compares)
    succeeded = held and all(vote.compares_held for vote in decide.votes.values())
    ops = part.success if succeeded else part.failure
    name = "success" if succeeded else "failure"
    write = kv_pb2.WriteResult(shard=coordinator, revision=revision)
    ran = run_ops([op for _, op in ops], lookup, write, branch=name, max_response_bytes=max_answer_bytes)
    own = wal_entry_pb2.TxnVote(compares_held=held)
    getattr(own, name).CopyFrom(wal_entry_pb2.TxnBranch(
        op_indices=[i for i, _ in ops], results=kv_pb2.TxnResponse(results=ran.results).SerializeToString()))
    answer = combine(req, {**decide.votes, coordinator: own}, coordinator, max_response_bytes=max_answer_bytes)
    answer.result.revision = revision
    answer_bytes = answer.SerializeToString()
    client = decision.request_id
    record = wal_entry_pb2.TxnDecision(txn_id=decision.txn_id, commit=True, succeeded=succeeded, participants=shards,
                                       request_id=client, kept=True)
    decided = wal_entry_pb2.TxnDecided(commit=True, succeeded=succeeded, revision=revision, answer=answer_bytes)
    entry = wal_entry_pb2.WalEntry(request_id=decision_id(decision.txn_id), effects=ran.effects, decision=record,
                                   response=decided.SerializeToString())
    outcome = None
    if client and not client.startswith(TXN_ID_PREFIX):
        outcome = RequestRecord(client, revision, answer_bytes, horizon.now_unix_ms, wal_entry_pb2.REQUEST_KIND_TXN)
    return Evaluation(entry, decided, ran.keys, reads=[c.key for c in part.compares] + ran.reads, outcome=outcome)


def _abort(decision: wal_entry_pb2.TxnDecision, revision: int, horizon: Horizon, *, reason: str, client: str = "",
           earlier: RequestRecord | None = None, unrecorded: bool = False) -> Evaluation:
    record = wal_entry_pb2.TxnDecision(txn_id=decision.txn_id, participants=decision.participants,
                                       reason=reason[:200], request_id=client, kept=True)
    decided = wal_entry_pb2.TxnDecided(commit=False, reason=record.reason, revision=revision,
                                       request_unrecorded=unrecorded)
    if earlier is not None and earlier.kind == wal_entry_pb2.REQUEST_KIND_TXN:
        decided.earlier_answer = earlier.response
    elif earlier is not None:  # the request was aborted before, in another attempt: that is its outcome
        decided.reason = wal_entry_pb2.TxnDecided.FromString(earlier.response).reason or record.reason
    entry = wal_entry_pb2.WalEntry(request_id=decision_id(decision.txn_id), response=decided.SerializeToString(),
                                   decision=record)
    outcome = _aborted_outcome(client, record.reason, revision, horizon.now_unix_ms) if client else None
    return Evaluation(entry, decided, [], outcome=outcome)


def _refuse_kind(earlier: RequestRecord) -> None:
    raise errors.InvalidRequestError(
        f"this request id was already used by another kind of request, which committed at revision "
        f"{earlier.revision}; this cross-shard Txn was not applied: give every request its own id", field="request_id")


def evaluate_resolve(resolve: wal_entry_pb2.TxnResolve, prepared: PreparedTxn | None) -> Evaluation:
    """A participant's resolve: on commit, the prepared branch's effects (applied at this record,
    T2), and the locks released either way. Appended even for a transaction not prepared here (a
    prepare refused or never arrived): its id then refuses a prepare that arrives late."""
    entry = wal_entry_pb2.WalEntry(request_id=resolve_id(resolve.txn_id), resolve=resolve,
                                   response=resolve.SerializeToString())
    keys: list[bytes] = []
    if prepared is not None and resolve.commit:
        branch = prepared.prepare.success if resolve.succeeded else prepared.prepare.failure
        entry.effects.extend(branch.effects)
        keys = [e.put.key if e.WhichOneof("kind") == "put" else e.delete.key for e in branch.effects]
    return Evaluation(entry, resolve, keys, releases=resolve.txn_id if prepared is not None else "")


# ---- the writes a leader queues (kvstore.core.batch: admission, dedupe, group commit as any write) --------


def _no_build(lookup: Lookup, revision: int) -> Evaluation:
    raise AssertionError("a transaction's record is built against the locks (Write.locked_build)")


def prepare_write(txn_id: str, req: kv_pb2.TxnRequest, shard: int, shard_count: int, table: RequestTable, *,
                  started_unix_ms: int = 0, first_attempt_unix_ms: int = 0) -> Write:
    """A participant's prepare, queued like any write: its id (`prepare_id`) makes a retried
    prepare replay the recorded vote; its keys are checked against the locks when planned. A
    prepare arriving after its transaction was resolved here (a resolver aborted it while the
    prepare was in transit) is refused: it must not lock again. `started_unix_ms` (the attempt's
    start) is what admission judges its id by: a prepare so late that its resolve's id may be
    forgotten is refused as expired; `first_attempt_unix_ms` (the client's) goes into the record."""
    def build(lookup: Lookup, locks: LockView, revision: int, _horizon: Horizon) -> Evaluation:
        if table.request(resolve_id(txn_id)) is not None:
            raise errors.TxnConflictError(f"transaction {txn_id} was already resolved at shard {shard} (a resolver "
                                          "aborted it); nothing was done: retry", txn_id=txn_id)
        if locks.prepared_count() >= limits.MAX_PREPARED_TXNS:
            raise errors.OverloadedError(f"shard {shard}: {limits.MAX_PREPARED_TXNS} cross-shard transactions "
                                         "prepared and not resolved (limit MAX_PREPARED_TXNS); back off")
        return evaluate_prepare(txn_id, req, shard, shard_count, lookup, revision,
                                first_attempt_unix_ms=first_attempt_unix_ms)

    return Write(prepare_id(txn_id), _no_build, wal_entry_pb2.TxnVote, started_unix_ms,
                 wal_entry_pb2.REQUEST_KIND_TXN_PREPARE, locked_build=build)


def decision_write(decide: Decide, tables: TxnTables, *, shard_count: int, started_unix_ms: int = 0,
                   second_decision: bool = False, request_table_only: bool = False,
                   max_answer_bytes: int = MAX_DECIDED_ANSWER_BYTES) -> Write:
    """The coordinator's decision: its id (`decision_id`) makes admission answer with the
    decision already recorded, and the decision table answers after admission forgot it,
    whoever asks (the driver, a resolver, an operator): T1. A commit is judged by the client's
    first attempt (refused past the request-id horizon: it might apply a forgotten request
    twice); an abort by nothing (it may always be recorded while no decision is), so a
    resolver's abort, however late, is never refused as expired (T3).

    Two of the simulation's mutations: `second_decision` (no admission by id, no table: a second
    decision is appended and answered as if it were the first, T1) and `request_table_only` (the
    decision table ignored, every decision judged by the horizon, as when decisions lived only
    in the request-id table: a late resolver is refused, its prepare left in doubt, T3)."""
    commit = decide.decision.commit
    view: TxnTables = _NoDecisions(tables) if second_decision or request_table_only else tables

    def build(lookup: Lookup, _locks: LockView, revision: int, horizon: Horizon) -> Evaluation:
        return evaluate_decision(decide, view, lookup, revision, horizon, shard_count=shard_count,
                                 asked_unix_ms=started_unix_ms, max_answer_bytes=max_answer_bytes)

    checked = commit or request_table_only
    return Write("" if second_decision else decision_id(decide.decision.txn_id), _no_build, wal_entry_pb2.TxnDecided,
                 decide.first_attempt_unix_ms if checked else started_unix_ms, wal_entry_pb2.REQUEST_KIND_TXN_DECISION,
                 locked_build=build, check_horizon=checked)


class _NoDecisions:
    """MUTATIONS `second-decision`, `decision-in-request-table`: the coordinator's tables without
    its decision table."""

    def __init__(self, tables: TxnTables) -> None:
        self._tables = tables

    @property
    def evicted_through_ms(self) -> int:
        return self._tables.evicted_through_ms

    def request(self, request_id: str) -> RequestRecord | None:
        return self._tables.request(request_id)

    def decided_txn(self, txn_id: str) -> DecidedTxn | None:
        return None

    def decided_request(self, request_id: str) -> DecidedTxn | None:
        return None


def resolve_write(resolve: wal_entry_pb2.TxnResolve, *, first_attempt_unix_ms: int = 0) -> Write:
    """A participant's resolve, with the decision read from the coordinator's WAL: never
    queued on a guess (T2)."""
    return Write(resolve_id(resolve.txn_id), _no_build, wal_entry_pb2.TxnResolve, first_attempt_unix_ms,
                 wal_entry_pb2.REQUEST_KIND_TXN_RESOLVE, check_horizon=False, patient=True,
                 locked_build=lambda _lookup, locks, _revision, _horizon: evaluate_resolve(
                     resolve, locks.prepared_txn(resolve.txn_id)))


def forget_write(txn_ids: Sequence[str], tables: TxnTables) -> Write:
    """The coordinator's leader forgets decisions every other participant resolved (it learned
    so from their resolves' answers): one record for many, without a request id (forgetting
    twice is forgetting once). Ids no longer in the table are left out; none left, no record."""
    def build(_lookup: Lookup, _locks: LockView, _revision: int, _horizon: Horizon) -> Evaluation:
        gone = [t for t in dict.fromkeys(txn_ids) if tables.decided_txn(t) is not None]
        forget = wal_entry_pb2.TxnForget(txn_ids=gone)
        if not gone:
            return Evaluation(None, forget)
        return Evaluation(wal_entry_pb2.WalEntry(forget=forget), forget, [])

    return Write("", _no_build, wal_entry_pb2.TxnForget, locked_build=build, patient=True)


# ---- the driver's arithmetic -------------------------------------------------------------------------------


def verdict(votes: Mapping[int, wal_entry_pb2.TxnVote]) -> bool:
    """Which branch a transaction whose every participant prepared commits: success when every
    participant's compares held."""
    return all(vote.compares_held for vote in votes.values())


def combine(req: kv_pb2.TxnRequest, votes: Mapping[int, wal_entry_pb2.TxnVote], coordinator: int, *,
            max_response_bytes: int = limits.MAX_RESPONSE_BYTES) -> kv_pb2.TxnResponse:
    """The client's answer from every participant's vote: the chosen branch's results put back in
    the client's order. Raises InvalidRequestError (limit MAX_RESPONSE_BYTES) when the whole
    answer would not fit (each participant bounded only its own part)."""
    succeeded = verdict(votes)
    name = "success" if succeeded else "failure"
    count = len(req.success if succeeded else req.failure)
    results: list[kv_pb2.TxnOpResult | None] = [None] * count
    for shard, vote in sorted(votes.items()):
        branch: wal_entry_pb2.TxnBranch = getattr(vote, name)
        answers = kv_pb2.TxnResponse.FromString(branch.results).results
        assert len(answers) == len(branch.op_indices), f"shard {shard}: a vote's results do not match its indices"
        for index, result in zip(branch.op_indices, answers, strict=True):
            assert 0 <= index < count and results[index] is None, f"shard {shard}: operation {index} answered twice"
            results[index] = result
    answered = [r for r in results if r is not None]
    assert len(answered) == count, f"an operation of the {name} branch got no result"
    response = kv_pb2.TxnResponse(succeeded=succeeded, results=answered, result=kv_pb2.WriteResult(shard=coordinator))
    size = response.ByteSize()
    if size > max_response_bytes:
        raise errors.InvalidRequestError(
            f"the Txn's answer would be {size} bytes (the values its gets read, over every shard), above "
            f"MAX_RESPONSE_BYTES ({max_response_bytes}); nothing was done: read those keys with fewer gets per Txn",
            field=name, limit="MAX_RESPONSE_BYTES")
    return response

