"""A cross-shard transaction's driver: prepare, decide, answer, resolve, forget; pure.

docs/design.md §10.2. Three kinds of driver, one machine:

* a **client's** Txn (`TxnDriver.begin`), run by the node that received it: every participant
  but the coordinator prepares; the coordinator's leader then appends the decision, evaluating
  its own part with it (two appends in sequence); the client is answered at the decision; the
  other participants resolve afterwards;
* a **recovery** (`TxnDriver.recover`), run by a participant's leader for a prepare in doubt: it
  asks the coordinator for the abort decision (answered with the decision already recorded, if
  any: first decision wins, T1) and resolves every participant with what it learns;
* a **finish** (`TxnDriver.finish`), run by the coordinator's leader for a decision its table
  still holds: it resolves the participants again with the recorded decision.

Whoever learns that every other participant resolved says so (`Forget`): the coordinator's
leader then forgets the decision with a record of its own. Until then the decision stays in the
coordinator's state, so recovery never depends on the request-id table's horizon (T3).

A client's read-only Txn (only gets and compares) writes nothing: its parts are read
optimistically and validated as one cut (`kvstore.core.cut`, docs/design.md §10.5); only when
that keeps failing does it take the locking path above.

Like the replica machine, it decides and does nothing: a shell (the node's, the simulation's)
performs each action and reports its answer as an event, exactly one per call:

    SendPrepare(shard)   -> PrepareAnswered(shard, TxnVote | StoreError)
    SendDecide(decide)   -> DecideAnswered(TxnDecided | StoreError)
    SendResolve(shard)   -> ResolveAnswered(shard, TxnResolve | StoreError)
    SendRead(shard)      -> ReadAnswered(shard, PartRead | StoreError)
    SendValidate(shard)  -> ValidateAnswered(shard, bool | StoreError)

`Reply`, `Forget` and `Finished` have no answer. A call that timed out is reported as
`UnknownOutcomeError` (the record may have been appended). The driver holds nothing durable:
everything it learns is in the WALs, so a driver that dies leaves its prepares to the
participants' resolvers and its decision to the coordinator's finishers.

What the client is told (W7, T5):

* a commit decision read back: the answer (the coordinator built it with the decision);
* an abort decision read back: the client request's recorded outcome. An abort records the
  request id as failed (`TxnAbortedError`, definite: no attempt with that id will ever apply
  anything, an earlier one still running included), unless the request had an outcome already
  (another attempt's commit: its answer, replayed) or may have had one the coordinator forgot
  (its first attempt past the request-id horizon: `RequestExpiredError`, outcome unknown);
* no decision read back within the bound: unknown, whatever was sent. A Txn without a request id
  has no other attempts, so its failure is definite for the attempt, answered at once (unless a
  commit of it was sent: then the abort's answer says).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

from kvstore import errors
from kvstore.core import txn
from kvstore.core.cut import Action as CutAction
from kvstore.core.cut import Answer, Cut, CutConfig, GiveUp, ReadParts, ValidateParts
from kvstore.core.txn import MAX_DECIDED_ANSWER_BYTES, Decide
from kvstore.core.txn_events import (
    Action,
    DecideAnswered,
    Event,
    Finished,
    Forget,
    PartRead,
    PrepareAnswered,
    ReadAnswered,
    Reply,
    ResolveAnswered,
    SendDecide,
    SendPrepare,
    SendRead,
    SendResolve,
    SendValidate,
    Started,
    Tick,
    ValidateAnswered,
)
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2

__all__ = ["MAX_DECIDED_ANSWER_BYTES", "TxnDriver"]


class TxnMutation(enum.Enum):
    """A deliberately broken variant of the protocol (tests/sim's teeth): never set in a node."""

    DECIDE_BEFORE_PREPARED = "decide-before-prepared"  # a refused prepare counts as a vote for commit
    APPLY_WITHOUT_DECISION = "apply-without-decision"  # a resolver commits an in-doubt prepare on its own
    SECOND_DECISION = "second-decision"  # the coordinator appends a decision even when one is recorded
    # The coordinator knows decisions only from its request-id table (the cache they used to live
    # in): a resolver's abort is refused once its prepare is older than the table remembers, and
    # the prepare stays in doubt.
    DECISION_IN_REQUEST_TABLE = "decision-in-request-table"
    # A failed attempt answers its failure as definite at once, without the coordinator recording
    # the request's outcome (or telling an earlier attempt's): an earlier attempt may still commit.
    RETRY_WITHOUT_LOOKUP = "retry-without-lookup"
    # A read of several shards (a Scan, a read-only Txn) is answered without validating its cut.
    SCAN_WITHOUT_CUT = "scan-without-cut"


class Mode(enum.Enum):
    CLIENT = "client"  # a client's Txn
    RECOVER = "recover"  # a participant's prepare in doubt
    FINISH = "finish"  # a decision the coordinator still holds


class Phase(enum.Enum):
    READING = "reading"  # a read-only Txn's optimistic read (kvstore.core.cut)
    VALIDATING = "validating"
    PREPARING = "preparing"
    DECIDING = "deciding"
    RESOLVING = "resolving"
    DONE = "done"


@dataclasses.dataclass(frozen=True)
class DriverConfig:
    """Bounds, in milliseconds and counts."""

    shard_count: int
    max_attempts: int = 6  # per call (a prepare, the decide, a resolve)
    backoff_first_ms: float = 20
    backoff_max_ms: float = 500
    cut_rounds: int = 4  # a read-only Txn's optimistic reads before it takes locks instead
    mutations: frozenset[TxnMutation] = frozenset()

    def __post_init__(self) -> None:
        assert self.shard_count > 0 and self.max_attempts > 0 and 0 < self.backoff_first_ms <= self.backoff_max_ms


class TxnDriver:
    """One transaction's course (the module docstring)."""

    def __init__(self, config: DriverConfig, txn_id: str, participants: tuple[int, ...], *, mode: Mode,
                 request: kv_pb2.TxnRequest, first_attempt_unix_ms: int, started_unix_ms: int, deadline_ms: float,
                 decision: wal_entry_pb2.TxnDecision | None = None, decided: wal_entry_pb2.TxnDecided | None = None,
                 resolve_at: tuple[int, ...] = ()) -> None:
        """Use `begin`, `recover` or `finish`."""
        assert len(participants) > 1 and list(participants) == sorted(set(participants)), participants
        self.config = config
        self.txn_id = txn_id
        self.mode = mode
        self.request = request
        self.participants = participants
        self.coordinator = participants[0]
        self.others = participants[1:]  # the participants that prepare and resolve
        self.resolve_at = resolve_at or self.others
        self.client_request_id = request.request_id if mode is Mode.CLIENT else (
            decision.request_id if decision is not None else "")
        self.first_attempt_unix_ms = first_attempt_unix_ms  # the client's: what the decision judges
        self.started_unix_ms = started_unix_ms  # this attempt's own start: what its prepares' ids are judged by
        self.deadline_ms = deadline_ms
        self.phase = Phase.PREPARING if mode is Mode.CLIENT else Phase.DECIDING
        self.cut: Cut | None = None  # a read-only Txn's optimistic read, until it answers or falls back
        if mode is Mode.CLIENT and txn.read_only(request):
            self.phase = Phase.READING
            self.cut = Cut(participants, CutConfig(config.cut_rounds,
                                                   TxnMutation.SCAN_WITHOUT_CUT in config.mutations))
        self.reads: dict[int, PartRead] = {}
        self.validated: dict[int, bool] = {}
        self.votes: dict[int, wal_entry_pb2.TxnVote] = {}
        self.commit_sent = False
        self.decision = decision  # what this driver asks the coordinator to record
        self.decided = decided  # the decision read back
        self.failure: errors.StoreError | None = None  # why this attempt aborts, answered once the abort is recorded
        self.replied = mode is not Mode.CLIENT  # a recovery or a finish has nobody to answer
        self.resolved: set[int] = set()  # resolved, or given up on (left to resolvers and finishers)
        self.resolved_ok: set[int] = set()  # resolved: the resolve's answer came back
        self.attempts: dict[tuple[str, int], int] = {}
        self.out_calls: set[tuple[str, int]] = set()
        self.retry_at: dict[tuple[str, int], float] = {}
        self.finished = False
        self._now_ms = 0.0
        self._out: list[Action] = []

    @classmethod
    def begin(cls, config: DriverConfig, txn_id: str, request: kv_pb2.TxnRequest, *, now_unix_ms: int,
              deadline_ms: float) -> TxnDriver:
        """A client's Txn spanning shards (validated), as the attempt `txn_id`."""
        return cls(config, txn_id, txn.participants(request, config.shard_count), mode=Mode.CLIENT, request=request,
                   first_attempt_unix_ms=request.first_attempt_unix_ms or now_unix_ms, started_unix_ms=now_unix_ms,
                   deadline_ms=deadline_ms)

    @classmethod
    def recover(cls, config: DriverConfig, prepared: wal_entry_pb2.TxnPrepare, *, at_shard: int, now_unix_ms: int,
                deadline_ms: float, reason: str) -> TxnDriver:
        """A resolver's driver for a prepare in doubt at `at_shard`: abort unless decided, then
        resolve every participant that may hold a prepare of it (the other participants; the
        coordinator too, when the prepare in doubt is its own: a record of an older release)."""
        participants = tuple(prepared.participants)
        decision = wal_entry_pb2.TxnDecision(txn_id=prepared.txn_id, participants=participants, reason=reason,
                                             request_id=prepared.request_id)
        return cls(config, prepared.txn_id, participants, mode=Mode.RECOVER, request=kv_pb2.TxnRequest(),
                   first_attempt_unix_ms=prepared.first_attempt_unix_ms, started_unix_ms=now_unix_ms,
                   deadline_ms=deadline_ms, decision=decision,
                   resolve_at=tuple(sorted({*participants[1:], at_shard})))

    @classmethod
    def finish(cls, config: DriverConfig, decision: wal_entry_pb2.TxnDecision, decided: wal_entry_pb2.TxnDecided, *,
               now_unix_ms: int, deadline_ms: float, also_here: bool = False) -> TxnDriver:
        """The coordinator's leader finishes a decision its table still holds: resolves the other
        participants again (a replay where they did), then forgets it. `also_here`: the
        coordinator holds a prepare of it too (a record of an older release)."""
        participants = tuple(decision.participants)
        at = participants if also_here else participants[1:]
        return cls(config, decision.txn_id, participants, mode=Mode.FINISH, request=kv_pb2.TxnRequest(),
                   first_attempt_unix_ms=0, started_unix_ms=now_unix_ms, deadline_ms=deadline_ms,
                   decision=decision, decided=decided, resolve_at=at)

    # ---- what shells ask -------------------------------------------------------------------------------

    def wake_at_ms(self) -> float | None:
        times = list(self.retry_at.values())
        if self.phase in _DEADLINED:  # the only phases the deadline ends (the others wait for answers)
            times.append(self.deadline_ms)
        return min(times) if times else None

    def step(self, event: Event, *, now_ms: float) -> list[Action]:
        assert not self.finished or not isinstance(event, Started), "Started after Finished"
        self._now_ms = now_ms
        self._out = []
        if not self.finished:
            _HANDLERS[type(event)](self, event)
        out, self._out = self._out, []
        return out

    # ---- events ----------------------------------------------------------------------------------------

    def _on_started(self, event: Started) -> None:
        if self.mode is Mode.FINISH:
            self._begin_resolving()
        elif self.mode is Mode.RECOVER:
            if TxnMutation.APPLY_WITHOUT_DECISION in self.config.mutations:
                # MUTATION: commit what this shard prepared, without asking the coordinator.
                self.decided = wal_entry_pb2.TxnDecided(commit=True, succeeded=True)
                self._begin_resolving()
                return
            self._send_decide()
        elif self.cut is not None:
            self._cut(self.cut.start())
        else:
            for shard in self.others:
                self._send_prepare(shard)

    def _on_tick(self, event: Tick) -> None:
        now = self._now_ms
        due = [call for call, at in self.retry_at.items() if now >= at]
        for call in due:  # retries belong to the phase that scheduled them (a phase change clears them)
            del self.retry_at[call]
            kind, shard = call
            if kind == "prepare":
                self._send_prepare(shard)
            elif kind == "read":
                self._call(("read", shard), SendRead(shard, self.request))
            elif kind == "decide":
                self._send_decide()
            else:
                self._send_resolve(shard)
        # A decide or a resolve always gets its answer (the shell's call timeout): no deadline for them.
        if self.phase is Phase.PREPARING and now >= self.deadline_ms:
            self._fail(errors.DeadlineError(f"transaction {self.txn_id}: prepares not done by the deadline"))
        elif self.phase in (Phase.READING, Phase.VALIDATING) and now >= self.deadline_ms:
            self._reply(errors.DeadlineError(f"transaction {self.txn_id}: its reads were not one cut by the deadline; "
                                             "nothing was read"))
            self._finish()

    # ---- a read-only Txn: one optimistic cut (kvstore.core.cut), locks only if that fails ----------------

    def _cut(self, action: CutAction) -> None:
        if isinstance(action, ReadParts):
            self.phase = Phase.READING
            self.reads = {}
            for shard in self.participants:
                self._call(("read", shard), SendRead(shard, self.request))
        elif isinstance(action, ValidateParts):
            self.phase = Phase.VALIDATING
            self.validated = {}
            for shard, revision in sorted(action.revisions.items()):
                keys = txn.part_keys(txn.part_of(self.request, shard, self.config.shard_count))
                self._call(("validate", shard), SendValidate(shard, keys, revision))
        elif isinstance(action, Answer):
            try:
                answer = txn.combine(self.request, {s: r.vote for s, r in self.reads.items()}, self.coordinator)
            except errors.InvalidRequestError as too_large:
                self._reply(too_large)
            else:
                self._reply(answer)
            self._finish(committed=True)
        else:  # every round saw a change: take shared locks instead (the prepares and a decision)
            assert isinstance(action, GiveUp)
            self._take_locks()

    def _take_locks(self) -> None:
        """A read-only Txn that could not be read as one cut (every round saw a change, or a
        part could not be read optimistically: a node of an older release) runs as a writing
        one: shared locks at the other participants, the coordinator's part with the decision."""
        self.cut = None
        self.retry_at.clear()
        self.phase = Phase.PREPARING
        for shard in self.others:
            self._send_prepare(shard)

    def _on_read(self, event: ReadAnswered) -> None:
        self.out_calls.discard(("read", event.shard))
        if self.phase is not Phase.READING or self.cut is None:
            return  # late: the transaction moved on
        answer = event.answer
        if isinstance(answer, PartRead):
            self.reads[event.shard] = answer
        elif isinstance(answer, errors.InvalidRequestError):
            self._reply(answer)
            self._finish()
            return
        elif not self._retry(("read", event.shard)):
            self._take_locks()  # the locking path retries and answers on its own terms
            return
        if len(self.reads) == len(self.participants):
            self._cut(self.cut.read({s: r.revision for s, r in self.reads.items()}))

    def _on_validate(self, event: ValidateAnswered) -> None:
        self.out_calls.discard(("validate", event.shard))
        if self.phase is not Phase.VALIDATING or self.cut is None:
            return
        # No answer counts as a change: the next round reads again.
        self.validated[event.shard] = event.answer is True
        if len(self.validated) == len(self.participants):
            self._cut(self.cut.validated([s for s, ok in sorted(self.validated.items()) if not ok]))

    def _on_prepare(self, event: PrepareAnswered) -> None:
        self.out_calls.discard(("prepare", event.shard))
        if self.phase is not Phase.PREPARING:
            return  # late: the transaction moved on
        answer = event.answer
        if isinstance(answer, wal_entry_pb2.TxnVote):
            self.votes[event.shard] = answer
        elif TxnMutation.DECIDE_BEFORE_PREPARED in self.config.mutations:
            self.votes[event.shard] = _blank_vote(self.request, event.shard, self.config.shard_count)
        elif isinstance(answer, errors.TxnConflictError | errors.InvalidRequestError | errors.RequestExpiredError):
            self._fail(answer)
            return
        elif not self._retry(("prepare", event.shard)):
            self._fail(errors.UnavailableError(f"transaction {self.txn_id}: shard {event.shard} could not prepare "
                                               f"({answer})"))
            return
        if len(self.votes) == len(self.others):
            self.decision = wal_entry_pb2.TxnDecision(txn_id=self.txn_id, commit=True, participants=self.participants,
                                                      request_id=self.client_request_id)
            self.commit_sent = True
            self.phase = Phase.DECIDING
            self._send_decide()

    def _on_decide(self, event: DecideAnswered) -> None:
        assert self.phase is Phase.DECIDING and ("decide", 0) in self.out_calls, "a decide answered that was not out"
        self.out_calls.discard(("decide", 0))
        answer = event.answer
        if isinstance(answer, wal_entry_pb2.TxnDecided):
            self.decided = answer
            self._reply_decided(answer)
            self._begin_resolving()
            return
        assert self.decision is not None
        if self.decision.commit and isinstance(answer, errors.TxnConflictError | errors.InvalidRequestError
                                               | errors.RequestExpiredError):
            # The commit was refused and nothing of it queued (a lock of the coordinator held too
            # long, the record too large, the client's first attempt past the horizon): abort. An
            # earlier send of the same commit still in flight competes under the same decision id,
            # and whichever is recorded first is the answer the abort gets (T1).
            self.attempts.pop(("decide", 0), None)
            self._fail(answer)
            return
        if isinstance(answer, errors.RequestExpiredError) and self.mode is Mode.RECOVER:
            # The coordinator holds no decision and judged this abort asked too long ago (this
            # recovery stalled between its check and its question): the next round checks the
            # prepare again and asks afresh. (A coordinator that knows decisions from its
            # request-id table alone, the simulation's mutation, refuses so for good.)
            self._finish(in_doubt=f"the coordinator shard {self.coordinator} refused an abort asked this long ago "
                                  f"({answer}); the prepare is checked again")
            return
        if not self._retry(("decide", 0)):
            why = f"the coordinator shard {self.coordinator} did not answer ({answer})"
            if not self.replied:
                if self.client_request_id or self.commit_sent:
                    self._reply(errors.UnknownOutcomeError(
                        f"transaction {self.txn_id}: {why}; retry with the same request id"))
                else:  # no other attempt can exist, and no commit was sent: nothing will apply
                    self._reply(self.failure or errors.UnavailableError(why))
            self._finish(in_doubt=why if self.mode is Mode.RECOVER else "")

    def _on_resolve(self, event: ResolveAnswered) -> None:
        assert self.phase is Phase.RESOLVING and ("resolve", event.shard) in self.out_calls, \
            f"a resolve of shard {event.shard} answered that was not out"
        self.out_calls.discard(("resolve", event.shard))
        if isinstance(event.answer, wal_entry_pb2.TxnResolve):
            self.resolved_ok.add(event.shard)
            self.resolved.add(event.shard)
        elif not self._retry(("resolve", event.shard)):
            self.resolved.add(event.shard)  # left to the shard's resolver and the coordinator's finishers
        if self.resolved >= set(self.resolve_at):
            if self.resolved_ok >= set(self.others):
                self._out.append(Forget(self.coordinator, self.txn_id))
            self._finish()

    # ---- steps -----------------------------------------------------------------------------------------

    def _fail(self, why: errors.StoreError) -> None:
        """This attempt aborts: its abort decision goes to the coordinator, which records it as
        the client request's outcome (or answers with the outcome recorded before). The client is
        answered with what the abort decision says, not before: an earlier attempt of the same
        request may still commit until then (T5); and a commit refused because the request is
        past the request-id horizon may still find its outcome in the coordinator's decision
        table. Without a request id there is no other attempt: the failure is definite at once,
        unless a commit of this very transaction was sent (an earlier send of it, timed out, may
        still be recorded first: the abort's answer says)."""
        self.failure = why
        self.decision = wal_entry_pb2.TxnDecision(txn_id=self.txn_id, participants=self.participants,
                                                  request_id=self.client_request_id,
                                                  reason=f"{type(why).__name__}: {why}"[:200])
        self.phase = Phase.DECIDING
        self.retry_at.clear()  # no more prepares
        if not self.client_request_id and not self.commit_sent:
            self._reply(why)  # nothing of it can commit: no commit was sent, no other attempt exists
        elif TxnMutation.RETRY_WITHOUT_LOOKUP in self.config.mutations and not self.replied:
            # MUTATION: the request's failure answered before the coordinator recorded it.
            self._reply(errors.TxnAbortedError(f"transaction {self.txn_id} was aborted ({why})", txn_id=self.txn_id))
        self._send_decide()

    def _reply_decided(self, decided: wal_entry_pb2.TxnDecided) -> None:
        if self.replied:
            return
        if decided.commit:
            assert self.commit_sent, "a commit recorded that this driver never sent"
            if not decided.answer:  # a coordinator that built no answer (an older release's): say nothing false
                self._reply(errors.UnknownOutcomeError(f"transaction {self.txn_id} committed, but its coordinator "
                                                       "returned no answer; read the keys"))
                return
            self._reply(kv_pb2.TxnResponse.FromString(decided.answer))
        elif decided.earlier_answer:
            earlier = kv_pb2.TxnResponse.FromString(decided.earlier_answer)
            earlier.result.replayed = True
            self._reply(earlier)
        elif decided.request_unrecorded:
            self._reply(errors.RequestExpiredError(
                f"transaction {self.txn_id} was aborted, but the request id may be older than the coordinator "
                "remembers: the request's outcome is unknown (an earlier attempt may have committed)"))
        elif isinstance(self.failure, errors.InvalidRequestError):
            self._reply(self.failure)  # the request itself is at fault: a new id would fail alike
        elif self.client_request_id:
            why = f" ({self.failure})" if self.failure is not None else ""
            self._reply(errors.TxnAbortedError(
                f"transaction {self.txn_id} was aborted{why}: {decided.reason}; nothing of request "
                f"{self.client_request_id} was or will be applied. A retry with the same request id gets this "
                "answer: send the Txn again with a new request id", txn_id=self.txn_id))
        else:
            self._reply(self.failure or errors.UnavailableError(
                f"transaction {self.txn_id} was aborted ({decided.reason}); nothing was applied: retry"))

    def _begin_resolving(self) -> None:
        assert self.decided is not None
        self.phase = Phase.RESOLVING
        for shard in self.resolve_at:
            self._send_resolve(shard)

    def _finish(self, *, in_doubt: str = "", committed: bool | None = None) -> None:
        self.phase = Phase.DONE
        self.finished = True
        self.retry_at.clear()
        if committed is None and self.decided is not None:
            committed = self.decided.commit
        self._out.append(Finished(committed, in_doubt))

    def _reply(self, answer: kv_pb2.TxnResponse | errors.StoreError) -> None:
        assert not self.replied, "a client answered twice"
        self.replied = True
        self._out.append(Reply(answer))

    # ---- calls -------------------------------------------------------------------------------------------

    def _send_prepare(self, shard: int) -> None:
        self._call(("prepare", shard), SendPrepare(shard, self.txn_id, self.request, self.started_unix_ms,
                                                   self.first_attempt_unix_ms))

    def _send_decide(self) -> None:
        assert self.decision is not None
        decide = Decide(self.decision, self.first_attempt_unix_ms,
                        self.request if self.decision.commit else None,
                        dict(self.votes) if self.decision.commit else {})
        self._call(("decide", 0), SendDecide(self.coordinator, decide, self.started_unix_ms))

    def _send_resolve(self, shard: int) -> None:
        assert self.decided is not None
        self._call(("resolve", shard), SendResolve(shard, wal_entry_pb2.TxnResolve(
            txn_id=self.txn_id, commit=self.decided.commit, succeeded=self.decided.succeeded,
            coordinator=self.coordinator)))

    def _call(self, call: tuple[str, int], action: Action) -> None:
        self.attempts[call] = self.attempts.get(call, 0) + 1
        self.out_calls.add(call)
        self._out.append(action)

    def _retry(self, call: tuple[str, int]) -> bool:
        """Schedule `call` again after a backoff, if attempts and the deadline allow."""
        attempts = self.attempts.get(call, 0)
        if attempts >= self.config.max_attempts:
            return False
        delay = min(self.config.backoff_max_ms, self.config.backoff_first_ms * 2 ** (attempts - 1))
        at = self._now_ms + delay
        if call[0] in ("prepare", "read") and at >= self.deadline_ms:
            return False
        self.retry_at[call] = at
        return True


def _blank_vote(request: kv_pb2.TxnRequest, shard: int, shard_count: int) -> wal_entry_pb2.TxnVote:
    """MUTATION `decide-before-prepared`: a vote for a shard that never prepared (empty results)."""
    part = txn.part_of(request, shard, shard_count)
    blank = kv_pb2.TxnResponse(results=[kv_pb2.TxnOpResult() for _ in part.success]).SerializeToString()
    failure = kv_pb2.TxnResponse(results=[kv_pb2.TxnOpResult() for _ in part.failure]).SerializeToString()
    return wal_entry_pb2.TxnVote(
        compares_held=True,
        success=wal_entry_pb2.TxnBranch(op_indices=[i for i, _ in part.success], results=blank),
        failure=wal_entry_pb2.TxnBranch(op_indices=[i for i, _ in part.failure], results=failure))


_DEADLINED = frozenset({Phase.PREPARING, Phase.READING, Phase.VALIDATING})

_HANDLERS: Mapping[type, Callable[[TxnDriver, Any], None]] = {
    Started: TxnDriver._on_started,
    Tick: TxnDriver._on_tick,
    PrepareAnswered: TxnDriver._on_prepare,
    DecideAnswered: TxnDriver._on_decide,
    ResolveAnswered: TxnDriver._on_resolve,
    ReadAnswered: TxnDriver._on_read,
    ValidateAnswered: TxnDriver._on_validate,
}
assert set(_HANDLERS) == set(Event.__args__), "every event needs a handler"
