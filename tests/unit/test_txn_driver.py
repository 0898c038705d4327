"""`kvstore.core.txn_driver`: a cross-shard transaction's course, event by event; pure.

Each test feeds the driver events and checks the actions it asks for, as the replica machine's
table tests do; the last ones run it against memory replicas (tests/unit/test_txn.py's) through
a shell of a few lines, as a node or the simulation would."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore import errors
from kvstore.core import txn
from kvstore.core.txn_driver import (
    DecideAnswered,
    DriverConfig,
    Finished,
    Phase,
    PrepareAnswered,
    Reply,
    ResolveAnswered,
    SendDecide,
    SendPrepare,
    SendResolve,
    Started,
    Tick,
    TxnDriver,
    TxnMutation,
)
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.v1 import kv_pb2 as kv
from tests.unit.test_txn import SHARDS, A, Shard, cluster, transfer, value

NOW = 1_800_000_000_000
CONFIG = DriverConfig(shard_count=SHARDS, max_attempts=3, backoff_first_ms=10, backoff_max_ms=40,
                      resolve_wait_ms=100)


def begin(req: kv.TxnRequest | None = None, deadline_ms: float = 1_000, **config: Any) -> TxnDriver:
    cfg = DriverConfig(**{**CONFIG.__dict__, **config})
    return TxnDriver.begin(cfg, "x1", req or transfer(), now_unix_ms=NOW, deadline_ms=deadline_ms)


def vote(shard: int, held: bool = True, req: kv.TxnRequest | None = None) -> pb.TxnVote:
    """A participant's vote as it would answer (results of the right shape)."""
    part = txn.part_of(req or transfer(), shard, SHARDS)
    results = kv.TxnResponse(results=[kv.TxnOpResult(get=kv.GetResponse()) for _ in part.success])
    failure = kv.TxnResponse(results=[kv.TxnOpResult(get=kv.GetResponse()) for _ in part.failure])
    return pb.TxnVote(
        compares_held=held,
        success=pb.TxnBranch(op_indices=[i for i, _ in part.success], results=results.SerializeToString()),
        failure=pb.TxnBranch(op_indices=[i for i, _ in part.failure], results=failure.SerializeToString()))


def names(actions: list[Any]) -> list[str]:
    out = []
    for a in actions:
        if isinstance(a, SendPrepare | SendResolve):
            out.append(f"{type(a).__name__}({a.shard})")
        elif isinstance(a, SendDecide):
            out.append(f"SendDecide({'commit' if a.decision.commit else 'abort'})")
        elif isinstance(a, Reply):
            out.append(f"Reply({type(a.answer).__name__})")
        else:
            assert isinstance(a, Finished)
            out.append(f"Finished({a.committed})")
    return out


def prepared_all(driver: TxnDriver, now: float = 1) -> list[Any]:
    out: list[Any] = []
    for shard in driver.participants:
        out = driver.step(PrepareAnswered(shard, vote(shard)), now_ms=now)
    return out


def test_the_happy_course() -> None:
    d = begin()
    assert names(d.step(Started(), now_ms=0)) == ["SendPrepare(0)", "SendPrepare(1)", "SendPrepare(2)"]
    assert d.step(PrepareAnswered(0, vote(0)), now_ms=1) == []
    d.step(PrepareAnswered(1, vote(1)), now_ms=1)
    decide = d.step(PrepareAnswered(2, vote(2)), now_ms=1)
    assert names(decide) == ["SendDecide(commit)"] and d.commit_sent
    assert isinstance(decide[0], SendDecide) and decide[0].shard == 0 and decide[0].first_attempt_unix_ms == NOW
    resolves = d.step(DecideAnswered(pb.TxnDecided(commit=True, succeeded=True, revision=42)), now_ms=2)
    assert names(resolves) == ["SendResolve(0)", "SendResolve(1)", "SendResolve(2)"]
    assert d.step(ResolveAnswered(0, pb.TxnResolve()), now_ms=3) == []
    d.step(ResolveAnswered(1, pb.TxnResolve()), now_ms=3)
    done = d.step(ResolveAnswered(2, pb.TxnResolve()), now_ms=3)
    assert names(done) == ["Reply(TxnResponse)", "Finished(True)"]
    reply = done[0]
    assert isinstance(reply, Reply) and isinstance(reply.answer, kv.TxnResponse)
    assert reply.answer.succeeded and reply.answer.result.revision == 42 and reply.answer.result.shard == 0
    assert d.step(Tick(), now_ms=5) == [] and d.wake_at_ms() is None


def test_a_conflict_is_answered_at_once_and_aborted() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    out = d.step(PrepareAnswered(1, errors.TxnConflictError("locked", txn_id="o")), now_ms=1)
    assert names(out) == ["Reply(TxnConflictError)", "SendDecide(abort)"]
    assert d.step(PrepareAnswered(0, vote(0)), now_ms=2) == []  # late: moved on
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False)), now_ms=3)
    assert names(out) == ["SendResolve(0)", "SendResolve(1)", "SendResolve(2)"]
    assert all(isinstance(a, SendResolve) and not a.resolve.commit for a in out)
    assert d.wake_at_ms() == 103
    assert names(d.step(Tick(), now_ms=200)) == ["Finished(False)"]  # the resolves' wait is bounded


def test_a_prepare_retry_pending_at_the_abort_is_dropped() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    d.step(PrepareAnswered(2, errors.UnavailableError("x")), now_ms=1)  # a retry at 11
    d.step(PrepareAnswered(1, errors.TxnConflictError("locked")), now_ms=2)
    assert d.step(Tick(), now_ms=11) == []


def test_an_earlier_attempt_still_prepared_makes_the_outcome_unknown() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    out = d.step(PrepareAnswered(0, errors.TxnConflictError("x", txn_id="old", same_request=True)), now_ms=1)
    assert names(out) == ["Reply(UnknownOutcomeError)", "SendDecide(abort)"]


@pytest.mark.parametrize("error", [errors.UnavailableError("x"), errors.UnknownOutcomeError("x"),
                                   errors.NotLeaderError(1, None)])
def test_a_prepare_is_retried_then_the_transaction_aborted_definitely(error: errors.StoreError) -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    assert d.step(PrepareAnswered(1, error), now_ms=1) == []
    assert d.wake_at_ms() == 11
    assert d.step(Tick(), now_ms=5) == []
    assert names(d.step(Tick(), now_ms=11)) == ["SendPrepare(1)"]
    d.step(PrepareAnswered(1, error), now_ms=12)
    assert names(d.step(Tick(), now_ms=40)) == ["SendPrepare(1)"]
    out = d.step(PrepareAnswered(1, error), now_ms=41)  # the third attempt: max_attempts
    assert names(out) == ["Reply(UnavailableError)", "SendDecide(abort)"]
    reply = out[0]
    assert isinstance(reply, Reply) and isinstance(reply.answer, errors.StoreError) and reply.answer.definite


def test_invalid_and_oversized_answers_abort_with_their_error() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    assert names(d.step(PrepareAnswered(0, errors.InvalidRequestError("bad")), now_ms=1))[0] == \
        "Reply(InvalidRequestError)"
    big = kv.TxnRequest(success=[kv.TxnOp(get=kv.GetRequest(key=A)), kv.TxnOp(get=kv.GetRequest(key=b"k1"))])
    d = begin(big)
    d.step(Started(), now_ms=0)
    votes = {s: vote(s, req=big) for s in d.participants}
    votes[d.participants[0]] = pb.TxnVote(compares_held=True, success=pb.TxnBranch(
        op_indices=[0], results=kv.TxnResponse(results=[kv.TxnOpResult(get=kv.GetResponse(
            found=True, kv=kv.KeyValue(value=b"v" * (1 << 20))))]).SerializeToString()))
    out: list[Any] = []
    for shard in d.participants:
        out = d.step(PrepareAnswered(shard, votes[shard]), now_ms=1)
    assert names(out) == ["Reply(InvalidRequestError)", "SendDecide(abort)"]


def test_the_deadline_ends_the_prepares_definitely() -> None:
    d = begin(deadline_ms=50)
    d.step(Started(), now_ms=0)
    assert d.wake_at_ms() == 50
    assert names(d.step(Tick(), now_ms=50)) == ["Reply(DeadlineError)", "SendDecide(abort)"]


def test_a_decision_not_read_back_is_an_unknown_outcome() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    prepared_all(d)
    assert d.step(DecideAnswered(errors.UnknownOutcomeError("timed out")), now_ms=10) == []
    assert names(d.step(Tick(), now_ms=20)) == ["SendDecide(commit)"]  # the same decision id: a replay
    assert d.step(DecideAnswered(errors.UnavailableError("no leader")), now_ms=21) == []
    assert names(d.step(Tick(), now_ms=41)) == ["SendDecide(commit)"]
    out = d.step(DecideAnswered(errors.UnknownOutcomeError("timed out")), now_ms=42)  # attempts run out
    assert names(out) == ["Reply(UnknownOutcomeError)", "Finished(None)"]
    # Past the deadline the decide still out is waited for (its answer always comes), not retried;
    # the deadline wakes nobody then (the simulation found a driver ticking forever at it).
    d = begin(deadline_ms=20)
    d.step(Started(), now_ms=0)
    prepared_all(d)
    assert d.wake_at_ms() is None
    assert d.step(Tick(), now_ms=25) == []
    assert names(d.step(DecideAnswered(errors.UnavailableError("x")), now_ms=26)) == [
        "Reply(UnknownOutcomeError)", "Finished(None)"]
    assert d.step(DecideAnswered(errors.UnavailableError("x")), now_ms=27) == []  # finished: ignored


def test_an_abort_read_back_after_a_commit_was_sent_is_definite() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    prepared_all(d)
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False, reason="resolver timeout")), now_ms=2)
    assert names(out) == ["SendResolve(0)", "SendResolve(1)", "SendResolve(2)"]
    for shard in (0, 1):
        d.step(ResolveAnswered(shard, pb.TxnResolve()), now_ms=3)
    for attempt_at in (3, 20, 50):  # the last resolve fails until its attempts run out
        d.step(ResolveAnswered(2, errors.UnavailableError("x")), now_ms=attempt_at)
        if not d.finished:
            assert names(d.step(Tick(), now_ms=attempt_at + 40)) == ["SendResolve(2)"]
    assert d.finished


def test_an_earlier_commit_of_the_request_is_replayed() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    prepared_all(d)
    earlier = kv.TxnResponse(succeeded=True, result=kv.WriteResult(shard=0, revision=7)).SerializeToString()
    d.step(DecideAnswered(pb.TxnDecided(commit=False, earlier_answer=earlier)), now_ms=2)
    out: list[Any] = []
    for shard in d.participants:
        out = d.step(ResolveAnswered(shard, pb.TxnResolve()), now_ms=3)
    reply = out[0]
    assert isinstance(reply, Reply) and isinstance(reply.answer, kv.TxnResponse)
    assert reply.answer.result.replayed and reply.answer.result.revision == 7


def test_recovery_asks_for_the_abort_and_resolves_with_what_it_learns() -> None:
    prepare = pb.TxnPrepare(txn_id="t9", coordinator=1, participants=[1, 2], compares_held=True)
    d = TxnDriver.recover(CONFIG, prepare, prepared_unix_ms=NOW - 9_000, deadline_ms=500, reason="in doubt")
    out = d.step(Started(), now_ms=0)
    assert names(out) == ["SendDecide(abort)"]
    assert isinstance(out[0], SendDecide) and out[0].shard == 1 and out[0].first_attempt_unix_ms == NOW - 9_000
    out = d.step(DecideAnswered(pb.TxnDecided(commit=True, succeeded=False)), now_ms=1)  # it was decided: commit
    assert [(a.shard, a.resolve.commit, a.resolve.succeeded) for a in out if isinstance(a, SendResolve)] == [
        (1, True, False), (2, True, False)]
    d.step(ResolveAnswered(1, pb.TxnResolve()), now_ms=2)
    assert names(d.step(ResolveAnswered(2, pb.TxnResolve()), now_ms=2)) == ["Finished(True)"]  # no Reply


def test_recovery_refused_by_the_horizon_leaves_the_prepare_in_doubt() -> None:
    prepare = pb.TxnPrepare(txn_id="t9", coordinator=1, participants=[1, 2])
    d = TxnDriver.recover(CONFIG, prepare, prepared_unix_ms=1, deadline_ms=500, reason="in doubt")
    d.step(Started(), now_ms=0)
    out = d.step(DecideAnswered(errors.RequestExpiredError("too old")), now_ms=1)
    assert len(out) == 1 and isinstance(out[0], Finished) and out[0].committed is None and "operator" in out[0].in_doubt
    d = TxnDriver.recover(CONFIG, prepare, prepared_unix_ms=1, deadline_ms=20, reason="in doubt")
    d.step(Started(), now_ms=0)
    out = d.step(DecideAnswered(errors.UnavailableError("x")), now_ms=1)
    assert d.phase is Phase.DECIDING and not out
    assert names(d.step(Tick(), now_ms=25)) == ["SendDecide(abort)"]  # the retry, late
    out = d.step(DecideAnswered(errors.UnavailableError("x")), now_ms=26)  # no retry past the deadline
    assert len(out) == 1 and isinstance(out[0], Finished) and out[0].in_doubt


def test_mutations_break_the_rules_they_name() -> None:
    d = begin(mutations=frozenset({TxnMutation.DECIDE_BEFORE_PREPARED}))
    d.step(Started(), now_ms=0)
    d.step(PrepareAnswered(0, vote(0)), now_ms=1)
    d.step(PrepareAnswered(1, errors.TxnConflictError("locked")), now_ms=1)
    assert names(d.step(PrepareAnswered(2, vote(2)), now_ms=1)) == ["SendDecide(commit)"]
    prepare = pb.TxnPrepare(txn_id="t9", coordinator=1, participants=[1, 2], compares_held=True)
    mutated = DriverConfig(**{**CONFIG.__dict__, "mutations": frozenset({TxnMutation.APPLY_WITHOUT_DECISION})})
    r = TxnDriver.recover(mutated, prepare, prepared_unix_ms=NOW, deadline_ms=500, reason="in doubt")
    out = r.step(Started(), now_ms=0)
    assert [(a.shard, a.resolve.commit) for a in out if isinstance(a, SendResolve)] == [(1, True), (2, True)]


# ---- against memory replicas -------------------------------------------------------------------------------


def run(shards: list[Shard], d: TxnDriver, *, lose: set[str] | None = None) -> list[Any]:
    """A shell: each action is performed on the memory replicas at once, its answer fed back;
    `lose` drops the answers of these kinds of calls (as timeouts: unknown outcomes)."""
    lose = lose or set()
    replies: list[Any] = []
    pending = d.step(Started(), now_ms=0)
    now = 0.0
    while not d.finished:
        while pending:
            action = pending.pop(0)
            if isinstance(action, Reply):
                replies.append(action.answer)
                continue
            if isinstance(action, Finished):
                continue
            if isinstance(action, SendPrepare):
                s = shards[action.shard]
                answer = s.one(txn.prepare_write(action.txn_id, action.request, action.shard, SHARDS, s.store))
                event: Any = PrepareAnswered(action.shard, answer)
            elif isinstance(action, SendDecide):
                s = shards[action.shard]
                answer = s.one(txn.decision_write(action.decision, s.store))
                event = DecideAnswered(answer)
            else:
                assert isinstance(action, SendResolve)
                answer = shards[action.shard].one(txn.resolve_write(action.resolve))
                event = ResolveAnswered(action.shard, answer)
            if type(action).__name__ in lose:
                event = type(event)(*[*event.__dict__.values()][:-1], errors.UnknownOutcomeError("lost"))
            pending.extend(d.step(event, now_ms=now))
        wake = d.wake_at_ms()
        if wake is not None and not d.finished:
            now = max(now, wake)
            pending.extend(d.step(Tick(), now_ms=now))
    return replies


def test_a_transfer_over_memory_replicas() -> None:
    shards = cluster(A=b"1", C=b"c")
    replies = run(shards, begin())
    assert len(replies) == 1 and isinstance(replies[0], kv.TxnResponse) and replies[0].succeeded
    assert value(shards, A) == b"0" and not any(s.store.locks.has_locks() for s in shards)
    # The same request again (a retry after an unknown outcome): replayed, applied once.
    again = run(shards, TxnDriver.begin(CONFIG, "x2", transfer(), now_unix_ms=NOW, deadline_ms=1_000))
    assert isinstance(again[0], kv.TxnResponse) and again[0].result.replayed


def test_lost_decide_answers_are_read_back_by_replay() -> None:
    shards = cluster(A=b"1")
    d = begin()
    replies = run(shards, d, lose={"SendDecide"})  # every decide answer lost: the decision is in the WAL
    assert isinstance(replies[0], errors.UnknownOutcomeError)
    # A resolver learns the commit from the coordinator's WAL and finishes the transaction.
    prepared = shards[1].store.locks.prepared_txn("x1")
    assert prepared is not None
    r = TxnDriver.recover(CONFIG, prepared.prepare, prepared_unix_ms=NOW, deadline_ms=1_000, reason="in doubt")
    run(shards, r)
    assert value(shards, A) == b"0" and not any(s.store.locks.has_locks() for s in shards)


def test_a_resolver_first_aborts_a_slow_driver() -> None:
    shards = cluster(A=b"1")
    req = transfer()
    d = begin(req)
    pending = d.step(Started(), now_ms=0)
    for action in pending:  # every prepare lands
        assert isinstance(action, SendPrepare)
        s = shards[action.shard]
        d.step(PrepareAnswered(action.shard, s.one(txn.prepare_write("x1", req, action.shard, SHARDS, s.store))),
               now_ms=1)
    prepared = shards[2].store.locks.prepared_txn("x1")
    assert prepared is not None
    run(shards, TxnDriver.recover(CONFIG, prepared.prepare, prepared_unix_ms=NOW, deadline_ms=1_000, reason="slow"))
    decided = shards[0].one(txn.decision_write(d.decision, shards[0].store))  # type: ignore[arg-type]
    out = d.step(DecideAnswered(decided), now_ms=5)
    assert names(out) == ["SendResolve(0)", "SendResolve(1)", "SendResolve(2)"]
    assert value(shards, A) == b"1"


@pytest.mark.parametrize("refusal", [errors.RequestExpiredError("the first attempt is past the horizon"),
                                     errors.InvalidRequestError("record too large", limit="max_record_bytes")])
def test_a_commit_refused_for_good_is_answered_so_and_aborted(refusal: errors.StoreError) -> None:
    req = transfer()
    req.first_attempt_unix_ms = NOW - 7_200_000  # a retry of a request two hours old
    d = begin(req)
    d.step(Started(), now_ms=0)
    decide = prepared_all(d)
    assert isinstance(decide[0], SendDecide) and decide[0].first_attempt_unix_ms == NOW - 7_200_000
    out = d.step(DecideAnswered(refusal), now_ms=2)
    assert names(out) == [f"Reply({type(refusal).__name__})", "SendDecide(abort)"]
    again = out[1]
    assert isinstance(again, SendDecide) and again.first_attempt_unix_ms == NOW  # this attempt's own time
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False)), now_ms=3)
    assert names(out) == ["SendResolve(0)", "SendResolve(1)", "SendResolve(2)"]


def test_an_answer_too_large_for_the_decision_record_aborts_before_deciding() -> None:
    from kvstore.core.txn_driver import MAX_DECIDED_ANSWER_BYTES

    big = kv.TxnRequest(success=[kv.TxnOp(get=kv.GetRequest(key=A)), kv.TxnOp(get=kv.GetRequest(key=b"k1"))])
    d = begin(big)
    d.step(Started(), now_ms=0)
    value = b"v" * (MAX_DECIDED_ANSWER_BYTES // 2 + 10)
    out: list[Any] = []
    for i, shard in enumerate(d.participants):
        vote = pb.TxnVote(compares_held=True, success=pb.TxnBranch(op_indices=[i], results=kv.TxnResponse(
            results=[kv.TxnOpResult(get=kv.GetResponse(found=True, kv=kv.KeyValue(value=value)))]).SerializeToString()))
        out = d.step(PrepareAnswered(shard, vote), now_ms=1)
    assert names(out) == ["Reply(InvalidRequestError)", "SendDecide(abort)"]
