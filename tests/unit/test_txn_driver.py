"""`kvstore.core.txn_driver`: a cross-shard transaction's course, event by event; pure.

Each test feeds the driver events and checks the actions it asks for, as the replica machine's
table tests do; the last ones run it against memory replicas (tests/unit/test_txn.py's) through
a shell of a few lines, as a node or the simulation would."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore import errors
from kvstore.core import txn
from kvstore.core.txn_driver import DriverConfig, Mode, Phase, TxnDriver, TxnMutation
from kvstore.core.txn_events import (
    DecideAnswered,
    Finished,
    Forget,
    PrepareAnswered,
    Reply,
    ResolveAnswered,
    SendDecide,
    SendPrepare,
    SendResolve,
    Started,
    Tick,
)
from kvstore.internal.v1 import wal_entry_pb2 as pb
from kvstore.v1 import kv_pb2 as kv
from tests.unit.test_txn import NOW_MS, SHARDS, A, B, Shard, cluster, transfer, value

NOW = NOW_MS
CONFIG = DriverConfig(shard_count=SHARDS, max_attempts=3, backoff_first_ms=10, backoff_max_ms=40)
ANSWER = kv.TxnResponse(succeeded=True, result=kv.WriteResult(shard=0, revision=42)).SerializeToString()


def begin(req: kv.TxnRequest | None = None, deadline_ms: float = 1_000, **config: Any) -> TxnDriver:
    cfg = DriverConfig(**{**CONFIG.__dict__, **config})
    return TxnDriver.begin(cfg, "x1", req if req is not None else transfer(), now_unix_ms=NOW,
                           deadline_ms=deadline_ms)


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
            out.append(f"SendDecide({'commit' if a.decide.decision.commit else 'abort'})")
        elif isinstance(a, Reply):
            out.append(f"Reply({type(a.answer).__name__})")
        elif isinstance(a, Forget):
            out.append(f"Forget({a.shard})")
        else:
            assert isinstance(a, Finished)
            out.append(f"Finished({a.committed})")
    return out


def prepared_all(driver: TxnDriver, now: float = 1) -> list[Any]:
    out: list[Any] = []
    for shard in driver.others:
        out = driver.step(PrepareAnswered(shard, vote(shard)), now_ms=now)
    return out


def resolved_all(driver: TxnDriver, now: float = 3) -> list[Any]:
    out: list[Any] = []
    for shard in driver.resolve_at:
        out = driver.step(ResolveAnswered(shard, pb.TxnResolve()), now_ms=now)
    return out


def failed(error: errors.StoreError, **kwargs: Any) -> TxnDriver:
    """A driver whose prepare at shard 1 was just answered `error` (its abort decision sent)."""
    d = begin(**kwargs)
    d.step(Started(), now_ms=0)
    d.step(PrepareAnswered(1, error), now_ms=1)
    return d


def test_the_happy_course() -> None:
    d = begin()
    assert names(d.step(Started(), now_ms=0)) == ["SendPrepare(1)", "SendPrepare(2)"]  # not the coordinator
    first = d.step(PrepareAnswered(1, vote(1)), now_ms=1)
    assert first == []
    decide = d.step(PrepareAnswered(2, vote(2)), now_ms=1)
    assert names(decide) == ["SendDecide(commit)"] and d.commit_sent
    action = decide[0]
    assert isinstance(action, SendDecide) and action.shard == 0 and action.decide.first_attempt_unix_ms == NOW
    assert action.decide.request == transfer() and sorted(action.decide.votes) == [1, 2]
    assert action.decide.decision.request_id == "t-1" and action.started_unix_ms == NOW
    # The client is answered at the decision (the coordinator built the answer); then the resolves.
    out = d.step(DecideAnswered(pb.TxnDecided(commit=True, succeeded=True, revision=42, answer=ANSWER)), now_ms=2)
    assert names(out) == ["Reply(TxnResponse)", "SendResolve(1)", "SendResolve(2)"]
    reply = out[0]
    assert isinstance(reply, Reply) and isinstance(reply.answer, kv.TxnResponse)
    assert reply.answer.succeeded and reply.answer.result.revision == 42 and reply.answer.result.shard == 0
    assert d.step(ResolveAnswered(1, pb.TxnResolve()), now_ms=3) == []
    assert names(d.step(ResolveAnswered(2, pb.TxnResolve()), now_ms=3)) == ["Forget(0)", "Finished(True)"]
    assert d.step(Tick(), now_ms=5) == [] and d.wake_at_ms() is None


def test_a_conflict_is_answered_once_the_coordinator_recorded_the_abort() -> None:
    d = failed(errors.TxnConflictError("locked", txn_id="o"))
    assert d.phase is Phase.DECIDING and not d.replied
    abort = d.decision
    assert abort is not None and not abort.commit and abort.request_id == "t-1" and "locked" in abort.reason
    assert d.step(PrepareAnswered(2, vote(2)), now_ms=2) == []  # late: moved on
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False, reason=abort.reason)), now_ms=3)
    assert names(out) == ["Reply(TxnAbortedError)", "SendResolve(1)", "SendResolve(2)"]
    reply = out[0]
    assert isinstance(reply, Reply) and isinstance(reply.answer, errors.TxnAbortedError)
    assert reply.answer.definite and "new request id" in str(reply.answer)
    assert all(isinstance(a, SendResolve) and not a.resolve.commit for a in out[1:])
    d.step(ResolveAnswered(1, pb.TxnResolve()), now_ms=4)
    assert names(d.step(ResolveAnswered(2, pb.TxnResolve()), now_ms=4)) == ["Forget(0)", "Finished(False)"]


def test_without_a_request_id_a_failure_is_definite_at_once() -> None:
    d = begin(kv.TxnRequest(success=[kv.TxnOp(put=kv.PutRequest(key=A, value=b"1")),
                                     kv.TxnOp(put=kv.PutRequest(key=B, value=b"1"))]))
    d.step(Started(), now_ms=0)
    out = d.step(PrepareAnswered(1, errors.TxnConflictError("locked")), now_ms=1)
    assert names(out) == ["Reply(TxnConflictError)", "SendDecide(abort)"]


def test_a_prepare_retry_pending_at_the_abort_is_dropped() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    d.step(PrepareAnswered(2, errors.UnavailableError("x")), now_ms=1)  # a retry at 11
    d.step(PrepareAnswered(1, errors.TxnConflictError("locked")), now_ms=2)
    assert d.step(Tick(), now_ms=11) == []


def test_an_earlier_attempt_still_prepared_is_fenced_by_the_abort() -> None:
    """A retry that meets the lock of an earlier attempt of its own request aborts, and its abort,
    recorded as the request's outcome, keeps that attempt from ever committing: definite."""
    d = failed(errors.TxnConflictError("x", txn_id="old", same_request=True))
    assert d.decision is not None and d.decision.request_id == "t-1" and not d.replied
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False, reason="x")), now_ms=3)
    assert names(out)[0] == "Reply(TxnAbortedError)"


@pytest.mark.parametrize("error", [errors.UnavailableError("x"), errors.UnknownOutcomeError("x"),
                                   errors.NotLeaderError(1, None)])
def test_a_prepare_is_retried_then_the_transaction_aborted(error: errors.StoreError) -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    assert d.step(PrepareAnswered(1, error), now_ms=1) == []
    assert d.wake_at_ms() == 11
    assert d.step(Tick(), now_ms=5) == []
    assert names(d.step(Tick(), now_ms=11)) == ["SendPrepare(1)"]
    d.step(PrepareAnswered(1, error), now_ms=12)
    assert names(d.step(Tick(), now_ms=40)) == ["SendPrepare(1)"]
    out = d.step(PrepareAnswered(1, error), now_ms=41)  # the third attempt: max_attempts
    assert names(out) == ["SendDecide(abort)"]
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False, reason="r")), now_ms=42)
    reply = out[0]
    assert isinstance(reply, Reply) and isinstance(reply.answer, errors.TxnAbortedError)
    assert "could not prepare" in str(reply.answer)


def test_an_invalid_part_is_answered_as_invalid_once_aborted() -> None:
    d = failed(errors.InvalidRequestError("bad"))
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False, reason="bad")), now_ms=2)
    assert names(out)[0] == "Reply(InvalidRequestError)"


def test_the_deadline_ends_the_prepares() -> None:
    d = begin(deadline_ms=50)
    d.step(Started(), now_ms=0)
    assert d.wake_at_ms() == 50
    assert names(d.step(Tick(), now_ms=50)) == ["SendDecide(abort)"]
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False)), now_ms=51)
    reply = out[0]
    assert isinstance(reply, Reply) and isinstance(reply.answer, errors.TxnAbortedError) and "deadline" in str(
        reply.answer)


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
    # Past the deadline the decide still out is waited for (its answer always comes): the deadline
    # wakes nobody then (the simulation found a driver ticking forever at it); a failed decide is
    # retried within its attempts, whatever the deadline (a commit may be recorded: only its answer says).
    d = begin(deadline_ms=20)
    d.step(Started(), now_ms=0)
    prepared_all(d)
    assert d.wake_at_ms() is None
    assert d.step(Tick(), now_ms=25) == []
    assert d.step(DecideAnswered(errors.UnavailableError("x")), now_ms=26) == []
    assert d.wake_at_ms() == 36 and names(d.step(Tick(), now_ms=36)) == ["SendDecide(commit)"]


def test_an_abort_not_read_back_leaves_the_request_unknown() -> None:
    """The abort was not confirmed: an earlier attempt of the request may still commit, so the
    client is told the outcome is unknown, never that it failed (T5)."""
    d = failed(errors.TxnConflictError("locked"))
    for at in (2, 30, 70):
        out = d.step(DecideAnswered(errors.UnknownOutcomeError("timed out")), now_ms=at)
        if d.finished:
            break
        assert names(d.step(Tick(), now_ms=at + 40)) == ["SendDecide(abort)"]
    assert names(out) == ["Reply(UnknownOutcomeError)", "Finished(None)"]


def test_an_abort_read_back_after_a_commit_was_sent_is_definite() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    prepared_all(d)
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False, reason="resolver timeout")), now_ms=2)
    assert names(out) == ["Reply(TxnAbortedError)", "SendResolve(1)", "SendResolve(2)"]
    d.step(ResolveAnswered(1, pb.TxnResolve()), now_ms=3)
    for attempt_at in (3, 20, 50):  # the last resolve fails until its attempts run out
        out = d.step(ResolveAnswered(2, errors.UnavailableError("x")), now_ms=attempt_at)
        if not d.finished:
            assert names(d.step(Tick(), now_ms=attempt_at + 40)) == ["SendResolve(2)"]
    assert d.finished and names(out) == ["Finished(False)"]  # no Forget: shard 2 did not resolve


def test_an_earlier_commit_of_the_request_is_replayed() -> None:
    committing = begin()
    committing.step(Started(), now_ms=0)
    prepared_all(committing)
    earlier = kv.TxnResponse(succeeded=True, result=kv.WriteResult(shard=0, revision=7)).SerializeToString()
    for d in (committing, failed(errors.TxnConflictError("locked"))):  # its commit, or its abort, answered so
        out = d.step(DecideAnswered(pb.TxnDecided(commit=False, earlier_answer=earlier)), now_ms=2)
        reply = out[0]
        assert isinstance(reply, Reply) and isinstance(reply.answer, kv.TxnResponse)
        assert reply.answer.result.replayed and reply.answer.result.revision == 7


def test_a_request_past_the_horizon_is_unknown() -> None:
    d = failed(errors.TxnConflictError("locked"))
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False, request_unrecorded=True)), now_ms=2)
    assert names(out)[0] == "Reply(RequestExpiredError)"


@pytest.mark.parametrize("refusal", [errors.TxnConflictError("the coordinator's key is locked"),
                                     errors.InvalidRequestError("record too large", limit="max_record_bytes"),
                                     errors.RequestExpiredError("the first attempt is past the horizon")])
def test_a_commit_refused_definitely_is_aborted(refusal: errors.StoreError) -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    prepared_all(d)
    out = d.step(DecideAnswered(refusal), now_ms=2)
    expired = isinstance(refusal, errors.RequestExpiredError)
    assert names(out) == ["SendDecide(abort)"]  # answered with what the abort says (the request may be decided)
    abort = out[-1]
    assert isinstance(abort, SendDecide) and abort.decide.request is None and not abort.decide.votes
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False, request_unrecorded=expired)), now_ms=3)
    kinds = {errors.TxnConflictError: ["Reply(TxnAbortedError)"], errors.InvalidRequestError: [
        "Reply(InvalidRequestError)"], errors.RequestExpiredError: ["Reply(RequestExpiredError)"]}
    assert [n for n in names(out) if n.startswith("Reply")] == kinds[type(refusal)]


def test_an_abort_answered_with_an_earlier_commit_of_the_same_transaction_replies_it() -> None:
    """The first send of the commit timed out, the second was refused; the abort that followed
    finds the first one recorded (the same decision id): the commit is the answer."""
    d = begin()
    d.step(Started(), now_ms=0)
    prepared_all(d)
    d.step(DecideAnswered(errors.UnknownOutcomeError("timed out")), now_ms=2)
    d.step(Tick(), now_ms=20)
    d.step(DecideAnswered(errors.TxnConflictError("locked")), now_ms=21)
    out = d.step(DecideAnswered(pb.TxnDecided(commit=True, succeeded=True, answer=ANSWER)), now_ms=22)
    assert names(out) == ["Reply(TxnResponse)", "SendResolve(1)", "SendResolve(2)"]


def test_recovery_asks_for_the_abort_and_resolves_with_what_it_learns() -> None:
    prepare = pb.TxnPrepare(txn_id="t9", coordinator=1, participants=[1, 2], compares_held=True, request_id="c",
                            first_attempt_unix_ms=NOW - 9_000)
    d = TxnDriver.recover(CONFIG, prepare, at_shard=2, now_unix_ms=NOW, deadline_ms=500, reason="in doubt")
    assert d.mode is Mode.RECOVER and d.replied
    out = d.step(Started(), now_ms=0)
    assert names(out) == ["SendDecide(abort)"]
    action = out[0]
    assert isinstance(action, SendDecide) and action.shard == 1
    assert action.decide.first_attempt_unix_ms == NOW - 9_000 and action.decide.decision.request_id == "c"
    out = d.step(DecideAnswered(pb.TxnDecided(commit=True, succeeded=False)), now_ms=1)  # it was decided: commit
    assert [(a.shard, a.resolve.commit, a.resolve.succeeded) for a in out if isinstance(a, SendResolve)] == [
        (2, True, False)]
    assert names(d.step(ResolveAnswered(2, pb.TxnResolve()), now_ms=2)) == ["Forget(1)", "Finished(True)"]  # no Reply


def test_recovery_of_an_older_release_resolves_the_coordinator_too() -> None:
    """A prepare at the coordinator shard itself (the three-record protocol of an older release)."""
    prepare = pb.TxnPrepare(txn_id="t9", coordinator=1, participants=[1, 2])
    d = TxnDriver.recover(CONFIG, prepare, at_shard=1, now_unix_ms=NOW, deadline_ms=500, reason="in doubt")
    d.step(Started(), now_ms=0)
    out = d.step(DecideAnswered(pb.TxnDecided(commit=False)), now_ms=1)
    assert names(out) == ["SendResolve(1)", "SendResolve(2)"]


def test_a_recovery_refused_as_asked_too_long_ago_ends_and_is_checked_again() -> None:
    """A coordinator holding no decision refuses an abort asked too long ago (the recovery
    stalled between its check and its question): this recovery ends, the next round checks the
    prepare again. It never refuses one whose decision it holds, whatever the prepare's age
    (test_txn.py::test_a_decision_outlives_the_request_id_table); one that knows decisions from
    its request-id table alone (the simulation's mutation decision-in-request-table) would."""
    prepare = pb.TxnPrepare(txn_id="t9", coordinator=1, participants=[1, 2])
    d = TxnDriver.recover(CONFIG, prepare, at_shard=2, now_unix_ms=NOW, deadline_ms=500, reason="in doubt")
    d.step(Started(), now_ms=0)
    out = d.step(DecideAnswered(errors.RequestExpiredError("too old")), now_ms=1)
    assert len(out) == 1 and isinstance(out[0], Finished) and out[0].committed is None
    assert "checked again" in out[0].in_doubt
    d = TxnDriver.recover(CONFIG, prepare, at_shard=2, now_unix_ms=NOW, deadline_ms=20, reason="in doubt")
    d.step(Started(), now_ms=0)
    for at in (1, 30, 70):  # a coordinator that does not answer: retried, then left in doubt
        out = d.step(DecideAnswered(errors.UnavailableError("x")), now_ms=at)
        if d.finished:
            break
        assert names(d.step(Tick(), now_ms=at + 40)) == ["SendDecide(abort)"]
    assert len(out) == 1 and isinstance(out[0], Finished) and out[0].in_doubt


def test_a_finish_resolves_the_recorded_decision_and_forgets_it() -> None:
    decision = pb.TxnDecision(txn_id="t7", commit=True, succeeded=True, participants=[0, 2])
    d = TxnDriver.finish(CONFIG, decision, pb.TxnDecided(commit=True, succeeded=True), now_unix_ms=NOW,
                         deadline_ms=500)
    out = d.step(Started(), now_ms=0)
    assert [(a.shard, a.resolve.commit) for a in out if isinstance(a, SendResolve)] == [(2, True)]
    assert names(d.step(ResolveAnswered(2, pb.TxnResolve()), now_ms=1)) == ["Forget(0)", "Finished(True)"]
    here = TxnDriver.finish(CONFIG, decision, pb.TxnDecided(commit=True, succeeded=True), now_unix_ms=NOW,
                            deadline_ms=500, also_here=True)
    assert names(here.step(Started(), now_ms=0)) == ["SendResolve(0)", "SendResolve(2)"]


def test_mutations_break_the_rules_they_name() -> None:
    d = begin(mutations=frozenset({TxnMutation.DECIDE_BEFORE_PREPARED}))
    d.step(Started(), now_ms=0)
    d.step(PrepareAnswered(1, errors.TxnConflictError("locked")), now_ms=1)
    assert names(d.step(PrepareAnswered(2, vote(2)), now_ms=1)) == ["SendDecide(commit)"]
    prepare = pb.TxnPrepare(txn_id="t9", coordinator=1, participants=[1, 2], compares_held=True)
    mutated = DriverConfig(**{**CONFIG.__dict__, "mutations": frozenset({TxnMutation.APPLY_WITHOUT_DECISION})})
    r = TxnDriver.recover(mutated, prepare, at_shard=2, now_unix_ms=NOW, deadline_ms=500, reason="in doubt")
    out = r.step(Started(), now_ms=0)
    assert [(a.shard, a.resolve.commit) for a in out if isinstance(a, SendResolve)] == [(2, True)]
    quick = failed(errors.TxnConflictError("locked"), mutations=frozenset({TxnMutation.RETRY_WITHOUT_LOOKUP}))
    assert quick.replied  # answered "aborted" before the coordinator recorded anything


# ---- against memory replicas -------------------------------------------------------------------------------


def run(shards: list[Shard], d: TxnDriver, *, lose: set[str] | None = None) -> list[Any]:
    """A shell: each action is performed on the memory replicas at once, its answer fed back;
    `lose` drops the answers of these kinds of calls (as timeouts: unknown outcomes). A `Forget`
    is performed as the coordinator's leader would: a forget record."""
    lose = lose or set()
    replies: list[Any] = []
    pending = d.step(Started(), now_ms=0)
    now = 0.0
    while not d.finished or pending:
        while pending:
            action = pending.pop(0)
            if isinstance(action, Reply):
                replies.append(action.answer)
                continue
            if isinstance(action, Finished):
                continue
            if isinstance(action, Forget):
                s = shards[action.shard]
                s.one(txn.forget_write([action.txn_id], s.store))
                continue
            if isinstance(action, SendPrepare):
                s = shards[action.shard]
                answer = s.one(txn.prepare_write(action.txn_id, action.request, action.shard, SHARDS, s.store,
                                                 started_unix_ms=action.started_unix_ms,
                                                 first_attempt_unix_ms=action.first_attempt_unix_ms))
                event: Any = PrepareAnswered(action.shard, answer)
            elif isinstance(action, SendDecide):
                s = shards[action.shard]
                answer = s.one(txn.decision_write(action.decide, s.store, shard_count=SHARDS,
                                                  started_unix_ms=action.started_unix_ms))
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
    assert value(shards, A) == b"0" and value(shards, B) == b"1"
    assert not any(s.store.locks.has_locks() or s.store.decisions for s in shards)  # resolved, then forgotten
    # The same request again (a retry after an unknown outcome): replayed, applied once.
    again = run(shards, TxnDriver.begin(CONFIG, "x2", transfer(), now_unix_ms=NOW, deadline_ms=1_000))
    assert isinstance(again[0], kv.TxnResponse) and again[0].result.replayed
    assert value(shards, B) == b"1"


def test_a_retry_under_a_held_lock_gets_the_original_answer() -> None:
    """T5: the first attempt committed; its resolve at shard 1 is late, so the retry's prepare
    meets the lock (its own request's) and aborts: the coordinator answers the abort with the
    commit, and that is the retry's answer."""
    shards = cluster(A=b"1", C=b"c")
    first = run(shards, begin(), lose={"SendDecide"})  # committed; the driver learned nothing
    assert isinstance(first[0], errors.UnknownOutcomeError) and shards[1].store.locks.has_locks()
    retry = run(shards, TxnDriver.begin(CONFIG, "x2", transfer(), now_unix_ms=NOW, deadline_ms=1_000))
    assert isinstance(retry[0], kv.TxnResponse) and retry[0].result.replayed and retry[0].succeeded


def test_a_failed_retry_fences_an_earlier_attempt() -> None:
    """T5: an earlier attempt is prepared and undecided; a retry fails (a lock of another
    transaction) and its abort records the request as failed: the earlier attempt can no longer
    commit, so "aborted" is the truth."""
    shards = cluster(A=b"1", C=b"c")
    first = begin()
    for action in first.step(Started(), now_ms=0):
        assert isinstance(action, SendPrepare)
        s = shards[action.shard]
        first.step(PrepareAnswered(action.shard, s.one(txn.prepare_write(
            "x1", transfer(), action.shard, SHARDS, s.store))), now_ms=1)
    assert first.commit_sent  # its commit decision is on the way
    retry = run(shards, TxnDriver.begin(CONFIG, "x2", transfer(), now_unix_ms=NOW, deadline_ms=1_000))
    assert isinstance(retry[0], errors.TxnAbortedError)
    assert first.decision is not None
    late = shards[0].one(txn.decision_write(txn.Decide(first.decision, NOW, transfer(), dict(first.votes)),
                                            shards[0].store, shard_count=SHARDS))
    assert isinstance(late, pb.TxnDecided) and not late.commit and value(shards, A) == b"1"


def test_lost_decide_answers_are_read_back_by_replay() -> None:
    shards = cluster(A=b"1")
    d = begin()
    replies = run(shards, d, lose={"SendDecide"})  # every decide answer lost: the decision is in the WAL
    assert isinstance(replies[0], errors.UnknownOutcomeError)
    # A resolver learns the commit from the coordinator's decision table and finishes the transaction.
    prepared = shards[1].store.locks.prepared_txn("x1")
    assert prepared is not None
    r = TxnDriver.recover(CONFIG, prepared.prepare, at_shard=1, now_unix_ms=NOW, deadline_ms=1_000,
                          reason="in doubt")
    run(shards, r)
    assert value(shards, A) == b"0" and value(shards, B) == b"1"
    assert not any(s.store.locks.has_locks() or s.store.decisions for s in shards)


def test_a_finisher_completes_a_decision_its_driver_left() -> None:
    shards = cluster(A=b"1")
    run(shards, begin(), lose={"SendResolve"})  # every resolve answer lost: no Forget
    assert shards[0].store.decided_txn("x1") is not None
    kept = shards[0].store.decided_txn("x1")
    assert kept is not None
    run(shards, TxnDriver.finish(CONFIG, kept.decision, kept.decided(), now_unix_ms=NOW, deadline_ms=1_000))
    assert not any(s.store.locks.has_locks() or s.store.decisions for s in shards) and value(shards, B) == b"1"


def test_a_resolver_first_aborts_a_slow_driver() -> None:
    shards = cluster(A=b"1")
    req = transfer()
    d = begin(req)
    pending = d.step(Started(), now_ms=0)
    for action in pending:  # every prepare lands
        assert isinstance(action, SendPrepare)
        s = shards[action.shard]
        d.step(PrepareAnswered(action.shard, s.one(txn.prepare_write(
            "x1", req, action.shard, SHARDS, s.store, first_attempt_unix_ms=NOW))), now_ms=1)
    prepared = shards[2].store.locks.prepared_txn("x1")
    assert prepared is not None
    run(shards, TxnDriver.recover(CONFIG, prepared.prepare, at_shard=2, now_unix_ms=NOW, deadline_ms=1_000,
                                  reason="slow"))
    assert d.decision is not None
    decided = shards[0].one(txn.decision_write(txn.Decide(d.decision, NOW, req, dict(d.votes)), shards[0].store,
                                               shard_count=SHARDS))
    out = d.step(DecideAnswered(decided), now_ms=5)
    assert names(out) == ["Reply(TxnAbortedError)", "SendResolve(1)", "SendResolve(2)"]
    assert value(shards, A) == b"1"


def test_without_a_request_id_a_refused_commit_waits_for_the_abort_to_say() -> None:
    """No request id, a commit sent (its first send timed out, a retry refused on a lock): the
    failure is not definite yet, since the first send may be recorded first; the abort's answer
    says, here the commit."""
    req = kv.TxnRequest(success=[kv.TxnOp(put=kv.PutRequest(key=A, value=b"1")),
                                 kv.TxnOp(put=kv.PutRequest(key=B, value=b"1"))])
    d = begin(req)
    d.step(Started(), now_ms=0)
    for shard in d.others:
        d.step(PrepareAnswered(shard, vote(shard, req=req)), now_ms=1)
    d.step(DecideAnswered(errors.UnknownOutcomeError("timed out")), now_ms=2)
    d.step(Tick(), now_ms=20)
    out = d.step(DecideAnswered(errors.TxnConflictError("the coordinator's key is locked")), now_ms=21)
    assert names(out) == ["SendDecide(abort)"] and not d.replied
    out = d.step(DecideAnswered(pb.TxnDecided(commit=True, succeeded=True, answer=ANSWER)), now_ms=22)
    assert names(out)[0] == "Reply(TxnResponse)"


def test_a_commit_answered_without_an_answer_is_unknown() -> None:
    d = begin()
    d.step(Started(), now_ms=0)
    prepared_all(d)
    out = d.step(DecideAnswered(pb.TxnDecided(commit=True, succeeded=True)), now_ms=2)
    assert names(out)[0] == "Reply(UnknownOutcomeError)"


def test_without_a_request_id_an_abort_not_read_back_is_still_the_failure() -> None:
    """No request id and no commit sent: nothing of it can apply, whether or not the abort
    (which only releases locks) was read back."""
    req = kv.TxnRequest(success=[kv.TxnOp(put=kv.PutRequest(key=A, value=b"1")),
                                 kv.TxnOp(put=kv.PutRequest(key=B, value=b"1"))])
    d = begin(req, deadline_ms=5)
    d.step(Started(), now_ms=0)
    out = d.step(Tick(), now_ms=5)
    assert names(out) == ["Reply(DeadlineError)", "SendDecide(abort)"]
    late = d.step(PrepareAnswered(1, vote(1, req=req)), now_ms=6)  # a prepare answered after the abort: ignored
    assert late == []
    for at in (7, 30, 70):
        out = d.step(DecideAnswered(errors.UnavailableError("no leader")), now_ms=at)
        if d.finished:
            break
        d.step(Tick(), now_ms=at + 45)
    assert names(out) == ["Finished(None)"]
