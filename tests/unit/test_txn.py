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
    PreparedTxn,
    apply_entries,
    decision_id,
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

    def run(self, writes: Sequence[Write]) -> Plan:
        revision = self.store.applied_offset
        plan = plan_batch(writes, revision, self.store.get, self.store, NOW_MS, WIDE, locks=self.store.locks)
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


def drive(shards: list[Shard], req: kv.TxnRequest, txn_id: str = "x1", *, resolve: bool = True
          ) -> tuple[pb.TxnDecided | errors.StoreError, dict[int, Any]]:
    """The driver's course, step by step: prepare everywhere, decide at the coordinator, resolve."""
    parts = txn.participants(req, SHARDS)
    votes = {s: shards[s].one(txn.prepare_write(txn_id, req, s, SHARDS, shards[s].store)) for s in parts}
    prepared = {s: v for s, v in votes.items() if isinstance(v, pb.TxnVote)}
    if len(prepared) == len(parts):
        answer = txn.combine(req, prepared, parts[0])
        decision = pb.TxnDecision(txn_id=txn_id, commit=True, succeeded=answer.succeeded, participants=parts,
                                  request_id=req.request_id, answer=answer.SerializeToString())
    else:
        decision = pb.TxnDecision(txn_id=txn_id, participants=parts, reason="a participant refused")
    decided = shards[parts[0]].one(txn.decision_write(decision, shards[parts[0]].store))
    if resolve and isinstance(decided, pb.TxnDecided):
        for s in parts:
            shards[s].one(txn.resolve_write(pb.TxnResolve(txn_id=txn_id, commit=decided.commit,
                                                          succeeded=decided.succeeded, coordinator=parts[0])))
    return decided, votes


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


def test_a_committed_transaction_applies_in_every_participant_only_at_its_resolve() -> None:
    shards = cluster(A=b"1", C=b"c")
    decided, votes = drive(shards, transfer(), resolve=False)
    assert isinstance(decided, pb.TxnDecided) and decided.commit and decided.succeeded
    # T2: decided, not resolved: nothing applied, the keys locked.
    assert value(shards, A) == b"1" and value(shards, B) is None
    assert shards[0].store.locks.lock_holders(A) == {"x1": True}
    assert shards[2].store.locks.lock_holders(C) == {"x1": False}  # only read: shared
    for s in (0, 1, 2):
        shards[s].one(txn.resolve_write(pb.TxnResolve(txn_id="x1", commit=True, succeeded=True, coordinator=0)))
    assert value(shards, A) == b"0" and value(shards, B) == b"1" and value(shards, C) == b"c"
    assert not any(s.store.locks.has_locks() for s in shards)
    # The effects landed at the resolve's offset.
    a = shards[0].store.get(A)
    assert a is not None and a.mod_revision == shards[0].store.applied_offset - 2
    # The answer: every result in the client's order, the coordinator's shard and the decision's offset.
    answer = kv.TxnResponse.FromString(shards[0].store.requests["t-1"].response)
    assert answer.succeeded and answer.result.shard == 0 and answer.result.revision == decided.revision
    assert [r.WhichOneof("result") for r in answer.results] == ["put", "put", "get"]
    assert answer.results[2].get.kv.value == b"c" and answer.results[1].put.result.shard == 1
    assert votes[2].compares_held


def test_a_failed_compare_commits_the_failure_branch_everywhere() -> None:
    shards = cluster(A=b"2", C=b"c")
    decided, _ = drive(shards, transfer())
    assert isinstance(decided, pb.TxnDecided) and decided.commit and not decided.succeeded
    assert value(shards, A) == b"2" and value(shards, B) is None and value(shards, A2) == b"fail"
    answer = kv.TxnResponse.FromString(shards[0].store.requests["t-1"].response)
    assert not answer.succeeded and answer.results[0].get.kv.value == b"2"


def test_a_conflict_aborts_and_applies_nothing_anywhere() -> None:
    shards = cluster(A=b"1")
    other = kv.TxnRequest(success=[put_op(B, b"x"), put_op(C, b"y")])
    shards[1].one(txn.prepare_write("other", other, 1, SHARDS, shards[1].store))
    decided, votes = drive(shards, transfer())
    assert isinstance(votes[1], errors.TxnConflictError) and votes[1].txn_id == "other"
    assert isinstance(decided, pb.TxnDecided) and not decided.commit
    assert value(shards, A) == b"1" and value(shards, A2) is None
    assert shards[0].store.locks.lock_holders(A) == {}  # released by the abort's resolve
    assert "t-1" not in shards[0].store.requests  # an abort records no client id: a retry may run again


def test_every_write_kind_is_refused_on_a_locked_key_until_the_resolve() -> None:
    shards = cluster(A=b"1", C=b"c")
    drive(shards, transfer(), resolve=False)
    s0, s2 = shards[0], shards[2]
    for shard, write in ((s0, write_of(kv.PutRequest(key=A, value=b"z"), 0)),
                         (s0, write_of(kv.DeleteRequest(key=A), 0)),
                         (s0, write_of(kv.TxnRequest(success=[get_op(A)]), 0)),
                         (s0, write_of(kv.ShardMutations(shard=0, mutations=[kv.Mutation(key=A, value=b"z")]), 0)),
                         (s2, write_of(kv.PutRequest(key=C, value=b"z"), 2))):
        answer = shard.one(write)
        assert isinstance(answer, errors.TxnConflictError), (write, answer)
        assert answer.definite and answer.retry_after_ms
    # A read of a key only read by the transaction (shared) is fine; other keys too.
    assert isinstance(s2.one(write_of(kv.TxnRequest(success=[get_op(C)]), 2)), kv.TxnResponse)
    assert isinstance(s0.one(write_of(kv.PutRequest(key=key_in(0, 2), value=b"z"), 0)), kv.PutResponse)


def test_a_batch_sees_its_own_prepares_and_resolves() -> None:
    shards = cluster(A=b"1")
    s0 = shards[0]
    req = kv.TxnRequest(success=[put_op(A, b"2"), put_op(B, b"2")])
    plan = s0.run([txn.prepare_write("p", req, 0, SHARDS, s0.store), write_of(kv.PutRequest(key=A, value=b"z"), 0)])
    assert [type(a).__name__ for _, a in plan.now] == ["TxnConflictError"]  # locked by the prepare before it
    plan = s0.run([txn.resolve_write(pb.TxnResolve(txn_id="p", commit=True, succeeded=True)),
                   write_of(kv.PutRequest(key=A, value=b"z"), 0)])
    assert not plan.now and len(plan.payloads) == 2  # released by the resolve before it
    assert value(shards, A) == b"z"
    state = s0.store.get(A)
    assert state is not None and state.version == 3  # the resolve's put, then this one


def test_a_prepare_conflicting_with_an_attempt_of_the_same_request_is_an_unknown_outcome() -> None:
    shards = cluster(A=b"1")
    drive(shards, transfer("same"), "first", resolve=False)
    retry = shards[0].one(txn.prepare_write("second", transfer("same"), 0, SHARDS, shards[0].store))
    assert isinstance(retry, errors.TxnConflictError) and retry.same_request and retry.info()["same_request"]
    other = shards[0].one(txn.prepare_write("third", transfer("another"), 0, SHARDS, shards[0].store))
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
    abort = pb.TxnDecision(txn_id="x1", participants=[0, 1, 2], reason="resolver timeout")
    replayed = shards[0].one(txn.decision_write(abort, shards[0].store))
    assert replayed == decided and shards[0].store.applied_offset == revision
    # Resolves are idempotent too.
    resolve = txn.resolve_write(pb.TxnResolve(txn_id="x1", commit=True, succeeded=True))
    shards[1].one(resolve)
    end = shards[1].store.applied_offset
    assert isinstance(shards[1].one(resolve), pb.TxnResolve) and shards[1].store.applied_offset == end
    assert value(shards, B) == b"1"


def test_an_abort_first_makes_the_drivers_commit_an_abort() -> None:
    shards = cluster(A=b"1")
    req = transfer()
    parts = txn.participants(req, SHARDS)
    votes = {s: shards[s].one(txn.prepare_write("x1", req, s, SHARDS, shards[s].store)) for s in parts}
    first = shards[0].one(txn.decision_write(pb.TxnDecision(txn_id="x1", participants=parts, reason="timeout"),
                                             shards[0].store))
    answer = txn.combine(req, votes, 0)
    late = shards[0].one(txn.decision_write(pb.TxnDecision(
        txn_id="x1", commit=True, succeeded=True, participants=parts, request_id="t-1",
        answer=answer.SerializeToString()), shards[0].store))
    assert late == first and not late.commit and "t-1" not in shards[0].store.requests


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


def test_limits_prepared_and_answer_size() -> None:
    shards = cluster()
    many = LockIndex(PreparedTxn(pb.TxnPrepare(txn_id=f"t{i}"), i, 0) for i in range(limits.MAX_PREPARED_TXNS))
    shards[0].store.locks = many
    refused = shards[0].one(txn.prepare_write("x", transfer(), 0, SHARDS, shards[0].store))
    assert isinstance(refused, errors.OverloadedError) and "MAX_PREPARED_TXNS" in str(refused)
    big = {0: pb.TxnVote(compares_held=True, success=pb.TxnBranch(op_indices=[0], results=kv.TxnResponse(
        results=[kv.TxnOpResult(get=kv.GetResponse(found=True, kv=kv.KeyValue(key=A, value=b"v" * 600)))]
    ).SerializeToString()))}
    big[1] = pb.TxnVote(compares_held=True, success=pb.TxnBranch(op_indices=[1], results=big[0].success.results))
    req = kv.TxnRequest(success=[get_op(A), get_op(B)])
    assert txn.combine(req, big, 0).succeeded
    with pytest.raises(errors.InvalidRequestError, match="MAX_RESPONSE_BYTES"):
        txn.combine(req, big, 0, max_response_bytes=1000)


def test_a_participant_part_too_large_or_malformed_is_refused_at_prepare() -> None:
    shards = cluster(C=b"c" * 5000)
    req = kv.TxnRequest(success=[put_op(A, b"1"), get_op(C)])
    small = txn.prepare_write("x", req, 2, SHARDS, shards[2].store)
    plan = plan_batch([dataclasses.replace(small, locked_build=lambda lookup, locks, rev: txn.evaluate_prepare(
        "x", req, 2, SHARDS, lookup, rev, max_response_bytes=1000))], 0, shards[2].store.get, shards[2].store,
        NOW_MS, WIDE)
    assert isinstance(plan.now[0][1], errors.InvalidRequestError)
    bad = kv.TxnRequest(compares=[kv.Compare(key=A, target=kv.Compare.TARGET_VERSION, op=9)],
                        success=[put_op(B, b"1")])
    refused = shards[0].one(txn.prepare_write("y", bad, 0, SHARDS, shards[0].store))
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


@pytest.mark.parametrize(("name", "payload"), [
    ("two kinds", entry(request_id=prepare_id("t"), prepare=PREPARE, resolve=RESOLVE)),
    ("prepare under another id", entry(request_id="t", prepare=PREPARE)),
    ("prepare with effects", entry(request_id=prepare_id("t"), prepare=PREPARE, effects=EFFECTS)),
    ("prepare without a txn id", entry(request_id=prepare_id(""), prepare=pb.TxnPrepare())),
    ("decision under another id", entry(request_id=prepare_id("t"), decision=pb.TxnDecision(txn_id="t"))),
    ("decision with effects", entry(request_id=decision_id("t"), decision=pb.TxnDecision(txn_id="t"),
                                    effects=EFFECTS)),
    ("resolve under another id", entry(request_id="r", resolve=RESOLVE, effects=EFFECTS)),
])
def test_hostile_transaction_records_are_counted_and_skipped(name: str, payload: bytes) -> None:
    store = MemoryShard()
    applied = store.apply([(0, payload)], 1)
    assert applied.txn_skipped == 1 and not applied.writes and not store.requests and not store.locks.has_locks()


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
    commit = pb.TxnDecision(txn_id="t", commit=True, request_id="client", answer=answer)
    records = [(0, entry(request_id=decision_id("t"), decision=commit)),
               (1, entry(request_id=decision_id("t"), decision=pb.TxnDecision(txn_id="t"))),  # second: skipped
               (2, entry(request_id=decision_id("v"), decision=pb.TxnDecision(
                   txn_id="v", commit=True, request_id="client", answer=b"x"))),  # the client id again
               (3, entry(request_id=decision_id("w"), decision=pb.TxnDecision(
                   txn_id="w", commit=True, request_id=prepare_id("w"), answer=b"x")))]  # a reserved id
    store = MemoryShard()
    applied = store.apply(records, 4)
    assert applied.duplicates == 1
    assert store.requests["client"].response == answer and store.requests["client"].kind == pb.REQUEST_KIND_TXN
    assert store.requests["client"].revision == 0
    assert set(store.requests) == {decision_id("t"), "client", decision_id("v"), decision_id("w")}
    plain = apply_entries(lambda k: None, lambda r: False, records)  # without a table of its own
    assert [r.request_id for r in plain.requests] == [decision_id("t"), "client", decision_id("v"), decision_id("w")]


def test_a_memory_replica_copy_keeps_the_locks() -> None:
    store = MemoryShard()
    store.apply([(0, entry(request_id=prepare_id("t"), prepare=PREPARE))], 1)
    copy = store.copy()
    fresh = MemoryShard()
    fresh.load(copy)
    assert fresh.locks.lock_holders(A) == {"t": True}
    fresh.wipe()
    assert not fresh.locks.has_locks() and copy.locks.has_locks()


def test_replayed_records_answer_with_their_recorded_answers() -> None:
    shards = cluster(A=b"1")
    shards[0].one(txn.prepare_write("x", transfer(), 0, SHARDS, shards[0].store))
    write = txn.prepare_write("x", transfer(), 0, SHARDS, shards[0].store)
    assert isinstance(admit(write, shards[0].store, (), NOW_MS), pb.TxnVote)
    with pytest.raises(AssertionError, match="locked_build"):
        write.build(lambda k: None, 0)
