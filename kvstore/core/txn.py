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

from kvstore import errors, limits
from kvstore.core.batch import RequestTable, Write
from kvstore.core.evaluate import Evaluation, compare_holds, run_ops
from kvstore.core.locks import LockView
from kvstore.core.sharding import shard_of
from kvstore.core.state import (
    TXN_ID_PREFIX,
    Lookup,
    PreparedTxn,
    RequestRecord,
    decision_id,
    prepare_id,
    resolve_id,
)
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2

__all__ = ["TXN_ID_PREFIX", "decision_id", "prepare_id", "resolve_id"]

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


# ---- the records -----------------------------------------------------------------------------------------


def evaluate_prepare(txn_id: str, req: kv_pb2.TxnRequest, shard: int, shard_count: int, lookup: Lookup,
                     revision: int, *, max_response_bytes: int = limits.MAX_RESPONSE_BYTES) -> Evaluation:
    """This shard's prepare of `req`: both branches over its keys, evaluated against the state
    (plus the batch before it) that its locks will keep until the resolve. Its answer is the vote."""
    shards = participants(req, shard_count)
    assert shard in shards and len(shards) > 1, f"shard {shard} is no participant of a cross-shard Txn: {shards}"
    part = part_of(req, shard, shard_count)
    held = all(compare_holds(c, lookup(c.key)) for c in part.compares)
    write = kv_pb2.WriteResult(shard=shard)  # revision unset: the effects land at the resolve
    prepare = wal_entry_pb2.TxnPrepare(txn_id=txn_id, coordinator=shards[0], participants=shards,
                                       compares_held=held, request_id=req.request_id)
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


def evaluate_decision(decision: wal_entry_pb2.TxnDecision, earlier: RequestRecord | None,
                      revision: int) -> Evaluation:
    """The coordinator's decision record. `earlier` is what the client's request id committed
    with before (another attempt's decision), if anything: then this attempt is aborted instead
    and answered with that earlier answer (exactly once, T5). A commit's answer gets its revision
    (the decision's offset) here, where it is known."""
    assert decision.txn_id and not (decision.commit and decision.reason), decision
    record = wal_entry_pb2.TxnDecision()
    record.CopyFrom(decision)
    decided = wal_entry_pb2.TxnDecided(commit=decision.commit, succeeded=decision.succeeded,
                                       reason=decision.reason, revision=revision)
    if decision.commit and earlier is not None:
        record.commit, record.succeeded, record.answer = False, False, b""
        record.request_id = ""
        record.reason = "the client's request committed before, in another attempt"
        decided = wal_entry_pb2.TxnDecided(commit=False, reason=record.reason, earlier_answer=earlier.response,
                                           revision=revision)
    elif decision.commit:
        answer = kv_pb2.TxnResponse.FromString(decision.answer)
        answer.result.CopyFrom(kv_pb2.WriteResult(shard=decision.participants[0], revision=revision))
        record.answer = answer.SerializeToString()
    entry = wal_entry_pb2.WalEntry(request_id=decision_id(decision.txn_id), response=decided.SerializeToString(),
                                   decision=record)
    return Evaluation(entry, decided, [])


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
                  first_attempt_unix_ms: int = 0) -> Write:
    """A participant's prepare, queued like any write: its id (`prepare_id`) makes a retried
    prepare replay the recorded vote; its keys are checked against the locks when planned. A
    prepare arriving after its transaction was resolved here (a resolver aborted it while the
    prepare was in transit) is refused: it must not lock again."""
    def build(lookup: Lookup, locks: LockView, revision: int) -> Evaluation:
        if table.request(resolve_id(txn_id)) is not None:
            raise errors.TxnConflictError(f"transaction {txn_id} was already resolved at shard {shard} (a resolver "
                                          "aborted it); nothing was done: retry", txn_id=txn_id)
        if locks.prepared_count() >= limits.MAX_PREPARED_TXNS:
            raise errors.OverloadedError(f"shard {shard}: {limits.MAX_PREPARED_TXNS} cross-shard transactions "
                                         "prepared and not resolved (limit MAX_PREPARED_TXNS); back off")
        return evaluate_prepare(txn_id, req, shard, shard_count, lookup, revision)

    return Write(prepare_id(txn_id), _no_build, wal_entry_pb2.TxnVote, first_attempt_unix_ms,
                 wal_entry_pb2.REQUEST_KIND_TXN_PREPARE, locked_build=build)


def decision_write(decision: wal_entry_pb2.TxnDecision, table: RequestTable, *, first_attempt_unix_ms: int = 0,
                   second_decision: bool = False) -> Write:
    """The coordinator's decision: its id (`decision_id`) makes admission answer with the
    decision already recorded, whoever asks (the driver, a resolver, an operator): T1.
    `second_decision` is the simulation's mutation of that rule (no admission by id: a second
    decision is appended and answered as if it were the first)."""
    def build(_lookup: Lookup, _locks: LockView, revision: int) -> Evaluation:
        earlier = table.request(decision.request_id) if decision.commit and decision.request_id else None
        return evaluate_decision(decision, earlier, revision)

    return Write("" if second_decision else decision_id(decision.txn_id), _no_build, wal_entry_pb2.TxnDecided,
                 first_attempt_unix_ms, wal_entry_pb2.REQUEST_KIND_TXN_DECISION, locked_build=build)


def resolve_write(resolve: wal_entry_pb2.TxnResolve, *, first_attempt_unix_ms: int = 0) -> Write:
    """A participant's resolve, with the decision read from the coordinator's WAL: never
    queued on a guess (T2)."""
    return Write(resolve_id(resolve.txn_id), _no_build, wal_entry_pb2.TxnResolve, first_attempt_unix_ms,
                 wal_entry_pb2.REQUEST_KIND_TXN_RESOLVE,
                 locked_build=lambda _lookup, locks, _revision: evaluate_resolve(resolve,
                                                                                 locks.prepared_txn(resolve.txn_id)))


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

