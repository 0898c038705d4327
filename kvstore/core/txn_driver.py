"""A cross-shard transaction's driver: prepare everywhere, decide, resolve, answer; pure.

docs/design.md §10.2. The node that received a Txn spanning shards runs one `TxnDriver` per
attempt; a participant's leader runs one in **recovery** (`TxnDriver.recover`) for a prepare in
doubt: it asks the coordinator for the abort decision (answered with the decision already
recorded, if any: first decision wins) and resolves every participant with what it learns.
Like the replica machine, it decides and does nothing: a shell (the node's, the simulation's)
performs each action and reports its answer as an event, exactly one per action:

    SendPrepare(shard)   -> PrepareAnswered(shard, TxnVote | StoreError)
    SendDecide(decision) -> DecideAnswered(TxnDecided | StoreError)
    SendResolve(shard)   -> ResolveAnswered(shard, TxnResolve | StoreError)

A call that timed out is reported as `UnknownOutcomeError` (the record may have been appended).
The driver holds nothing durable: everything it learns is in the WALs, so a driver that dies
leaves its prepares to the participants' resolvers (T3).

What the client is told (W7):

* before a commit decision was ever sent, the transaction cannot commit (only its driver sends
  commit; resolvers send abort): any failure is definite, whatever the state of its prepares;
* once a commit was sent, only the decision read back says: commit (the answer), abort
  (definite), or, when it could not be read back within the bound, unknown.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

from kvstore import errors, limits
from kvstore.core import txn
from kvstore.internal.v1 import wal_entry_pb2
from kvstore.v1 import kv_pb2

# The commit decision carries the client's answer and is one WAL record: the answer must leave
# room in it for the rest of the record (ids, participants, the envelope).
MAX_DECIDED_ANSWER_BYTES = min(limits.MAX_RESPONSE_BYTES, limits.MAX_WAL_RECORD_BYTES - 16 * 1024)


class TxnMutation(enum.Enum):
    """A deliberately broken variant of the protocol (tests/sim's teeth): never set in a node."""

    DECIDE_BEFORE_PREPARED = "decide-before-prepared"  # a refused prepare counts as a vote for commit
    APPLY_WITHOUT_DECISION = "apply-without-decision"  # a resolver commits an in-doubt prepare on its own
    SECOND_DECISION = "second-decision"  # the coordinator appends a decision even when one is recorded


class Phase(enum.Enum):
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
    resolve_wait_ms: float = 2_000  # how long the answer waits for the resolves after the decision
    mutations: frozenset[TxnMutation] = frozenset()

    def __post_init__(self) -> None:
        assert self.shard_count > 0 and self.max_attempts > 0 and 0 < self.backoff_first_ms <= self.backoff_max_ms


# ---- events ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Started:
    pass


@dataclasses.dataclass(frozen=True)
class Tick:
    pass


@dataclasses.dataclass(frozen=True)
class PrepareAnswered:
    shard: int
    answer: wal_entry_pb2.TxnVote | errors.StoreError


@dataclasses.dataclass(frozen=True)
class DecideAnswered:
    answer: wal_entry_pb2.TxnDecided | errors.StoreError


@dataclasses.dataclass(frozen=True)
class ResolveAnswered:
    shard: int
    answer: wal_entry_pb2.TxnResolve | errors.StoreError


Event = Started | Tick | PrepareAnswered | DecideAnswered | ResolveAnswered

# ---- actions ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SendPrepare:
    """Ask `shard`'s leader to append this transaction's prepare (`kvstore.core.txn.prepare_write`)."""

    shard: int
    txn_id: str
    request: kv_pb2.TxnRequest


@dataclasses.dataclass(frozen=True)
class SendDecide:
    """Ask the coordinator shard's leader to append `decision` (`kvstore.core.txn.decision_write`);
    `first_attempt_unix_ms` bounds how old the transaction may be (a resolver's: the prepare's
    time), so a coordinator that may have forgotten the decision refuses instead of guessing."""

    shard: int
    decision: wal_entry_pb2.TxnDecision
    first_attempt_unix_ms: int


@dataclasses.dataclass(frozen=True)
class SendResolve:
    shard: int
    resolve: wal_entry_pb2.TxnResolve


@dataclasses.dataclass(frozen=True)
class Reply:
    """The client's answer (a driver in recovery has no client)."""

    answer: kv_pb2.TxnResponse | errors.StoreError


@dataclasses.dataclass(frozen=True)
class Finished:
    """Nothing more to do. `committed`: the decision read back (None: not learned)."""

    committed: bool | None
    in_doubt: str = ""  # a recovery that could not learn the decision: why (the prepare stays locked)


Action = SendPrepare | SendDecide | SendResolve | Reply | Finished


class TxnDriver:
    """One transaction's course (the module docstring)."""

    def __init__(self, config: DriverConfig, txn_id: str, participants: tuple[int, ...], *,
                 request: kv_pb2.TxnRequest, first_attempt_unix_ms: int, deadline_ms: float,
                 recovering: wal_entry_pb2.TxnPrepare | None = None, reason: str = "",
                 started_unix_ms: int = 0) -> None:
        """Use `begin` (a client's Txn) or `recover` (a prepare in doubt)."""
        assert len(participants) > 1 and list(participants) == sorted(set(participants)), participants
        self.config = config
        self.txn_id = txn_id
        self.request = request
        self.participants = participants
        self.coordinator = participants[0]
        self.first_attempt_unix_ms = first_attempt_unix_ms  # what the decision's admission judges
        self.started_unix_ms = started_unix_ms or first_attempt_unix_ms  # this attempt's own start
        self.deadline_ms = deadline_ms
        self.recovering = recovering
        self.phase = Phase.DECIDING if recovering is not None else Phase.PREPARING
        self.votes: dict[int, wal_entry_pb2.TxnVote] = {}
        self.commit_sent = False
        self.decision: wal_entry_pb2.TxnDecision | None = None
        if recovering is not None:
            self.decision = wal_entry_pb2.TxnDecision(txn_id=txn_id, participants=participants, reason=reason)
        self.decided: wal_entry_pb2.TxnDecided | None = None
        self.answer: kv_pb2.TxnResponse | errors.StoreError | None = None  # held until the resolves are done
        self.replied = recovering is not None  # a resolver has nobody to answer
        self.resolved: set[int] = set()
        self.resolve_until_ms: float | None = None
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
        return cls(config, txn_id, txn.participants(request, config.shard_count), request=request,
                   first_attempt_unix_ms=request.first_attempt_unix_ms or now_unix_ms, deadline_ms=deadline_ms,
                   started_unix_ms=now_unix_ms)

    @classmethod
    def recover(cls, config: DriverConfig, prepared: wal_entry_pb2.TxnPrepare, *, prepared_unix_ms: int,
                deadline_ms: float, reason: str) -> TxnDriver:
        """A resolver's driver for a prepare in doubt: abort unless decided, resolve everywhere.
        `prepared_unix_ms` (the prepare's leader time) bounds the transaction's age for the
        coordinator's request-id horizon."""
        return cls(config, prepared.txn_id, tuple(prepared.participants), request=kv_pb2.TxnRequest(),
                   first_attempt_unix_ms=prepared_unix_ms, deadline_ms=deadline_ms, recovering=prepared,
                   reason=reason)

    # ---- what shells ask -------------------------------------------------------------------------------

    def wake_at_ms(self) -> float | None:
        times = list(self.retry_at.values())
        if self.phase is Phase.PREPARING:  # the only phase the deadline ends (the others wait for answers)
            times.append(self.deadline_ms)
        if self.resolve_until_ms is not None:
            times.append(self.resolve_until_ms)
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
        if self.recovering is not None:
            if TxnMutation.APPLY_WITHOUT_DECISION in self.config.mutations:
                # MUTATION: commit what this shard prepared, without asking the coordinator.
                self.decided = wal_entry_pb2.TxnDecided(commit=True, succeeded=self.recovering.compares_held)
                self._begin_resolving()
                return
            self._send_decide()
            return
        for shard in self.participants:
            self._send_prepare(shard)

    def _on_tick(self, event: Tick) -> None:
        now = self._now_ms
        due = [call for call, at in self.retry_at.items() if now >= at]
        for call in due:  # retries belong to the phase that scheduled them (a phase change clears them)
            del self.retry_at[call]
            kind, shard = call
            if kind == "prepare":
                self._send_prepare(shard)
            elif kind == "decide":
                self._send_decide()
            else:
                self._send_resolve(shard)
        # A decide or a resolve always gets its answer (the shell's call timeout): no deadline for them.
        if self.phase is Phase.PREPARING and now >= self.deadline_ms:
            self._abort(errors.DeadlineError(f"transaction {self.txn_id}: prepares not done by the deadline; "
                                             "nothing was applied"))
        elif self.phase is Phase.RESOLVING and self.resolve_until_ms is not None and now >= self.resolve_until_ms:
            self._finish()

    def _on_prepare(self, event: PrepareAnswered) -> None:
        self.out_calls.discard(("prepare", event.shard))
        if self.phase is not Phase.PREPARING:
            return  # late: the transaction moved on
        answer = event.answer
        if isinstance(answer, wal_entry_pb2.TxnVote):
            self.votes[event.shard] = answer
        elif TxnMutation.DECIDE_BEFORE_PREPARED in self.config.mutations:
            self.votes[event.shard] = _blank_vote(self.request, event.shard, self.config.shard_count)
        elif isinstance(answer, errors.TxnConflictError):
            self._abort(errors.UnknownOutcomeError(str(answer)) if answer.same_request else answer)
            return
        elif isinstance(answer, errors.InvalidRequestError):
            self._abort(answer)
            return
        elif not self._retry(("prepare", event.shard)):
            self._abort(errors.UnavailableError(f"transaction {self.txn_id}: shard {event.shard} could not prepare "
                                                f"({answer}); nothing was applied"))
            return
        if len(self.votes) == len(self.participants):
            try:
                response = txn.combine(self.request, self.votes, self.coordinator,
                                       max_response_bytes=MAX_DECIDED_ANSWER_BYTES)
            except errors.InvalidRequestError as too_large:
                self._abort(too_large)
                return
            self.decision = wal_entry_pb2.TxnDecision(
                txn_id=self.txn_id, commit=True, succeeded=response.succeeded, participants=self.participants,
                request_id=self.request.request_id, answer=response.SerializeToString())
            self.commit_sent = True
            self.phase = Phase.DECIDING
            self._send_decide()

    def _on_decide(self, event: DecideAnswered) -> None:
        assert self.phase is Phase.DECIDING and ("decide", 0) in self.out_calls, "a decide answered that was not out"
        self.out_calls.discard(("decide", 0))
        answer = event.answer
        if isinstance(answer, errors.RequestExpiredError) and self.recovering is not None:
            # The coordinator may have forgotten the decision: it refuses to guess.
            self._finish(in_doubt=f"the coordinator shard {self.coordinator} may have forgotten the decision "
                                  f"({answer}): an operator must resolve it")
            return
        if isinstance(answer, errors.RequestExpiredError | errors.InvalidRequestError) and self.decision is not None \
                and self.decision.commit:
            # The commit was refused, definitely and for every attempt alike (the client's first
            # attempt is past the request-id horizon, or the record does not fit): no commit can
            # exist. Abort this transaction (with its own, fresh time) and say so.
            self.first_attempt_unix_ms = self.started_unix_ms
            self.decision = wal_entry_pb2.TxnDecision(txn_id=self.txn_id, participants=self.participants,
                                                      reason=f"{type(answer).__name__}: {answer}"[:200])
            self.attempts.pop(("decide", 0), None)
            self._reply(answer)
            self._send_decide()
            return
        if isinstance(answer, errors.StoreError):
            if not self._retry(("decide", 0)):
                self._decide_unknown(f"the coordinator shard {self.coordinator} did not answer ({answer})")
            return
        self.decided = answer
        self._reply_decided(answer)
        self._begin_resolving()

    def _on_resolve(self, event: ResolveAnswered) -> None:
        assert self.phase is Phase.RESOLVING and ("resolve", event.shard) in self.out_calls, \
            f"a resolve of shard {event.shard} answered that was not out"
        self.out_calls.discard(("resolve", event.shard))
        if isinstance(event.answer, wal_entry_pb2.TxnResolve) or not self._retry(("resolve", event.shard)):
            self.resolved.add(event.shard)  # done, or left to the shard's resolver
        if self.resolved >= set(self.participants):
            self._finish()

    # ---- steps -----------------------------------------------------------------------------------------

    def _abort(self, why: errors.StoreError) -> None:
        """Decide abort: the client's answer is `why`, definite (no commit was ever sent) unless
        `why` itself says the outcome is unknown (an earlier attempt of the request is running)."""
        assert not self.commit_sent
        self.decision = wal_entry_pb2.TxnDecision(txn_id=self.txn_id, participants=self.participants,
                                                  reason=f"{type(why).__name__}: {why}"[:200])
        self.phase = Phase.DECIDING
        self.retry_at.clear()  # no more prepares
        # Definite at once: the abort only releases the locks sooner; its fate changes nothing.
        self._reply(why)
        self._send_decide()

    def _reply_decided(self, decided: wal_entry_pb2.TxnDecided) -> None:
        if self.replied:
            return
        if decided.commit:
            assert self.decision is not None and self.decision.commit, "a commit recorded that this driver never sent"
            response = kv_pb2.TxnResponse.FromString(self.decision.answer)
            response.result.CopyFrom(kv_pb2.WriteResult(shard=self.coordinator, revision=decided.revision))
            self.answer = response
        elif decided.earlier_answer:
            earlier = kv_pb2.TxnResponse.FromString(decided.earlier_answer)
            earlier.result.replayed = True
            self.answer = earlier
        else:
            self.answer = errors.UnavailableError(
                f"transaction {self.txn_id} was aborted ({decided.reason}); nothing was applied: retry")

    def _decide_unknown(self, why: str) -> None:
        if self.commit_sent and not self.replied:
            self._reply(errors.UnknownOutcomeError(f"transaction {self.txn_id}: {why}; retry with the same request id"))
        self._finish(in_doubt=why if self.recovering is not None else "")

    def _begin_resolving(self) -> None:
        assert self.decided is not None
        self.phase = Phase.RESOLVING
        self.resolve_until_ms = self._now_ms + self.config.resolve_wait_ms
        for shard in self.participants:
            self._send_resolve(shard)

    def _finish(self, *, in_doubt: str = "") -> None:
        if self.answer is not None and not self.replied:
            self._reply(self.answer)
        self.phase = Phase.DONE
        self.finished = True
        self.retry_at.clear()
        self.resolve_until_ms = None
        self._out.append(Finished(None if self.decided is None else self.decided.commit, in_doubt))

    def _reply(self, answer: kv_pb2.TxnResponse | errors.StoreError) -> None:
        assert not self.replied, "a client answered twice"
        self.replied = True
        self._out.append(Reply(answer))

    # ---- calls -------------------------------------------------------------------------------------------

    def _send_prepare(self, shard: int) -> None:
        self._call(("prepare", shard), SendPrepare(shard, self.txn_id, self.request))

    def _send_decide(self) -> None:
        assert self.decision is not None
        self._call(("decide", 0), SendDecide(self.coordinator, self.decision, self.first_attempt_unix_ms))

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
        if call[0] != "resolve" and at >= self.deadline_ms:
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


_HANDLERS: Mapping[type, Callable[[TxnDriver, Any], None]] = {
    Started: TxnDriver._on_started,
    Tick: TxnDriver._on_tick,
    PrepareAnswered: TxnDriver._on_prepare,
    DecideAnswered: TxnDriver._on_decide,
    ResolveAnswered: TxnDriver._on_resolve,
}
assert set(_HANDLERS) == set(Event.__args__), "every event needs a handler"
