"""Cross-shard transactions' pure core (docs/design.md §10): split, locks, the three records,
what applying each does, and the driver's arithmetic.

The protocol is run end to end over memory replicas (`MemoryShard`) with the leader's own
planner (`plan_batch`) and apply: no Kafka, no node, the same code a node runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from kvstore import errors, limits
from kvstore.core import txn
from kvstore.core.batch import BatchLimits, Plan, Write, admit, plan_batch, write_of
from kvstore.core.locks import NO_LOCKS, BatchLocks, LockIndex, conflict
from kvstore.core.request_window import MemoryShard
from kvstore.core.sharding import shard_of
from kvstore.core.state import (
    DecidedTxn,
    PreparedTxn,
    apply_entries,
    decision_id,
    forgotten_id,
    prepare_id,
    resolve_id,
)
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.v1 import kv_pb2 as kv

SHARDS = 3
NOW_MS = 1_800_000_000_000
WIDE = BatchLimits(max_records=1000, max_bytes=1 << 22, max_record_bytes=1 << 21)


def key_in(shard: int, n: int = 0) -> bytes:
    """The n-th key (of the form k<i>) that lives in `shard`."""
    found = [k for k in (f"k{i}".encode() for i in range(200)) if shard_of(k, SHARDS) == shard]
    return found[n]


A, B, C = key_in(0), key_in(1), key_in(2)
A2 = key_in(0, 1)


def put_op(key: bytes, value: bytes) -> kv.TxnOp:
    return kv.TxnOp(put=kv.PutRequest(key=key, value=value))


def get_op(key: bytes) -> kv.TxnOp:
    return kv.TxnOp(get=kv.GetRequest(key=key))


def del_op(key: bytes) -> kv.TxnOp:
    return kv.TxnOp(delete=kv.DeleteRequest(key=key))


def value_is(key: bytes, value: bytes) -> kv.Compare:
    return kv.Compare(key=key, target=kv.Compare.TARGET_VALUE, op=kv.Compare.OP_EQUAL, value=value)


def transfer(rid: str = "t-1", expect: bytes = b"1") -> kv.TxnRequest:
    """If A == expect then A := 0, B := 1, get C else get A, put A2 := fail."""
    return kv.TxnRequest(request_id=rid, compares=[value_is(A, expect)],
                         success=[put_op(A, b"0"), put_op(B, b"1"), get_op(C)],
                         failure=[get_op(A), put_op(A2, b"fail")])


@dataclasses.dataclass
class Shard:
    """One shard's leader and replica in memory: plans a batch from writes, applies it."""

    index: int
    store: MemoryShard = dataclasses.field(default_factory=MemoryShard)
    now_ms: int = NOW_MS  # the leader's clock

    def run(self, writes: Sequence[Write]) -> Plan:
        revision = self.store.applied_offset
        plan = plan_batch(writes, revision, self.store.get, self.store, self.now_ms, WIDE, locks=self.store.locks)
        if plan.payloads:
            records = [(revision + i, p) for i, p in enumerate(plan.payloads)]
            self.store.apply(records, plan.upcoming_if_committed)
        return plan

    def one(self, write: Write) -> Any:
        """Plan one write alone; its answer (now or after commit)."""
        plan = self.run([write])
        answers = plan.now + plan.after_commit
        assert len(answers) == 1, plan
        return answers[0][1]


def cluster(**values: bytes) -> list[Shard]:
    shards = [Shard(i) for i in range(SHARDS)]
    for name, value in values.items():
        key = {"A": A, "B": B, "C": C, "A2": A2}[name]
        shards[shard_of(key, SHARDS)].one(write_of(kv.PutRequest(key=key, value=value), shard_of(key, SHARDS)))
    return shards


def drive(shards: list[Shard], req: kv.TxnRequest, txn_id: str = "x1", *, resolve: bool = True,
          first_attempt_unix_ms: int = NOW_MS) -> tuple[pb.TxnDecided | errors.StoreError, dict[int, Any]]:
    """The driver's course, step by step: prepare at every participant but the coordinator,
    decide at the coordinator (which evaluates its own part with the decision), resolve."""
    parts = txn.participants(req, SHARDS)
    votes = {s: shards[s].one(txn.prepare_write(txn_id, req, s, SHARDS, shards[s].store, started_unix_ms=NOW_MS,
                                                first_attempt_unix_ms=first_attempt_unix_ms)) for s in parts[1:]}
    prepared = {s: v for s, v in votes.items() if isinstance(v, pb.TxnVote)}
    if len(prepared) == len(parts) - 1:
        decide = txn.Decide(pb.TxnDecision(txn_id=txn_id, commit=True, participants=parts, request_id=req.request_id),
                            first_attempt_unix_ms, req, prepared)
    else:
        decide = txn.Decide(pb.TxnDecision(txn_id=txn_id, participants=parts, request_id=req.request_id,
                                           reason="a participant refused"), first_attempt_unix_ms)
    decided = shards[parts[0]].one(txn.decision_write(decide, shards[parts[0]].store, shard_count=SHARDS,
                                                      started_unix_ms=NOW_MS))
    if resolve and isinstance(decided, pb.TxnDecided):
        for s in parts[1:]:
            shards[s].one(txn.resolve_write(pb.TxnResolve(txn_id=txn_id, commit=decided.commit,
                                                          succeeded=decided.succeeded, coordinator=parts[0])))
    return decided, votes


def abort(txn_id: str, parts: Sequence[int], rid: str = "", first_ms: int = NOW_MS, reason: str = "timeout"
          ) -> txn.Decide:
    return txn.Decide(pb.TxnDecision(txn_id=txn_id, participants=parts, request_id=rid, reason=reason), first_ms)


def value(shards: list[Shard], key: bytes) -> bytes | None:
    state = shards[shard_of(key, SHARDS)].store.get(key)
    return None if state is None else state.value


# ---- split ----------------------------------------------------------------------------------------------


def test_participants_and_parts_follow_the_keys() -> None:
    req = transfer()
    assert txn.participants(req, SHARDS) == (0, 1, 2)
    part = txn.part_of(req, 0, SHARDS)
    assert [c.key for c in part.compares] == [A]
    assert [i for i, _ in part.success] == [0] and [i for i, _ in part.failure] == [0, 1]
    assert [i for i, _ in txn.part_of(req, 2, SHARDS).success] == [2]
    assert txn.txn_keys(kv.TxnRequest(success=[kv.TxnOp()], failure=[get_op(B)])) == [B]
    assert txn.participants(kv.TxnRequest(success=[put_op(A, b"1"), put_op(A2, b"2")]), SHARDS) == (0,)


# ---- the protocol end to end ------------------------------------------------------------------------------


def test_a_committed_transaction_applies_at_the_coordinator_with_its_decision_and_elsewhere_at_resolve() -> None:
    shards = cluster(A=b"1", C=b"c")
    decided, votes = drive(shards, transfer(), resolve=False)
    assert isinstance(decided, pb.TxnDecided) and decided.commit and decided.succeeded
    # The coordinator (shard 0) applied its part with the decision, at the decision's offset.
    a = shards[0].store.get(A)
    assert a is not None and a.value == b"0" and a.mod_revision == decided.revision
    assert not shards[0].store.locks.has_locks()
    # T2 at the others: decided, not resolved: nothing applied, the keys locked.
    assert value(shards, B) is None
    assert shards[1].store.locks.lock_holders(B) == {"x1": True}
    assert shards[2].store.locks.lock_holders(C) == {"x1": False}  # only read: shared
    # The decision stays in the coordinator's state until every other participant resolved it (T3).
    kept = shards[0].store.decided_txn("x1")
    assert kept is not None and kept.pending == (1, 2) and kept.revision == decided.revision
    for s in (1, 2):
        shards[s].one(txn.resolve_write(pb.TxnResolve(txn_id="x1", commit=True, succeeded=True, coordinator=0)))
    assert value(shards, B) == b"1" and value(shards, C) == b"c"
    assert not any(s.store.locks.has_locks() for s in shards)
    # The answer: every result in the client's order, the coordinator's shard and the decision's offset.
    answer = kv.TxnResponse.FromString(decided.answer)
    assert answer == kv.TxnResponse.FromString(shards[0].store.requests["t-1"].response)
    assert answer.succeeded and answer.result.shard == 0 and answer.result.revision == decided.revision
    assert [r.WhichOneof("result") for r in answer.results] == ["put", "put", "get"]
    assert answer.results[0].put.result.revision == decided.revision
    assert answer.results[2].get.kv.value == b"c" and answer.results[1].put.result.shard == 1
    assert votes[2].compares_held
    # Forgotten once resolved everywhere: one record, no request id; forgetting again adds nothing.
    end = shards[0].store.applied_offset
    assert isinstance(shards[0].one(txn.forget_write(["x1", "never"], shards[0].store)), pb.TxnForget)
    assert shards[0].store.decided_txn("x1") is None and shards[0].store.applied_offset == end + 2
    shards[0].one(txn.forget_write(["x1"], shards[0].store))
    assert shards[0].store.applied_offset == end + 2


def test_a_failed_compare_commits_the_failure_branch_everywhere() -> None:
    shards = cluster(A=b"2", C=b"c")
    decided, _ = drive(shards, transfer())
    assert isinstance(decided, pb.TxnDecided) and decided.commit and not decided.succeeded
    assert value(shards, A) == b"2" and value(shards, B) is None and value(shards, A2) == b"fail"
    answer = kv.TxnResponse.FromString(shards[0].store.requests["t-1"].response)
    assert not answer.succeeded and answer.results[0].get.kv.value == b"2"


def test_a_compare_failing_at_a_participant_decides_the_failure_branch_at_the_coordinator() -> None:
    shards = cluster(A=b"1", B=b"b")
    req = kv.TxnRequest(request_id="t", compares=[value_is(B, b"other")], success=[put_op(A, b"yes")],
                        failure=[put_op(A, b"no"), get_op(B)])
    decided, votes = drive(shards, req)
    assert isinstance(decided, pb.TxnDecided) and decided.commit and not decided.succeeded
    assert not votes[1].compares_held and value(shards, A) == b"no"


def test_a_conflict_aborts_records_the_request_as_failed_and_applies_nothing_anywhere() -> None:
    shards = cluster(A=b"1")
    other = kv.TxnRequest(success=[put_op(A, b"x"), put_op(B, b"x"), put_op(C, b"y")])
    shards[1].one(txn.prepare_write("other", other, 1, SHARDS, shards[1].store))
    decided, votes = drive(shards, transfer())
    assert isinstance(votes[1], errors.TxnConflictError) and votes[1].txn_id == "other"
    assert isinstance(decided, pb.TxnDecided) and not decided.commit and not decided.request_unrecorded
    assert value(shards, A) == b"1" and value(shards, A2) is None
    # T5: the abort is the request's recorded outcome: a later attempt cannot commit it.
    recorded = shards[0].store.requests["t-1"]
    assert recorded.kind == pb.REQUEST_KIND_TXN_ABORTED and not pb.TxnDecided.FromString(recorded.response).commit
    shards[1].one(txn.resolve_write(pb.TxnResolve(txn_id="other", commit=False)))
    later, _ = drive(shards, transfer(), "x2")
    assert isinstance(later, pb.TxnDecided) and not later.commit and not later.earlier_answer
    assert value(shards, A) == b"1" and value(shards, B) is None and not any(s.store.locks.has_locks() for s in shards)


def test_an_abort_of_a_request_older_than_the_horizon_leaves_it_unrecorded() -> None:
    shards = cluster(A=b"1")
    old = NOW_MS - 2 * limits.REQUEST_ID_HORIZON_MS
    decided = shards[0].one(txn.decision_write(abort("x1", (0, 1), "old", old), shards[0].store, shard_count=SHARDS,
                                               started_unix_ms=NOW_MS))
    assert isinstance(decided, pb.TxnDecided) and decided.request_unrecorded and "old" not in shards[0].store.requests
    # An unknown first attempt (a prepare of an older release) is not recorded either.
    unknown = shards[0].one(txn.decision_write(abort("x2", (0, 1), "u", 0), shards[0].store, shard_count=SHARDS,
                                               started_unix_ms=NOW_MS))
    assert isinstance(unknown, pb.TxnDecided) and unknown.request_unrecorded and "u" not in shards[0].store.requests


def test_a_request_id_used_by_another_kind_is_refused_on_the_decision_path() -> None:
    shards = cluster(A=b"1", C=b"c")
    shards[0].one(write_of(kv.PutRequest(key=A2, value=b"p", request_id="t-1"), 0))
    decided, _ = drive(shards, transfer(), resolve=False)
    assert isinstance(decided, errors.InvalidRequestError) and "another kind" in str(decided)
    # The driver then aborts: the Put's answer is neither replayed nor replaced.
    aborted = shards[0].one(txn.decision_write(abort("x1", (0, 1, 2), "t-1"), shards[0].store, shard_count=SHARDS,
                                               started_unix_ms=NOW_MS))
    assert isinstance(aborted, pb.TxnDecided) and not aborted.commit and not aborted.earlier_answer
    assert shards[0].store.requests["t-1"].kind == pb.REQUEST_KIND_PUT and value(shards, A) == b"1"


def test_the_coordinator_never_prepares() -> None:
    shards = cluster()
    refused = shards[0].one(txn.prepare_write("x", transfer(), 0, SHARDS, shards[0].store))
    assert isinstance(refused, errors.InvalidRequestError) and "coordinator" in str(refused)


def test_every_write_kind_is_refused_on_a_locked_key_until_the_resolve() -> None:
    shards = cluster(A=b"1", C=b"c")
    drive(shards, transfer(), resolve=False)
    s1, s2 = shards[1], shards[2]
    for shard, write in ((s1, write_of(kv.PutRequest(key=B, value=b"z"), 1)),
                         (s1, write_of(kv.DeleteRequest(key=B), 1)),
                         (s1, write_of(kv.TxnRequest(success=[get_op(B)]), 1)),
                         (s1, write_of(kv.ShardMutations(shard=1, mutations=[kv.Mutation(key=B, value=b"z")]), 1)),
                         (s2, write_of(kv.PutRequest(key=C, value=b"z"), 2))):
        answer = shard.one(write)
        assert isinstance(answer, errors.TxnConflictError), (write, answer)
        assert answer.definite and answer.retry_after_ms
    # A read of a key only read by the transaction (shared) is fine; other keys too.
    assert isinstance(s2.one(write_of(kv.TxnRequest(success=[get_op(C)]), 2)), kv.TxnResponse)
    assert isinstance(s1.one(write_of(kv.PutRequest(key=key_in(1, 2), value=b"z"), 1)), kv.PutResponse)


def test_the_coordinators_part_waits_for_locks_held_at_its_shard() -> None:
    shards = cluster(A=b"1", C=b"c")
    # Shard 0 holds a prepare of another transaction on A (one of an older release, applied as is:
    # no transaction has a coordinator below shard 0).
    lock = pb.WalEntry(request_id=prepare_id("held"), prepare=pb.TxnPrepare(
        txn_id="held", coordinator=0, participants=[0, 1], exclusive_keys=[A]))
    s0 = shards[0]
    s0.store.apply([(s0.store.applied_offset, lock.SerializeToString())], s0.store.applied_offset + 1)
    decided, _ = drive(shards, transfer(), resolve=False)
    assert isinstance(decided, errors.TxnConflictError) and decided.definite  # parked, then refused: nothing queued


def test_a_batch_sees_its_own_prepares_and_resolves() -> None:
    shards = cluster(B=b"1")
    s1 = shards[1]
    req = kv.TxnRequest(success=[put_op(A, b"2"), put_op(B, b"2")])
    plan = s1.run([txn.prepare_write("p", req, 1, SHARDS, s1.store), write_of(kv.PutRequest(key=B, value=b"z"), 1)])
    assert [type(a).__name__ for _, a in plan.now] == ["TxnConflictError"]  # locked by the prepare before it
    plan = s1.run([txn.resolve_write(pb.TxnResolve(txn_id="p", commit=True, succeeded=True)),
                   write_of(kv.PutRequest(key=B, value=b"z"), 1)])
    assert not plan.now and len(plan.payloads) == 2  # released by the resolve before it
    assert value(shards, B) == b"z"
    state = s1.store.get(B)
    assert state is not None and state.version == 3  # the resolve's put, then this one


def test_a_prepare_conflicting_with_an_attempt_of_the_same_request_says_so() -> None:
    shards = cluster(A=b"1")
    drive(shards, transfer("same"), "first", resolve=False)
    retry = shards[1].one(txn.prepare_write("second", transfer("same"), 1, SHARDS, shards[1].store))
    assert isinstance(retry, errors.TxnConflictError) and retry.same_request and retry.info()["same_request"]
    other = shards[1].one(txn.prepare_write("third", transfer("another"), 1, SHARDS, shards[1].store))
    assert isinstance(other, errors.TxnConflictError) and not other.same_request


def test_records_are_exactly_once_and_the_first_decision_wins() -> None:
    shards = cluster(A=b"1", C=b"c")
    decided, votes = drive(shards, transfer(), resolve=False)
    assert isinstance(decided, pb.TxnDecided)
    # A retried prepare replays its vote; it does not lock twice.
    again = shards[1].one(txn.prepare_write("x1", transfer(), 1, SHARDS, shards[1].store))
    assert again == votes[1]
    # T1: an abort asked after the commit is answered with the commit; nothing is appended.
    revision = shards[0].store.applied_offset
    replayed = shards[0].one(txn.decision_write(abort("x1", (0, 1, 2)), shards[0].store, shard_count=SHARDS,
                                                started_unix_ms=NOW_MS))
    assert replayed == decided and shards[0].store.applied_offset == revision
    # Resolves are idempotent too.
    resolve = txn.resolve_write(pb.TxnResolve(txn_id="x1", commit=True, succeeded=True))
    shards[1].one(resolve)
    end = shards[1].store.applied_offset
    assert isinstance(shards[1].one(resolve), pb.TxnResolve) and shards[1].store.applied_offset == end
    assert value(shards, B) == b"1"


def test_a_decision_outlives_the_request_id_table() -> None:
    """T3: the coordinator's request-id table forgot the decision's id (by count, fast, or by
    time); the decision table still answers a resolver that comes back, however late, and an
    abort is never recorded over it."""
    shards = cluster(A=b"1", C=b"c")
    shards[0].store.max_request_ids = 4
    decided, _ = drive(shards, transfer(), resolve=False)
    assert isinstance(decided, pb.TxnDecided) and decided.commit
    shards[0].now_ms = NOW_MS + 60_000  # a minute later...
    for i in range(10):  # ...other writes push the decision's id (and the client's) out of the table
        shards[0].one(write_of(kv.PutRequest(key=key_in(0, 3 + i), value=b"v", request_id=f"w{i}"), 0))
    assert decision_id("x1") not in shards[0].store.requests and shards[0].store.evicted_through_ms
    prepared = shards[1].store.locks.prepared_txn("x1")
    assert prepared is not None
    # A resolver's abort, long after: its prepare's first attempt is far past any horizon.
    late = txn.Decide(pb.TxnDecision(txn_id="x1", participants=[0, 1, 2], reason="in doubt",
                                     request_id=prepared.prepare.request_id),
                      prepared.prepare.first_attempt_unix_ms)
    revision = shards[0].store.applied_offset
    answered = shards[0].one(txn.decision_write(late, shards[0].store, shard_count=SHARDS,
                                                started_unix_ms=NOW_MS + 7_200_000))
    assert isinstance(answered, pb.TxnDecided) and answered.commit and answered.succeeded
    assert shards[0].store.applied_offset == revision  # answered from the decision table: nothing appended
    # A retry of the client's request is answered with the commit from the decision table too,
    # though the request-id table forgot the client's id (T5).
    shards[0].now_ms = NOW_MS + 2 * 60_000
    retry = shards[0].one(txn.decision_write(abort("x9", (0, 1, 2), "t-1"), shards[0].store, shard_count=SHARDS,
                                             started_unix_ms=NOW_MS + 2 * 60_000))
    assert isinstance(retry, pb.TxnDecided) and not retry.commit and retry.earlier_answer == answered.answer
    # The old rule (the simulation's mutation decision-in-request-table) refuses it as expired.
    old = shards[0].one(txn.decision_write(late, shards[0].store, shard_count=SHARDS, request_table_only=True,
                                            started_unix_ms=NOW_MS))
    assert isinstance(old, errors.RequestExpiredError)


def test_a_forgotten_decision_still_answers_and_then_refuses_a_stale_abort() -> None:
    """T1 after a forget: the decision leaves a tombstone in the request-id table that answers a
    late question with it; once even that is forgotten, an abort asked before the forget (a
    resolver that checked its prepare, then stalled) is refused as expired, never appended as a
    second decision. A fresh question about a transaction never decided is accepted."""
    shards = cluster(A=b"1", C=b"c")
    decided, _ = drive(shards, transfer())
    s0 = shards[0]
    s0.one(txn.forget_write(["x1"], s0.store))
    assert s0.store.decided_txn("x1") is None and forgotten_id("x1") in s0.store.requests
    stale = abort("x1", (0, 1, 2), "t-1")
    answered = s0.one(txn.decision_write(stale, s0.store, shard_count=SHARDS, started_unix_ms=NOW_MS))
    assert isinstance(answered, pb.TxnDecided) and answered.commit and answered.answer == decided.answer
    s0.store.max_request_ids = 2
    s0.now_ms = NOW_MS + 60_000
    s0.one(write_of(kv.PutRequest(key=key_in(0, 3), value=b"v", request_id="w0"), 0))
    assert decision_id("x1") not in s0.store.requests and forgotten_id("x1") in s0.store.requests
    tombstone = s0.one(txn.decision_write(stale, s0.store, shard_count=SHARDS, started_unix_ms=NOW_MS))
    assert isinstance(tombstone, pb.TxnDecided) and tombstone.commit  # the tombstone answers
    for i in range(1, 4):  # a minute later, its tombstone forgotten by count too
        s0.one(write_of(kv.PutRequest(key=key_in(0, 3 + i), value=b"v", request_id=f"w{i}"), 0))
    assert forgotten_id("x1") not in s0.store.requests and decision_id("x1") not in s0.store.requests
    end = s0.store.applied_offset
    refused = s0.one(txn.decision_write(stale, s0.store, shard_count=SHARDS, started_unix_ms=NOW_MS))
    assert isinstance(refused, errors.RequestExpiredError) and s0.store.applied_offset == end
    s0.now_ms = NOW_MS + 2 * 60_000
    fresh = s0.one(txn.decision_write(abort("never", (0, 1)), s0.store, shard_count=SHARDS,
                                      started_unix_ms=NOW_MS + 2 * 60_000))
    assert isinstance(fresh, pb.TxnDecided) and not fresh.commit


def test_an_abort_first_makes_the_drivers_commit_an_abort() -> None:
    shards = cluster(A=b"1")
    req = transfer()
    parts = txn.participants(req, SHARDS)
    votes = {s: shards[s].one(txn.prepare_write("x1", req, s, SHARDS, shards[s].store)) for s in parts[1:]}
    first = shards[0].one(txn.decision_write(abort("x1", parts, "t-1"), shards[0].store, shard_count=SHARDS,
                                             started_unix_ms=NOW_MS))
    commit = txn.Decide(pb.TxnDecision(txn_id="x1", commit=True, participants=parts, request_id="t-1"), NOW_MS, req,
                        votes)
    late = shards[0].one(txn.decision_write(commit, shards[0].store, shard_count=SHARDS, started_unix_ms=NOW_MS))
    assert late == first and not late.commit and value(shards, A) == b"1"
    assert shards[0].store.requests["t-1"].kind == pb.REQUEST_KIND_TXN_ABORTED


def test_a_client_request_committed_before_aborts_a_later_attempt_and_replays() -> None:
    shards = cluster(A=b"1", C=b"c")
    first, _ = drive(shards, transfer("once"), "a1")
    assert isinstance(first, pb.TxnDecided) and first.commit
    shards_after = value(shards, B)
    second, _ = drive(shards, transfer("once", expect=b"0"), "a2")
    assert isinstance(second, pb.TxnDecided) and not second.commit and second.earlier_answer
    earlier = kv.TxnResponse.FromString(second.earlier_answer)
    assert earlier.succeeded and earlier.result.revision == first.revision
    assert value(shards, B) == shards_after and value(shards, A) == b"0"
    assert not any(s.store.locks.has_locks() for s in shards)
    # An abort of yet another attempt (it met a lock, say) is answered with the commit too.
    third = shards[0].one(txn.decision_write(abort("a3", (0, 1, 2), "once"), shards[0].store, shard_count=SHARDS,
                                             started_unix_ms=NOW_MS))
    assert isinstance(third, pb.TxnDecided) and not third.commit and third.earlier_answer == second.earlier_answer


def test_a_resolve_of_a_transaction_not_prepared_here_is_kept_and_refuses_a_late_prepare() -> None:
    shards = cluster()
    s1 = shards[1]
    answer = s1.one(txn.resolve_write(pb.TxnResolve(txn_id="lost", commit=False)))
    assert isinstance(answer, pb.TxnResolve)
    assert resolve_id("lost") in s1.store.requests
    late = s1.one(txn.prepare_write("lost", transfer(), 1, SHARDS, s1.store))
    assert isinstance(late, errors.TxnConflictError) and "already resolved" in str(late)
    # Applied as skipped, had a prepare been appended anyway (every replayer alike).
    prepare = pb.WalEntry(request_id=prepare_id("lost"), prepare=pb.TxnPrepare(txn_id="lost", exclusive_keys=[B]))
    applied = s1.store.apply([(s1.store.applied_offset, prepare.SerializeToString())], s1.store.applied_offset + 1)
    assert applied.txn_skipped == 1 and not s1.store.locks.has_locks()


def test_a_prepare_so_late_its_resolve_may_be_forgotten_is_refused_as_expired() -> None:
    shards = cluster()
    late = shards[1].one(txn.prepare_write("x", transfer(), 1, SHARDS, shards[1].store,
                                           started_unix_ms=NOW_MS - 2 * limits.REQUEST_ID_HORIZON_MS))
    assert isinstance(late, errors.RequestExpiredError) and not shards[1].store.locks.has_locks()


def test_limits_prepared_and_answer_size() -> None:
    shards = cluster()
    many = LockIndex(PreparedTxn(pb.TxnPrepare(txn_id=f"t{i}"), i, 0) for i in range(limits.MAX_PREPARED_TXNS))
    shards[1].store.locks = many
    refused = shards[1].one(txn.prepare_write("x", transfer(), 1, SHARDS, shards[1].store))
    assert isinstance(refused, errors.OverloadedError) and "MAX_PREPARED_TXNS" in str(refused)
    big = {0: pb.TxnVote(compares_held=True, success=pb.TxnBranch(op_indices=[0], results=kv.TxnResponse(
        results=[kv.TxnOpResult(get=kv.GetResponse(found=True, kv=kv.KeyValue(key=A, value=b"v" * 600)))]
    ).SerializeToString()))}
    big[1] = pb.TxnVote(compares_held=True, success=pb.TxnBranch(op_indices=[1], results=big[0].success.results))
    req = kv.TxnRequest(success=[get_op(A), get_op(B)])
    assert txn.combine(req, big, 0).succeeded
    with pytest.raises(errors.InvalidRequestError, match="MAX_RESPONSE_BYTES"):
        txn.combine(req, big, 0, max_response_bytes=1000)


def test_an_answer_too_large_is_refused_at_the_decision() -> None:
    shards = cluster(A=b"a" * 700, B=b"b" * 700)
    req = kv.TxnRequest(request_id="big", success=[get_op(A), get_op(B)])
    parts = txn.participants(req, SHARDS)
    votes = {1: shards[1].one(txn.prepare_write("x", req, 1, SHARDS, shards[1].store))}
    commit = txn.Decide(pb.TxnDecision(txn_id="x", commit=True, participants=parts, request_id="big"), NOW_MS, req,
                        votes)
    refused = shards[0].one(txn.decision_write(commit, shards[0].store, shard_count=SHARDS, max_answer_bytes=1000,
                                               started_unix_ms=NOW_MS))
    assert isinstance(refused, errors.InvalidRequestError) and "MAX_RESPONSE_BYTES" in str(refused)
    assert shards[0].store.decided_txn("x") is None


def test_a_participant_part_too_large_or_malformed_is_refused_at_prepare() -> None:
    shards = cluster(C=b"c" * 5000)
    req = kv.TxnRequest(success=[put_op(A, b"1"), get_op(C)])
    small = txn.prepare_write("x", req, 2, SHARDS, shards[2].store)
    plan = plan_batch([dataclasses.replace(small, locked_build=lambda lookup, locks, rev, _h: txn.evaluate_prepare(
        "x", req, 2, SHARDS, lookup, rev, max_response_bytes=1000))], 0, shards[2].store.get, shards[2].store,
        NOW_MS, WIDE)
    assert isinstance(plan.now[0][1], errors.InvalidRequestError)
    bad = kv.TxnRequest(compares=[kv.Compare(key=B, target=kv.Compare.TARGET_VERSION, op=9)],
                        success=[put_op(A, b"1")])
    refused = shards[1].one(txn.prepare_write("y", bad, 1, SHARDS, shards[1].store))
    assert isinstance(refused, errors.InvalidRequestError)


# ---- locks ---------------------------------------------------------------------------------------------------


def prepared(txn_id: str, shared: Sequence[bytes] = (), exclusive: Sequence[bytes] = (), rid: str = "") -> PreparedTxn:
    return PreparedTxn(pb.TxnPrepare(txn_id=txn_id, shared_keys=shared, exclusive_keys=exclusive, request_id=rid), 1, 0)


@pytest.mark.parametrize(("held", "exclusive", "shared", "refused"), [
    ("shared", [A], [], True),  # a write of a read-locked key
    ("shared", [], [A], False),  # two readers
    ("exclusive", [], [A], True),  # a read of a write-locked key
    ("exclusive", [A], [], True),
    ("exclusive", [B], [C], False),  # other keys
])
def test_conflict_table(held: str, exclusive: list[bytes], shared: list[bytes], refused: bool) -> None:
    index = LockIndex([prepared("h", shared=[A] if held == "shared" else [],
                                exclusive=[A] if held == "exclusive" else [])])
    result = conflict(index, exclusive=exclusive, shared=shared)
    assert (result is not None) == refused
    assert conflict(index, exclusive=exclusive, shared=shared, own_txn="h") is None  # a resolve of its own
    assert conflict(NO_LOCKS, exclusive=[A], shared=[A]) is None


def test_lock_index_and_batch_locks() -> None:
    index = LockIndex([prepared("a", shared=[A], exclusive=[B]), prepared("b", shared=[A])])
    assert index.lock_holders(A) == {"a": False, "b": False} and index.prepared_count() == 2
    index.change({"a": None, "zzz": None, "c": prepared("c", exclusive=[C])})
    assert index.lock_holders(A) == {"b": False} and index.lock_holders(B) == {} and index.lock_holders(C)
    assert [p.txn_id for p in index.prepared()] == ["b", "c"]
    batch = BatchLocks(index)
    assert batch.lock_holders(A) == {"b": False}
    evaluation = txn.evaluate_resolve(pb.TxnResolve(txn_id="b"), index.prepared_txn("b"))
    batch.planned(evaluation)
    assert batch.lock_holders(A) == {} and batch.prepared_txn("b") is None and batch.prepared_txn("c") is not None
    batch.planned(dataclasses.replace(evaluation, releases="", locks=prepared("d", exclusive=[A])))
    assert batch.lock_holders(A) == {"d": True} and batch.prepared_count() == 3 and batch.has_locks()
    assert sorted(p.txn_id for p in batch.prepared()) == ["c", "d"] and NO_LOCKS.prepared() == []
    assert NO_LOCKS.prepared_count() == 0 and NO_LOCKS.prepared_txn("x") is None and NO_LOCKS.lock_holders(A) == {}
    both = LockIndex([prepared("e", shared=[A], exclusive=[A])])  # a key read and written: exclusive, once
    assert both.lock_holders(A) == {"e": True}
    both.remove("e")
    assert not both.has_locks() and both.lock_holders(A) == {}


# ---- applying the records (every replayer alike) -----------------------------------------------------------


def entry(**fields: Any) -> bytes:
    return pb.WalEntry(**fields).SerializeToString()


PREPARE = pb.TxnPrepare(txn_id="t", coordinator=0, participants=[0, 1], exclusive_keys=[A],
                        success=pb.TxnBranch(effects=[pb.Effect(put=pb.PutEffect(key=A, value=b"1"))]))
RESOLVE = pb.TxnResolve(txn_id="t", commit=True, succeeded=True)
EFFECTS = [pb.Effect(put=pb.PutEffect(key=A, value=b"1"))]


DECISION = pb.TxnDecision(txn_id="t", participants=[0, 1], kept=True)


@pytest.mark.parametrize(("name", "payload"), [
    ("two kinds", entry(request_id=prepare_id("t"), prepare=PREPARE, resolve=RESOLVE)),
    ("prepare under another id", entry(request_id="t", prepare=PREPARE)),
    ("prepare with effects", entry(request_id=prepare_id("t"), prepare=PREPARE, effects=EFFECTS)),
    ("prepare without a txn id", entry(request_id=prepare_id(""), prepare=pb.TxnPrepare())),
    ("decision under another id", entry(request_id=prepare_id("t"), decision=DECISION)),
    ("abort decision with effects", entry(request_id=decision_id("t"), decision=DECISION, effects=EFFECTS)),
    ("decision of one participant", entry(request_id=decision_id("t"), decision=pb.TxnDecision(
        txn_id="t", participants=[0]))),
    ("resolve under another id", entry(request_id="r", resolve=RESOLVE, effects=EFFECTS)),
    ("forget with a request id", entry(request_id="f", forget=pb.TxnForget(txn_ids=["t"]))),
    ("forget with effects", entry(forget=pb.TxnForget(txn_ids=["t"]), effects=EFFECTS)),
    ("forget and decision", entry(request_id=decision_id("t"), decision=DECISION,
                                  forget=pb.TxnForget(txn_ids=["t"]))),
])
def test_hostile_transaction_records_are_counted_and_skipped(name: str, payload: bytes) -> None:
    store = MemoryShard()
    applied = store.apply([(0, payload)], 1)
    assert applied.txn_skipped == 1 and not applied.writes and not store.requests and not store.locks.has_locks()
    assert not store.decisions


def test_apply_prepare_resolve_and_orphans() -> None:
    store = MemoryShard()
    records = [(0, entry(request_id=prepare_id("t"), prepare=PREPARE, leader_unix_ms=NOW_MS)),
               (1, entry(request_id=prepare_id("t2"), prepare=pb.TxnPrepare(txn_id="t"))),  # prepared already
               (2, entry(request_id=resolve_id("t"), resolve=RESOLVE, effects=EFFECTS)),
               (3, entry(request_id=resolve_id("u"), resolve=pb.TxnResolve(txn_id="u", commit=True), effects=EFFECTS)),
               (4, entry(request_id=prepare_id("t"), prepare=PREPARE))]  # a duplicate id
    applied = store.apply(records[:1], 1)
    assert applied.prepared["t"] == PreparedTxn(PREPARE, 0, NOW_MS)
    applied = store.apply(records[1:], 5)
    assert applied.txn_skipped == 1 + 1 and applied.duplicates == 1
    assert applied.prepared == {"t": None}
    state = store.get(A)
    assert state is not None and state.mod_revision == 2
    assert [c.revision for c in applied.changes] == [2]  # the orphan resolve at 3 applied nothing
    assert resolve_id("u") in store.requests and not store.locks.has_locks()


def test_apply_in_one_call_sees_its_own_prepares() -> None:
    records = [(0, entry(request_id=prepare_id("t"), prepare=PREPARE)),
               (1, entry(request_id=resolve_id("t"), resolve=RESOLVE, effects=EFFECTS))]
    applied = apply_entries(lambda k: None, lambda r: False, records, prepared=lambda t: None)
    assert applied.prepared == {"t": None} and [c.key for c in applied.changes] == [A]
    # A replayer without transaction state (prepared=None) sees every resolve as an orphan.
    alone = apply_entries(lambda k: None, lambda r: False, records[1:])
    assert alone.txn_skipped == 1 and not alone.changes


def test_apply_decision_records_the_client_id_once() -> None:
    answer = kv.TxnResponse(succeeded=True).SerializeToString()
    commit = pb.TxnDecision(txn_id="t", commit=True, participants=[0, 1], request_id="client", answer=answer,
                            kept=True)
    records = [(0, entry(request_id=decision_id("t"), decision=commit)),
               (1, entry(request_id=decision_id("t"), decision=DECISION)),  # a second, same id: skipped
               (2, entry(request_id=decision_id("v"), decision=pb.TxnDecision(
                   txn_id="v", commit=True, participants=[0, 1], request_id="client", answer=b"x", kept=True))),
               (3, entry(request_id=decision_id("w"), decision=pb.TxnDecision(
                   txn_id="w", commit=True, participants=[0, 1], request_id=prepare_id("w"), answer=b"x",
                   kept=True)))]
    store = MemoryShard()
    applied = store.apply(records, 4)
    assert applied.duplicates == 1
    assert store.requests["client"].response == answer and store.requests["client"].kind == pb.REQUEST_KIND_TXN
    assert store.requests["client"].revision == 0
    assert set(store.requests) == {decision_id("t"), "client", decision_id("v"), decision_id("w")}
    assert sorted(store.decisions) == ["t", "v", "w"] and store.decisions["t"].decision == commit
    plain = apply_entries(lambda k: None, lambda r: False, records)  # without a table of its own
    # A record's ids in id order (the table keeps (revision, id) order, however batches are cut).
    assert [r.request_id for r in plain.requests] == ["client", decision_id("t"), decision_id("v"), decision_id("w")]


def test_apply_decision_table_commit_effects_abort_outcome_and_forget() -> None:
    """The decision table, through the one apply: a commit applies the coordinator's effects;
    an abort records the client's id as failed; a second decision of a txn id (under a
    forgotten id) is skipped; a forget removes what it names, in order, within one apply."""
    commit = pb.TxnDecision(txn_id="c", commit=True, succeeded=True, participants=[0, 2], request_id="rc", kept=True)
    decided = pb.TxnDecided(commit=True, succeeded=True, answer=kv.TxnResponse(succeeded=True).SerializeToString())
    records = [
        (0, entry(request_id=decision_id("c"), decision=commit, effects=EFFECTS, response=decided.SerializeToString(),
                  leader_unix_ms=NOW_MS)),
        (1, entry(request_id=decision_id("a"), decision=pb.TxnDecision(txn_id="a", participants=[0, 1],
                                                                         request_id="ra", reason="conflict",
                                                                         kept=True))),
        (2, entry(request_id="other id", decision=pb.TxnDecision(txn_id="c", participants=[0, 2]))),  # malformed
        (3, entry(forget=pb.TxnForget(txn_ids=["a", "nothing"]))),
    ]
    store = MemoryShard()
    applied = store.apply(records[:3], 3)
    assert applied.txn_skipped == 1 and [c.key for c in applied.changes] == [A]
    assert store.decided_txn("c") == applied.decided["c"] and store.decided_txn("c").leader_unix_ms == NOW_MS
    assert store.decided_txn("c").decided().answer == decided.answer and store.decided_txn("c").decided().revision == 0
    assert store.requests["rc"].response == decided.answer  # the answer from the response, the record carries none
    aborted = store.requests["ra"]
    assert aborted.kind == pb.REQUEST_KIND_TXN_ABORTED and pb.TxnDecided.FromString(aborted.response).reason
    # The same txn id decided again under a fresh id (the old one forgotten): never applied (T1).
    again = store.apply([(3, entry(request_id=decision_id("c"), decision=commit, effects=EFFECTS))], 4)
    assert again.duplicates == 1
    with_table = apply_entries(lambda k: None, lambda r: False,
                               [(9, entry(request_id=decision_id("c"), decision=commit, effects=EFFECTS))],
                               decided=store.decided_txn)
    assert with_table.txn_skipped == 1 and not with_table.changes
    forgot = store.apply([(4, records[3][1])], 5)
    assert forgot.decided == {"a": None} and [d.txn_id for d in store.decided()] == ["c"]
    one_call = apply_entries(lambda k: None, lambda r: False, [records[1], records[3]], decided=lambda t: None)
    assert one_call.decided == {"a": None}


def test_a_memory_replica_copy_keeps_the_locks_and_decisions() -> None:
    store = MemoryShard()
    store.apply([(0, entry(request_id=prepare_id("t"), prepare=PREPARE)),
                 (1, entry(request_id=decision_id("d"), decision=pb.TxnDecision(txn_id="d", participants=[0, 1],
                                                                                kept=True)))], 2)
    copy = store.copy()
    fresh = MemoryShard()
    fresh.load(copy)
    assert fresh.locks.lock_holders(A) == {"t": True} and list(fresh.decisions) == ["d"]
    fresh.wipe()
    assert not fresh.locks.has_locks() and copy.locks.has_locks() and not fresh.decisions and copy.decisions


def test_replayed_records_answer_with_their_recorded_answers() -> None:
    shards = cluster(A=b"1")
    shards[1].one(txn.prepare_write("x", transfer(), 1, SHARDS, shards[1].store))
    write = txn.prepare_write("x", transfer(), 1, SHARDS, shards[1].store)
    assert isinstance(admit(write, shards[1].store, (), NOW_MS), pb.TxnVote)
    with pytest.raises(AssertionError, match="locked_build"):
        write.build(lambda k: None, 0)


# ---- found by attacking the protocol (each once reproduced against the code) --------------------------------


def test_a_records_ids_are_kept_in_id_order_however_the_batches_are_cut() -> None:
    """A decision records two ids at one revision (its own and its client's): a table must keep
    and forget them in the same order whether the record was applied alone or in a batch."""
    def put(rid: str, key: bytes) -> bytes:
        return pb.WalEntry(request_id=rid, effects=[pb.Effect(put=pb.PutEffect(key=key, value=b"v"))],
                           leader_unix_ms=NOW_MS, request_kind=pb.REQUEST_KIND_PUT).SerializeToString()

    decision = pb.WalEntry(request_id=decision_id("T"), decision=pb.TxnDecision(
        txn_id="T", participants=[0, 1], request_id="X", reason="conflict", kept=True),
        leader_unix_ms=NOW_MS, request_kind=pb.REQUEST_KIND_TXN_DECISION).SerializeToString()
    records = [(0, put("a", b"k1")), (1, decision), (2, put("b", b"k2"))]
    together, apart = MemoryShard(max_request_ids=2), MemoryShard(max_request_ids=2)
    together.apply(records, 3)
    for offset, payload in records:
        apart.apply([(offset, payload)], offset + 1)
    assert together.requests == apart.requests and together.evicted_through_ms == apart.evicted_through_ms


@pytest.mark.parametrize("put_first", [False, True])
def test_a_request_id_reused_by_a_put_in_the_decisions_batch_is_refused(put_first: bool) -> None:
    """One client request id for a cross-shard Txn and a Put planned in the same batch: the later
    of the two sees the earlier's id as recorded and is refused (another kind), never
    acknowledged and then skipped at apply."""
    shards = cluster(A=b"1", C=b"c")
    req = transfer("X")
    parts = txn.participants(req, SHARDS)
    votes = {s: shards[s].one(txn.prepare_write("t1", req, s, SHARDS, shards[s].store, started_unix_ms=NOW_MS,
                                                first_attempt_unix_ms=NOW_MS)) for s in parts[1:]}
    commit = txn.Decide(pb.TxnDecision(txn_id="t1", commit=True, participants=parts, request_id="X"), NOW_MS, req,
                        votes)
    s0 = shards[0]
    decide = txn.decision_write(commit, s0.store, shard_count=SHARDS, started_unix_ms=NOW_MS)
    put = write_of(kv.PutRequest(key=key_in(0, 7), value=b"P", request_id="X", first_attempt_unix_ms=NOW_MS), 0)
    plan = s0.run([put, decide] if put_first else [decide, put])
    answers = dict(plan.now + plan.after_commit)
    first, later = answers[0], answers[1]
    assert isinstance(later, errors.InvalidRequestError) and "already used by" in str(later), later
    assert not isinstance(first, errors.StoreError)
    if put_first:
        assert value(shards, key_in(0, 7)) == b"P" and value(shards, A) == b"1"
    else:
        assert isinstance(first, pb.TxnDecided) and first.commit and value(shards, key_in(0, 7)) is None


def test_a_commit_without_its_txn_or_votes_is_refused_not_asserted() -> None:
    """An older release's driver sends a commit decision without the client's Txn and votes:
    refused definitely (nothing appended), never an assertion in the planner."""
    shards = cluster(A=b"1")
    bare = txn.Decide(pb.TxnDecision(txn_id="old", commit=True, participants=[0, 1], request_id="r"), NOW_MS)
    refused = shards[0].one(txn.decision_write(bare, shards[0].store, shard_count=SHARDS, started_unix_ms=NOW_MS))
    assert isinstance(refused, errors.InvalidRequestError) and shards[0].store.decided_txn("old") is None


def test_an_abort_held_in_the_decision_table_answers_a_retry_once_its_ids_are_forgotten() -> None:
    shards = cluster(A=b"1")
    s0 = shards[0]
    first = s0.one(txn.decision_write(abort("a1", (0, 1), "req"), s0.store, shard_count=SHARDS,
                                      started_unix_ms=NOW_MS))
    assert isinstance(first, pb.TxnDecided) and s0.store.requests["req"].kind == pb.REQUEST_KIND_TXN_ABORTED
    s0.store.max_request_ids = 2
    s0.now_ms = NOW_MS + 60_000
    for i in range(3):
        s0.one(write_of(kv.PutRequest(key=key_in(0, 3 + i), value=b"v", request_id=f"w{i}"), 0))
    assert "req" not in s0.store.requests and s0.store.decided_request("req") is not None
    s0.now_ms = NOW_MS + 120_000
    # A retry that failed in turn (a lock): its abort is answered with the recorded abort's reason.
    retry = abort("a2", (0, 1), "req", reason="locked again")
    again = s0.one(txn.decision_write(retry, s0.store, shard_count=SHARDS, started_unix_ms=NOW_MS + 120_000))
    assert isinstance(again, pb.TxnDecided) and not again.commit and again.reason == "timeout"
    assert value(shards, A) == b"1"


def test_the_second_decision_mutation_appends_a_second_decision() -> None:
    shards = cluster(A=b"1")
    s0 = shards[0]
    s0.one(txn.decision_write(abort("m", (0, 1)), s0.store, shard_count=SHARDS, started_unix_ms=NOW_MS))
    end = s0.store.applied_offset
    second = s0.one(txn.decision_write(abort("m", (0, 1)), s0.store, shard_count=SHARDS, started_unix_ms=NOW_MS,
                                       second_decision=True))
    assert isinstance(second, pb.TxnDecided) and s0.store.applied_offset > end  # appended (and skipped at apply)


def test_a_decision_whose_answer_is_hostile_still_answers_its_decision() -> None:
    decision = pb.TxnDecision(txn_id="h", commit=True, succeeded=True, participants=[0, 1], kept=True)
    kept = DecidedTxn(decision, 5, NOW_MS, b"\xff\xff not a TxnDecided")
    answered = kept.decided()
    assert answered.commit and answered.succeeded and answered.revision == 5


def test_a_restarted_memory_replica_knows_no_recent_write() -> None:
    store = MemoryShard()
    store.apply([(0, pb.WalEntry(effects=[pb.Effect(put=pb.PutEffect(key=A, value=b"1"))]).SerializeToString())], 1)
    assert store.recent.unchanged_since(1, keys=[A]) and not store.recent.unchanged_since(0, keys=[A])
    store.restarted()
    assert not store.recent.unchanged_since(0, keys=[A]) and store.recent.floor == 1
