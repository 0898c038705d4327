"""A shard replica's leadership as a pure state machine: what it is, what it may do next, and
what every append outcome leads to. No I/O, no clock, no asyncio.

The replica machine (`kvstore.core.replica.ReplicaMachine`) composes it: it reports each
result of the drivers' I/O (fence, replay, append, read the partition end) here, and this
machine answers with what the leadership may do next. Transitions are explicit (`_VALID`, aiokafka's transaction manager
style) and checked: an impossible report is a bug, never silently absorbed.

Life of a leadership (docs/design.md §4-6)::

    FOLLOWER --begin_fencing--> FENCING --fenced(end)--> CATCHING_UP --replayed_to(end)--> LEADING
    LEADING --append failed--> FENCING (unknown outcome: fence again, which settles it)
                           --> CATCHING_UP (aborted: read the settled end, replay, lead again)
                           --> STEPPING_DOWN (fenced, writer fatal, crashed)
    any leading state --resign/stop/lost--> STEPPING_DOWN --stepped_down--> FOLLOWER | STOPPED

The term of a leadership is the partition end when it last fenced, plus one: every fence sees
at least the end any earlier fence saw, so terms never go back. That holds for a re-fence after
an unknown outcome too, which takes a new term: another leader may have written meanwhile, with
a term above the old one (sim seed 16: a leader cut off from Kafka re-fenced after a newer one
had written, and kept a term below it).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from kvstore import errors
from wal.errors import FencedError, UnknownOutcomeError, WalError, WriterFatalError
from wal.offsets import batch_end


class Role(enum.Enum):
    FOLLOWER = "follower"  # tails the shard read_committed (or idles at its checkpoint)
    FENCING = "fencing"  # init_transactions on the shard's transactional id (W4)
    CATCHING_UP = "catching_up"  # replaying to the end it fenced at (W6), or after an abort (W2)
    LEADING = "leading"  # accepts writes; at most one batch in flight
    STEPPING_DOWN = "stepping_down"  # leaving: the batch in flight is answered, nothing new is written
    STOPPED = "stopped"


_VALID: dict[Role, frozenset[Role]] = {
    Role.FOLLOWER: frozenset({Role.FENCING, Role.STOPPED}),
    Role.FENCING: frozenset({Role.CATCHING_UP, Role.STEPPING_DOWN}),
    Role.CATCHING_UP: frozenset({Role.LEADING, Role.STEPPING_DOWN}),
    Role.LEADING: frozenset({Role.FENCING, Role.CATCHING_UP, Role.STEPPING_DOWN}),
    Role.STEPPING_DOWN: frozenset({Role.FOLLOWER, Role.STOPPED}),
    Role.STOPPED: frozenset(),
}


# Reasons a replica must not lead (`RoleMachine.mark_unable`), cleared one by one.
BROKEN = "broken"  # a committed batch could not be applied here: rebuild first
REBUILDING = "rebuilding"  # wiped and replaying: lead again once caught up
NEEDS_SNAPSHOT = "needs_snapshot"  # the WAL was truncated above its checkpoint: only a snapshot helps


class AppendOutcome(enum.Enum):
    """What an append ended in, as the WAL layer reported it (the driver classifies its errors)."""

    ABORTED = "aborted"  # definite: nothing written (W2 mismatch, abortable or retriable error)
    # Definite too, but the writer retired its producer (the abort itself failed, or the commit was
    # refused before EndTxn): its next call would be an init_transactions, a fence of its own.
    ABORTED_RETIRED = "aborted_retired"
    UNKNOWN = "unknown"  # W7: may have committed; the producer is retired
    UNKNOWN_FENCED = "unknown_fenced"  # may have committed, and someone fenced us meanwhile
    FENCED = "fenced"  # definite: a newer writer holds the shard (W4)
    WRITER_FATAL = "writer_fatal"  # definite: the producer is unusable
    CRASHED = "crashed"  # not the WAL's word (a bug): commit may have run, so unknown
    CANCELLED = "cancelled"  # the node stopped while the append ran: unknown


class Next(enum.Enum):
    """What follows a failed append (`kvstore.core.replica.ReplicaMachine` does it)."""

    REFENCE = "refence"  # init_transactions again (settles the undecided transaction), replay, lead
    SETTLE = "settle"  # read the settled end (LSO once no transaction is open), replay, lead
    STEP_DOWN = "step_down"  # leave this leadership; the loop takes the shard again if still assigned


@dataclasses.dataclass(frozen=True)
class AppendDecision:
    """The answer a failed batch's clients get, and what the leader does next."""

    unknown: bool  # True: UnknownOutcomeError (W7), else UnavailableError (definite, retriable)
    message: str
    then: Next
    fencing: bool = False  # count it as a fencing (metric)

    def error(self, shard: int, detail: str = "") -> errors.StoreError:
        text = f"shard {shard}: {self.message}" + (f" ({detail})" if detail else "")
        return errors.UnknownOutcomeError(text) if self.unknown else errors.UnavailableError(text)


# The table: every append outcome, the answer its clients get, and what follows (docs/design.md §4.2:
# fenced -> stop leading; abortable -> abort, fail retriable, keep leading after learning the end
# again (W2); unknown -> "unknown outcome" and re-initialise before the next batch).
APPEND_DECISIONS: dict[AppendOutcome, AppendDecision] = {
    AppendOutcome.ABORTED: AppendDecision(False, "batch aborted; retry", Next.SETTLE),
    # Fenced again explicitly, with a new term, rather than by the writer's next append behind the
    # machine's back: that one would fence any newer leader with records still stamped with the
    # old term (sim seed 15: terms went back after a broker outage).
    AppendOutcome.ABORTED_RETIRED: AppendDecision(False, "batch aborted; retry", Next.REFENCE),
    AppendOutcome.UNKNOWN: AppendDecision(True, "commit outcome unknown; retry with the same request id",
                                          Next.REFENCE),
    AppendOutcome.UNKNOWN_FENCED: AppendDecision(True, "commit outcome unknown (fenced meanwhile); retry with the "
                                                       "same request id", Next.STEP_DOWN, fencing=True),
    AppendOutcome.FENCED: AppendDecision(False, "fenced by a newer leader; retry", Next.STEP_DOWN, fencing=True),
    AppendOutcome.WRITER_FATAL: AppendDecision(False, "leader's writer stopped; retry", Next.STEP_DOWN),
    AppendOutcome.CRASHED: AppendDecision(True, "the append failed unexpectedly; retry with the same request id",
                                          Next.STEP_DOWN),
    AppendOutcome.CANCELLED: AppendDecision(True, "node stopping while the batch was committing; retry with the "
                                                  "same request id", Next.STEP_DOWN),
}
assert set(APPEND_DECISIONS) == set(AppendOutcome), "every append outcome needs a decision"


def append_outcome(error: BaseException | None, writer_retired: bool) -> AppendOutcome:
    """What an append's failure says, for the table above; every driver maps its writer's
    errors here (the node's librdkafka shell, the simulation's guard shell). `writer_retired`:
    the writer's next call would init a fresh producer (`wal.guard.Phase.NEEDS_INIT`). Anything
    but the WAL's own word (a bug, a client library error, a cancellation: None) may have come
    after commit_transaction ran, so the outcome is unknown (W7)."""
    if isinstance(error, UnknownOutcomeError):
        return AppendOutcome.UNKNOWN_FENCED if error.fenced else AppendOutcome.UNKNOWN
    if isinstance(error, FencedError):
        return AppendOutcome.FENCED
    if isinstance(error, WriterFatalError):
        return AppendOutcome.WRITER_FATAL
    if not isinstance(error, WalError):
        return AppendOutcome.CRASHED
    return AppendOutcome.ABORTED_RETIRED if writer_retired else AppendOutcome.ABORTED


@dataclasses.dataclass(frozen=True)
class BarrierVerdict:
    """A linearizable read barrier's outcome (docs/design.md §5): serve once everything below
    `wait_for` is applied, or (`probe`) refuse and probe the log: someone else wrote beyond
    everything this leader wrote, so its view is stale."""

    wait_for: int | None
    probe: bool = False
    why: str = ""


class RoleMachine:
    """One shard replica's leadership state. The shell reports; the machine decides."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.role = Role.FOLLOWER
        self.term = 0
        self.want_lead = False  # the group assigned the shard to this node (and nothing forbids it)
        self.stopping = False
        self.upcoming: int | None = None  # where the next batch's first record must land (W1)
        self.written_end: int | None = None  # the upcoming offset once the batch in flight commits
        # Why this replica must not lead (a committed batch it could not apply, a rebuild under
        # way, a WAL truncated above its checkpoint): leadership is refused until cleared.
        self.unable: dict[str, str] = {}
        self._refencing = False  # the FENCING in progress settles an unknown outcome of this leadership

    # ---- intent ------------------------------------------------------------------------------------

    def set_lead(self, lead: bool) -> str | None:
        """The group gave (or took) the shard. Returns why it cannot lead, or None."""
        why = self.unable_reason() if lead else None
        self.want_lead = lead and why is None
        return why

    def stop(self) -> None:
        self.stopping = True

    def unable_reason(self) -> str | None:
        return "; ".join(self.unable.values()) if self.unable else None

    def mark_unable(self, kind: str, why: str) -> None:
        """`kind` (BROKEN, REBUILDING, NEEDS_SNAPSHOT) forbids leading until `clear_unable(kind)`."""
        self.unable[kind] = why
        self.want_lead = False

    def clear_unable(self, kind: str) -> bool:
        """True if that was the last reason: the node may ask to lead again."""
        return self.unable.pop(kind, None) is not None and not self.unable

    @property
    def refencing(self) -> bool:
        """The FENCING under way settles an unknown outcome of this leadership (it takes a new term all the same)."""
        return self._refencing

    @property
    def keeps_leading(self) -> bool:
        return self.want_lead and not self.stopping

    # ---- leadership life -------------------------------------------------------------------------

    def begin_fencing(self) -> None:
        """A new leadership: its first fence sets its term (never a re-fence's leftover)."""
        assert self.keeps_leading, "fencing without being asked to lead"
        self._refencing = False
        self._to(Role.FENCING)

    def fenced(self, end: int) -> bool:
        """init_transactions returned with the partition's end: True to catch up to it (W6),
        False when the shard was given up meanwhile (the machine steps down). Every fence sets
        the term (the module docstring): the end never goes back, so neither does the term."""
        assert self.role is Role.FENCING and end >= 0, (self.role, end)
        if not self.keeps_leading:
            self._to(Role.STEPPING_DOWN)
            return False
        assert end + 1 >= self.term or not self._refencing, f"re-fenced at {end}, below term {self.term}"
        self.term = end + 1
        self._refencing = False
        self._to(Role.CATCHING_UP)
        return True

    def replayed_to(self, end: int) -> bool:
        """Everything below `end` is applied: True to lead from `end` (W6), False to step down."""
        assert self.role is Role.CATCHING_UP, self.role
        if not self.keeps_leading:
            self._to(Role.STEPPING_DOWN)
            return False
        self.upcoming = end
        self._to(Role.LEADING)
        return True

    def may_start_batch(self) -> bool:
        return self.role is Role.LEADING and self.keeps_leading and self.written_end is None

    def batch_started(self, revision: int, records: int) -> None:
        assert self.role is Role.LEADING, f"batch started while {self.role.value}"
        assert self.written_end is None, f"one batch in flight at most: one ends at {self.written_end}"
        assert revision == self.upcoming, f"batch at {revision}, upcoming offset {self.upcoming} (W1)"
        assert records > 0
        self.written_end = batch_end(revision, records)

    def batch_committed(self, offsets: Sequence[int], upcoming: int) -> None:
        """W2 held (the guard checked every offset before commit); the paired check is here."""
        assert self.upcoming is not None and self.written_end is not None
        expected = tuple(range(self.upcoming, self.upcoming + len(offsets)))
        assert tuple(offsets) == expected, f"W2 broken: delivered {tuple(offsets)}, expected {expected}"
        assert upcoming == self.written_end, f"upcoming {upcoming} after commit, expected {self.written_end}"
        self.upcoming = upcoming
        self.written_end = None

    def batch_failed(self, outcome: AppendOutcome) -> AppendDecision:
        """The table above, applied: after any abort or unknown outcome the upcoming offset is
        unknown until read from the partition again (W2)."""
        decision = APPEND_DECISIONS[outcome]
        self.written_end = None
        self.upcoming = None
        if decision.then is Next.STEP_DOWN or not self.keeps_leading:
            self._to(Role.STEPPING_DOWN)
            return dataclasses.replace(decision, then=Next.STEP_DOWN)
        self._refencing = decision.then is Next.REFENCE
        self._to(Role.FENCING if self._refencing else Role.CATCHING_UP)
        return decision

    def resync_failed(self) -> None:
        """Re-fencing or replaying after an abort failed: leave; the loop starts over."""
        self.step_down()

    def apply_failed(self, why: str) -> None:
        """A committed batch could not be applied locally: give the shard up and rebuild."""
        self.mark_unable("broken", why)
        if self.role is not Role.STEPPING_DOWN:
            self._to(Role.STEPPING_DOWN)

    def step_down(self) -> None:
        """Leave any leading state (resigned, lost the group assignment, stopping)."""
        if self.role in (Role.FENCING, Role.CATCHING_UP, Role.LEADING):
            self._to(Role.STEPPING_DOWN)

    def stepped_down(self) -> None:
        """Nothing of this leadership runs any more."""
        if self.role is Role.STEPPING_DOWN:
            self._to(Role.STOPPED if self.stopping else Role.FOLLOWER)
        self.upcoming = None
        self.written_end = None
        self._refencing = False  # a re-fence cut short belongs to the leadership that ended

    def stopped(self) -> None:
        """The replica stopped (after `stop` and the loop's exit)."""
        self.stopping = True
        self.step_down()
        if self.role is not Role.STOPPED:
            self._to(Role.STOPPED)
        self.upcoming = None
        self.written_end = None

    # ---- questions the replica machine asks ---------------------------------------------------------------

    def write_refusal(self, leader_hint: str | None) -> errors.StoreError | None:
        """Why a write or a leader read must be refused here right now, or None to take it."""
        if self.role is Role.LEADING and self.keeps_leading:
            return None
        if self.role in (Role.FENCING, Role.CATCHING_UP) or self.keeps_leading:
            return errors.UnavailableError(f"shard {self.shard}: this node is taking over; retry")
        return errors.NotLeaderError(self.shard, leader_hint or None)

    def barrier(self, high_watermark: int) -> BarrierVerdict:
        """A read barrier's high watermark e (the read_uncommitted end, docs/design.md §5): if e lies
        beyond anything this leader wrote, another writer exists; else serve once below e is
        applied."""
        written = self.written_end if self.written_end is not None else self.upcoming
        if written is None or high_watermark > written:
            return BarrierVerdict(None, probe=True, why=f"shard {self.shard}: high watermark {high_watermark} beyond "
                                                          f"our writes ({written}); retry")
        return BarrierVerdict(high_watermark)

    # ---- internals -------------------------------------------------------------------------------

    def _to(self, role: Role) -> None:
        assert role in _VALID[self.role], f"shard {self.shard}: no transition {self.role.value} -> {role.value}"
        self.role = role
