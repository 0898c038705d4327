"""One shard replica's whole protocol as a pure machine: events in, actions out, no I/O.

This is to the store what `wal.guard.Guard` is to the log (docs/design.md §5.1): the asyncio
node (`kvstore.server.replica.ShardReplica`) and the deterministic simulation (tests/sim) are
two drivers of this one machine. A driver reports what happened (`step(event, now_ms=,
unix_ms=)`), performs the actions returned, in order, and reports their results as further
events; it decides nothing. The machine reads the replica's committed state through a read-only
`StateView` (admission and batch planning look keys and request ids up; a read of local state is
not I/O in the protocol's sense, as etcd's raft reads its `Storage`), and keeps no clock: time
arrives with every event, and `wake_at_ms()` says when it next wants a `Tick`.

What it decides, all of it:

* **following**: rewind over an assumed marker slot, load a snapshot into an empty replica, read
  the end, wait out a checkpoint beyond the end (`kvstore.core.recovery.beyond_end`), tail and
  apply, recover from a log start above the checkpoint (a snapshot, or "needs a snapshot");
* **leading** (`kvstore.core.role.RoleMachine`: the leadership's states, terms, the append
  decision table): fence (W4), catch up to the fenced end (W6), group commit (admission, linger,
  carry-over, one batch in flight, `kvstore.core.batch`), apply and answer after the commit
  (W5), what a failed append leads to (re-fence, settled end, step down: W2, W7), stepping down
  and taking the shard again after a pause;
* **linearizable reads**: the read-barrier rounds (one high-watermark query in flight, reads
  arriving meanwhile share the next), the barrier's verdict, the probe, the waits for apply;
* **life**: rebuilding after a committed batch could not be applied, stopping.

Every action that the machine needs a result of is answered by exactly one event naming it
(`Fence` -> `Fenced` | `FenceFailed`, ...). Transitions of the leadership are explicit and
checked (`kvstore.core.role._VALID`); so is every event against the state it may arrive in. A
`Mutation` deliberately breaks one rule, for the simulation to prove that it catches it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvstore import errors
from kvstore import limits as store_limits
from kvstore.core.batch import Answer, BatchLimits, RequestTable, Write, admit, plan_batch, probe_write
from kvstore.core.evaluate import Response
from kvstore.core.locks import LockView
from kvstore.core.recovery import Beyond, beyond_end
from kvstore.core.role import (
    BROKEN,
    NEEDS_SNAPSHOT,
    REBUILDING,
    AppendOutcome,
    Next,
    Role,
    RoleMachine,
)
from kvstore.core.state import KeyState
from wal.offsets import batch_end

# ---- configuration --------------------------------------------------------------------------------


class Mutation(enum.Enum):
    """A deliberately broken variant of the protocol (tests/sim's teeth): never set in a node."""

    SKIP_READ_BARRIER = "skip-read-barrier"  # serve linearizable reads without asking the log's end
    SKIP_MARKER_REWIND = "skip-marker-rewind"  # never re-read the slot a leader assumed its marker took
    SKIP_REQUEST_DEDUPE = "skip-request-dedupe"  # admit every attempt as new (no replay, no "in progress")
    ANSWER_BEFORE_COMMIT = "answer-before-commit"  # answer a batch's writers when it is appended, not committed
    SKIP_READ_LOCK_WAIT = "skip-read-lock-wait"  # serve a read of a key a prepared transaction locked at once


@dataclasses.dataclass(frozen=True)
class ReplicaConfig:
    """The machine's bounds, in milliseconds and counts (the drivers take them from settings)."""

    shard: int
    standby: bool = True  # follow the shard while not leading (a takeover then replays a short tail)
    batch_limits: BatchLimits = dataclasses.field(default_factory=lambda: BatchLimits(
        store_limits.MAX_BATCH_RECORDS, store_limits.MAX_BATCH_BYTES, store_limits.MAX_WAL_RECORD_BYTES))
    max_pending: int = 10_000  # queued writes (carried ones not counted): beyond, OverloadedError
    linger_ms: float = 2.0  # a lone write waits this long for company before its batch starts
    bootstrap_timeout_ms: float = 120_000  # catching up to the fenced end takes longer: give the shard up
    barrier_timeout_ms: float = 10_000  # a read waits this long for the replica to apply the end it read
    # A write meeting a key locked by a prepared cross-shard transaction waits this long (retried
    # after every apply) before it is refused with TxnConflictError (docs/design.md §10). Waits
    # are bounded, so no deadlock between transactions outlives this; 0: refuse at once.
    lock_wait_ms: float = 500
    # A linearizable read of a key a prepared cross-shard transaction locked exclusively waits
    # (T4) for an apply that releases it, at most `read_lock_wait_ms` (then UNAVAILABLE); after
    # `read_kick_ms` it asks for the holders to be resolved at once (`ResolveNow`).
    read_lock_wait_ms: float = 3_000
    read_kick_ms: float = 500
    refence_pause_ms: float = 1_000  # fenced while still assigned the shard: pause, then fence back
    beyond_end_grace_ms: float = 45_000  # a checkpoint beyond the end must last this long to be believed
    beyond_end_poll_ms: float = 500  # how often the end is read again meanwhile
    backoff_first_ms: float = 200  # after a failed step (a fetch, a fence, ...): retry after this,
    backoff_max_ms: float = 5_000  # doubling up to this
    request_horizon_ms: int | None = None  # None: kvstore.limits' (the simulation shrinks it)
    clock_skew_ms: int | None = None
    mutations: frozenset[Mutation] = frozenset()

    def __post_init__(self) -> None:
        assert self.shard >= 0 and self.max_pending > 0 and self.linger_ms >= 0 and self.lock_wait_ms >= 0, self
        assert 0 < self.backoff_first_ms <= self.backoff_max_ms, self
        assert self.beyond_end_poll_ms > 0 and self.beyond_end_grace_ms >= 0, self


class StateView(RequestTable, Protocol):
    """What the machine reads of the replica's committed state: the store (LevelDB in a node,
    `MemoryShard` in the simulation), its keys and request ids. `applied_offset` is the
    checkpoint: every record below it applied, none above."""

    @property
    def applied_offset(self) -> int: ...

    def get(self, key: bytes) -> KeyState | None: ...

    @property
    def locks(self) -> LockView:
        """The prepared cross-shard transactions and their locks (docs/design.md §10)."""
        ...


# ---- events (what happened) -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Started:
    """The replica runs (once, first)."""


@dataclasses.dataclass(frozen=True)
class LeadChanged:
    """The group gave the shard to this node (`lead`) or took it."""

    lead: bool


@dataclasses.dataclass(frozen=True)
class StopRequested:
    """Graceful stop: no new writes, the batch in flight finishes and is answered."""


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passed (`wake_at_ms` asked for it, or the driver looks in)."""


@dataclasses.dataclass(frozen=True)
class WriteArrived:
    """A client's write (`kvstore.core.batch.write_of`), `size` its request bytes (a batch's
    pre-bound), `leader_hint` where the group says the leader is (for a refusal)."""

    ticket: int
    write: Write
    size: int
    leader_hint: str = ""


@dataclasses.dataclass(frozen=True)
class ReadArrived:
    """A linearizable read asks for the barrier; answered `READY` when it may read locally: the
    barrier passed, and none of its `keys`, nor any key in its `span` ([start, end), end None:
    to the end), is exclusively locked by a prepared cross-shard transaction (T4)."""

    ticket: int
    leader_hint: str = ""
    keys: tuple[bytes, ...] = ()
    span: tuple[bytes, bytes | None] | None = None


@dataclasses.dataclass(frozen=True)
class ClientGone:
    """The client of `ticket` stopped waiting (deadline, cancellation): not written if still queued."""

    ticket: int


@dataclasses.dataclass(frozen=True)
class ProbeRequested:
    """Someone may have fenced this leader (the group view changed): probe the log."""


@dataclasses.dataclass(frozen=True)
class Fenced:
    end: int  # the partition's end once init_transactions returned (the guard read it, W6)


@dataclasses.dataclass(frozen=True)
class FenceFailed:
    reason: str


class EndPurpose(enum.Enum):
    FOLLOW = "follow"  # the end a follower catches up to (then `caught_up`)
    CONFIRM = "confirm"  # re-reading while a checkpoint lies beyond the end
    BARRIER = "barrier"  # a read barrier's high watermark
    SETTLE = "settle"  # the settled end after an aborted batch (LSO == HW)


@dataclasses.dataclass(frozen=True)
class EndRead:
    purpose: EndPurpose
    end: int


@dataclasses.dataclass(frozen=True)
class EndReadFailed:
    purpose: EndPurpose
    reason: str


@dataclasses.dataclass(frozen=True)
class Fetched:
    """One poll from `from_offset`: the records W3 accepted (offset, payload) and the reader's
    position after them (past rejected records and markers too)."""

    from_offset: int
    records: Sequence[tuple[int, bytes]]
    position: int


@dataclasses.dataclass(frozen=True)
class FetchOutOfRange:
    """The WAL no longer covers `from_offset` (auto.offset.reset=error): below its start
    (truncated) or above its end."""

    from_offset: int
    below_start: bool
    log_start: int
    log_end: int


@dataclasses.dataclass(frozen=True)
class FetchFailed:
    reason: str


@dataclasses.dataclass(frozen=True)
class Replayed:
    """`ApplyReplayed` done: the records are in the store, the checkpoint moved."""


@dataclasses.dataclass(frozen=True)
class ReplayApplyFailed:
    """`ApplyReplayed` failed (the store refused the write batch: nothing of it was applied)."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Rewound:
    """`RewindUnverified` done (moved or not: the view says where the checkpoint is)."""


@dataclasses.dataclass(frozen=True)
class Wiped:
    """`Wipe` done: the replica is empty."""


@dataclasses.dataclass(frozen=True)
class SnapshotDone:
    loaded: bool  # a usable snapshot replaced the replica (its checkpoint is the snapshot's cut)


@dataclasses.dataclass(frozen=True)
class Appended:
    """The batch committed: where its records landed (the guard checked each, W2)."""

    offsets: tuple[int, ...]
    upcoming: int
    marker_slot: int


@dataclasses.dataclass(frozen=True)
class AppendFailed:
    outcome: AppendOutcome
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class CommitApplied:
    """`ApplyCommitted` and the answers after it were performed; `error` if the apply failed."""

    error: str | None = None


Event = (Started | LeadChanged | StopRequested | Tick | WriteArrived | ReadArrived | ClientGone | ProbeRequested
         | Fenced | FenceFailed | EndRead | EndReadFailed | Fetched | FetchOutOfRange | FetchFailed | Replayed
         | ReplayApplyFailed | Rewound | Wiped | SnapshotDone | Appended | AppendFailed | CommitApplied)

# ---- actions (what the driver must do) --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fence:
    """init_transactions on the shard's transactional id (W4), then report `Fenced(end)`."""


@dataclasses.dataclass(frozen=True)
class SetTerm:
    """Stamp this leadership's term on every record the writer appends from now on."""

    term: int


@dataclasses.dataclass(frozen=True)
class Append:
    """Append `payloads` in one transaction at `revision` exactly (W1, W2)."""

    revision: int
    payloads: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class ReadEnd:
    """Read the partition's high watermark (never the LSO), report `EndRead(purpose, end)`."""

    purpose: EndPurpose


@dataclasses.dataclass(frozen=True)
class ReadSettledEnd:
    """After an aborted batch: the end once no transaction is open (LSO == HW), as
    `EndRead(SETTLE, end)`."""


@dataclasses.dataclass(frozen=True)
class Fetch:
    """One poll read_committed from `from_offset` (the checkpoint): `upto` None tails the shard,
    else catches up to `upto` (poll briskly)."""

    from_offset: int
    upto: int | None


@dataclasses.dataclass(frozen=True)
class ApplyReplayed:
    """Apply records a fetch accepted, with `checkpoint` (the reader's position); report
    `Replayed`, or `ReplayApplyFailed`."""

    records: tuple[tuple[int, bytes], ...]
    checkpoint: int


@dataclasses.dataclass(frozen=True)
class ApplyCommitted:
    """Apply this leader's committed batch with its checkpoint and the assumed marker slot (W5),
    then perform the answers that follow, then report `CommitApplied` (with the error, if any:
    the answers go out regardless, the WAL is the truth)."""

    records: tuple[tuple[int, bytes], ...]
    checkpoint: int
    marker_slot: int


class Ready(enum.Enum):
    READY = "ready"  # a read may now be served from the local state


READY = Ready.READY
Reply = Answer | Ready


@dataclasses.dataclass(frozen=True)
class AnswerRequest:
    """Give the client of `ticket` its answer (a response, a refusal, or READY for a read)."""

    ticket: int
    answer: Reply


@dataclasses.dataclass(frozen=True)
class RewindUnverified:
    """Move the checkpoint back over an assumed marker slot, if it sits right past one."""


@dataclasses.dataclass(frozen=True)
class Wipe:
    reason: str


@dataclasses.dataclass(frozen=True)
class LoadSnapshot:
    """Replace the replica by the newest usable snapshot whose cut is at least `at_least` (and
    beyond its checkpoint); report `SnapshotDone`."""

    at_least: int
    why: str


@dataclasses.dataclass(frozen=True)
class CloseWriter:
    """This leadership is over and its writer idle: close it."""


@dataclasses.dataclass(frozen=True)
class Unable:
    """This replica cannot lead now (`reason`): the node must let another one lead."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Able:
    """The last reason not to lead is gone."""


# The counters a `Note` may name (a node exports each as kvstore_<name>_total, per shard).
METRICS = frozenset({"leader_changes", "fencings", "unknown_outcomes", "rebuilds", "snapshot_loads",
                     "apply_failures"})


@dataclasses.dataclass(frozen=True)
class Note:
    """Something worth a log line and, with `metric` (one of METRICS), a counter."""

    text: str
    metric: str = ""
    warning: bool = False

    def __post_init__(self) -> None:
        assert not self.metric or self.metric in METRICS, f"unknown metric {self.metric!r}"


@dataclasses.dataclass(frozen=True)
class ResolveNow:
    """Reads wait on these prepared transactions' locks: have them resolved at once (the
    coordinator's decision, or an abort if there is none). A hint: no event answers it."""

    txn_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Exit:
    """Stopped: nothing runs any more; close the reader and the store."""


Action = (Fence | SetTerm | Append | ReadEnd | ReadSettledEnd | Fetch | ApplyReplayed | ApplyCommitted
          | AnswerRequest | RewindUnverified | Wipe | LoadSnapshot | CloseWriter | Unable | Able | Note | ResolveNow
          | Exit)


# ---- state ------------------------------------------------------------------------------------------


class Reading(enum.Enum):
    """What the replica's reader is for."""

    NONE = "none"  # no reading (leading, fencing, idle without standby, waiting to retry)
    FOLLOW = "follow"  # tailing the shard as a standby
    CATCH_UP = "catch_up"  # replaying to the end this leadership fenced (or settled) at


class Stage(enum.Enum):
    """Where a reading stands: follow and catch-up first make the checkpoint trustworthy."""

    REWINDING = "rewinding"  # over an assumed marker slot
    LOADING = "loading"  # a snapshot into an empty replica, or one below a truncated log start
    READING_END = "reading_end"  # (follow) the end it catches up to
    CONFIRMING = "confirming"  # the checkpoint lies beyond the end: re-reading it for a while
    WIPING = "wiping"
    FETCHING = "fetching"


class ReaderOp(enum.Enum):
    """The reader-side action out (one at a time): its result event clears it."""

    REWIND = "rewind"
    LOAD = "load"
    END = "end"  # ReadEnd(FOLLOW or CONFIRM)
    WIPE = "wipe"
    FETCH = "fetch"
    APPLY = "apply"  # ApplyReplayed


@dataclasses.dataclass
class _Pending:
    ticket: int | None  # None: the leader's own probe
    write: Write
    size: int
    lock_wait_until_ms: float | None = None  # set when it first met a lock: refused after this


@dataclasses.dataclass
class _Batch:
    revision: int
    payloads: tuple[bytes, ...]
    answers: list[tuple[int | None, Response]]  # given after the commit (W5)
    ids: list[str]  # the request ids it carries (in progress until it ends)


@dataclasses.dataclass
class _BarrierRead:
    ticket: int
    response: Response | None  # a read-only Txn's answer, given once the barrier passed; None: READY
    keys: tuple[bytes, ...] = ()  # what a READY read will read (`ReadArrived`)
    span: tuple[bytes, bytes | None] | None = None


@dataclasses.dataclass
class _LockedRead:
    """A read past its barrier that meets a prepared transaction's exclusive lock (T4)."""

    read: _BarrierRead
    kick_at_ms: float | None  # when to ask for its holders to be resolved (None: asked)
    deadline_ms: float


@dataclasses.dataclass
class _Waiter:
    read: _BarrierRead
    offset: int  # served once everything below it is applied
    deadline_ms: float


@dataclasses.dataclass
class _Confirm:
    """A checkpoint beyond the end, being waited out (`kvstore.core.recovery.beyond_end`)."""

    end: int
    fresh: bool  # `end` was read by the last attempt, not kept from an earlier one
    deadline_ms: float
    next_read_ms: float


class _Forgetful:
    """`Mutation.SKIP_REQUEST_DEDUPE`'s request table: it remembers no id."""

    def __init__(self, view: StateView) -> None:
        self._view = view

    def request(self, request_id: str) -> None:
        return None

    @property
    def evicted_through_ms(self) -> int:
        return self._view.evicted_through_ms


class ReplicaMachine:
    """One shard replica's protocol. Drivers report events and perform actions (module docstring)."""

    def __init__(self, config: ReplicaConfig, view: StateView) -> None:
        self.config = config
        self.shard = config.shard
        self.view = view  # a driver may point it at a new store (a snapshot swapped in)
        self.role = RoleMachine(config.shard)
        self.started = False
        self.exited = False
        self.caught_up = False  # reached the end seen when the reading started (a node's readiness)
        # The reader: what it reads for, how far along, the one action of it that is out.
        self.reading = Reading.NONE
        self.stage: Stage | None = None
        self.reader_op: ReaderOp | None = None
        self.follow_end = 0  # the end a follower catches up to
        self.target_end = 0  # the end a catch-up replays to (W6)
        self.catch_up_deadline_ms = 0.0
        self.confirm: _Confirm | None = None
        self.loading_at_least = 0
        self.retry_at_ms: float | None = None  # a failed reading starts over then
        self.lead_again_at_ms: float | None = None  # a leadership that ended while the shard is still ours
        self.retake_after_ms: float | None = None  # a failed leadership: retake after this backoff
        self.backoff_ms = config.backoff_first_ms
        # The writer: at most one of fence / append / settled-end read at a time, never closed under one.
        self.writer_busy = False
        self.in_flight: _Batch | None = None
        self.committing: tuple[_Batch, Appended] | None = None  # answered; CommitApplied next
        self.queue: collections.deque[_Pending] = collections.deque()
        # Requests a full batch left over: first in the next one, their order kept. Bounded by one batch.
        self.carry: collections.deque[_Pending] = collections.deque()
        # Writes that met a lock of a prepared transaction: back to the queue's front after every
        # apply (which may have released it), refused at their `lock_wait_until_ms`. Bounded by
        # max_pending with the queue.
        self.parked: list[_Pending] = []
        self.linger_until_ms: float | None = None
        self.in_progress: set[str] = set()  # request ids with an attempt queued or committing here
        self.probing = False
        # The read barrier: reads waiting for the next high-watermark query, the round whose
        # query is out, reads waiting for the replica to apply what their round read.
        self.next_round: list[_BarrierRead] = []
        self.round: list[_BarrierRead] = []
        self.round_out = False
        self.waiters: list[_Waiter] = []
        self.locked_reads: list[_LockedRead] = []  # bounded by the reads admitted, each by its deadline
        self._now_ms = 0.0
        self._unix_ms = 0
        self._out: list[Action] = []

    # ---- what drivers ask --------------------------------------------------------------------------------

    @property
    def term(self) -> int:
        return self.role.term

    @property
    def holding(self) -> bool:
        """Still acting as leader, or a batch or fence still running (what the group waits for
        before it gives the shard to another node)."""
        return self.role.role not in (Role.FOLLOWER, Role.STOPPED) or self.writer_busy or self.committing is not None

    @property
    def pending_writes(self) -> int:
        return len(self.queue) + len(self.carry) + len(self.parked)

    def wake_at_ms(self) -> float | None:
        """The earliest time a `Tick` has something to do, or None."""
        times = [t for t in (self.linger_until_ms, self.retry_at_ms, self.lead_again_at_ms) if t is not None]
        if self.reading is Reading.CATCH_UP and self.stage is Stage.FETCHING:
            times.append(self.catch_up_deadline_ms)
        if self.confirm is not None and self.reader_op is None:
            times.append(min(self.confirm.next_read_ms, self.confirm.deadline_ms))
        times.extend(w.deadline_ms for w in self.waiters)
        for locked in self.locked_reads:
            times.append(locked.deadline_ms if locked.kick_at_ms is None else min(locked.kick_at_ms,
                                                                                 locked.deadline_ms))
        times.extend(p.lock_wait_until_ms for p in self.parked if p.lock_wait_until_ms is not None)
        return min(times) if times else None

    # ---- the one entry point ---------------------------------------------------------------------------

    def step(self, event: Event, *, now_ms: float, unix_ms: int) -> list[Action]:
        """Everything that follows from `event` at monotonic time `now_ms` (`unix_ms` stamps
        batches and judges request-id horizons)."""
        assert not self.exited, f"shard {self.shard}: {event!r} after Exit"
        self._now_ms, self._unix_ms = now_ms, unix_ms
        self._out = []
        _HANDLERS[type(event)](self, event)
        self._advance()
        out, self._out = self._out, []
        return out

    # ---- events: intent and time ----------------------------------------------------------------------

    def _on_started(self, event: Started) -> None:
        assert not self.started, "Started twice"
        self.started = True

    def _on_lead_changed(self, event: LeadChanged) -> None:
        unable = self.role.set_lead(event.lead)
        if unable is not None:
            self._emit(Note(f"shard {self.shard}: not taking leadership: {unable}", warning=True))
            self._emit(Unable(unable))
        if not self.role.want_lead:
            self.lead_again_at_ms = None
            self._step_down_if_idle()

    def _on_stop(self, event: StopRequested) -> None:
        self.role.stop()
        self.lead_again_at_ms = self.retry_at_ms = None
        self._step_down_if_idle()
        if self.role.role is Role.FOLLOWER:
            self._stop_reading()  # a wait beyond the end is cut short: nothing is concluded while stopping

    def _on_tick(self, event: Tick) -> None:
        now = self._now_ms
        if self.retry_at_ms is not None and now >= self.retry_at_ms:
            self.retry_at_ms = None
        if self.lead_again_at_ms is not None and now >= self.lead_again_at_ms:
            self.lead_again_at_ms = None
        if self.linger_until_ms is not None and now >= self.linger_until_ms:
            self.linger_until_ms = None
            self._maybe_start_batch(lingered=True)
        if self.parked:
            late = [p for p in self.parked if p.lock_wait_until_ms is not None and now >= p.lock_wait_until_ms]
            if late:
                self.parked = [p for p in self.parked if p not in late]
                for pending in late:
                    self._answer_pending(pending, errors.TxnConflictError(
                        f"shard {self.shard}: a key of this write stayed locked by a prepared cross-shard transaction "
                        f"for {self.config.lock_wait_ms:.0f} ms; nothing was done: retry"))
        if self.locked_reads:
            self._locked_reads_tick(now)
        expired = [w for w in self.waiters if now >= w.deadline_ms]
        if expired:
            self.waiters = [w for w in self.waiters if now < w.deadline_ms]
            for waiter in expired:
                self._answer(waiter.read.ticket, errors.UnavailableError(
                    f"shard {self.shard}: applied {self._applied()}, waited for {waiter.offset}"))
        confirm = self.confirm
        if confirm is not None and self.reader_op is None:
            if now >= confirm.deadline_ms:
                self._confirmed()
            elif now >= confirm.next_read_ms:
                self.reader_op = ReaderOp.END
                self._emit(ReadEnd(EndPurpose.CONFIRM))
        if self.reading is Reading.CATCH_UP and self.stage is Stage.FETCHING and now >= self.catch_up_deadline_ms:
            self._reading_failed(f"shard {self.shard}: bootstrap stuck at {self._applied()} of "
                                 f"{self.target_end}")

    # ---- events: requests -----------------------------------------------------------------------------

    def _on_write(self, event: WriteArrived) -> None:
        refusal = self.role.write_refusal(event.leader_hint)  # the one leadership check of a write
        if refusal is not None:
            self._emit(AnswerRequest(event.ticket, refusal))
            return
        write = event.write
        if Mutation.SKIP_REQUEST_DEDUPE not in self.config.mutations:
            answer = admit(write, self.view, self.in_progress, self._unix_ms, **self._horizon())
            if answer is not None:
                self._emit(AnswerRequest(event.ticket, answer))
                return
        if len(self.queue) + len(self.parked) >= self.config.max_pending:
            self._emit(AnswerRequest(event.ticket, errors.OverloadedError(
                f"shard {self.shard}: {self.config.max_pending} writes pending (limit MAX_PENDING_WRITES_PER_SHARD); "
                "back off")))
            return
        if write.request_id:
            self.in_progress.add(write.request_id)
        self.queue.append(_Pending(event.ticket, write, event.size))

    def _on_read(self, event: ReadArrived) -> None:
        refusal = self.role.write_refusal(event.leader_hint)
        if refusal is not None:
            self._emit(AnswerRequest(event.ticket, refusal))
        elif Mutation.SKIP_READ_BARRIER in self.config.mutations:
            self._emit(AnswerRequest(event.ticket, READY))
        else:
            self.next_round.append(_BarrierRead(event.ticket, None, event.keys, event.span))

    def _on_client_gone(self, event: ClientGone) -> None:
        """Not written if still queued (its id is free again); not awaited anywhere else."""
        for line in (self.queue, self.carry, self.parked):
            for pending in line:
                if pending.ticket == event.ticket:
                    line.remove(pending)
                    self._release_id(pending.write.request_id)
                    return
        self.next_round = [r for r in self.next_round if r.ticket != event.ticket]
        self.waiters = [w for w in self.waiters if w.read.ticket != event.ticket]
        self.locked_reads = [r for r in self.locked_reads if r.read.ticket != event.ticket]

    def _on_probe(self, event: ProbeRequested) -> None:
        self._probe()

    # ---- events: the writer ------------------------------------------------------------------------------

    def _on_fenced(self, event: Fenced) -> None:
        assert self.writer_busy and self.role.role is Role.FENCING, (self.writer_busy, self.role.role)
        self.writer_busy = False
        first = not self.role.refencing
        if not self.role.fenced(event.end):
            return  # given up meanwhile: STEPPING_DOWN, finished in _advance
        if first:
            self._emit(Note(f"shard {self.shard}: fenced in at {event.end} (term {self.role.term})",
                            metric="leader_changes"))
        self._emit(SetTerm(self.role.term))
        self._start_reading(Reading.CATCH_UP, end=event.end)

    def _on_fence_failed(self, event: FenceFailed) -> None:
        assert self.writer_busy and self.role.role is Role.FENCING, (self.writer_busy, self.role.role)
        self.writer_busy = False
        self._emit(Note(f"shard {self.shard}: fencing failed: {event.reason}", warning=True))
        self._leadership_failed()

    def _on_appended(self, event: Appended) -> None:
        batch = self.in_flight
        assert batch is not None and self.writer_busy, "Appended without a batch in flight"
        assert len(event.offsets) == len(batch.payloads), (event, len(batch.payloads))
        self.in_flight, self.writer_busy = None, False
        self.committing = (batch, event)
        self._emit(ApplyCommitted(tuple(zip(event.offsets, batch.payloads, strict=True)), event.upcoming,
                                  event.marker_slot))
        # W5: answered only now, the batch committed, and before the machine's own bookkeeping
        # (at CommitApplied): nothing that raises there can turn a committed write into a failure.
        if Mutation.ANSWER_BEFORE_COMMIT not in self.config.mutations:
            for ticket, response in batch.answers:
                self._answer(ticket, response)
        self._release_ids(batch)

    def _on_commit_applied(self, event: CommitApplied) -> None:
        assert self.committing is not None, "CommitApplied without a committed batch"
        _batch, appended = self.committing
        self.committing = None
        self.role.batch_committed(appended.offsets, appended.upcoming)  # the paired W1/W2 checks
        if event.error is not None:
            self._emit(Note(f"shard {self.shard}: applying a committed batch failed ({event.error}); giving the "
                            "shard up and rebuilding", metric="apply_failures", warning=True))
            self.role.apply_failed(event.error)
            self._emit(Unable(event.error))
            return
        # Reads waiting for this batch are served only now that the store holds it: served at
        # Appended, a read would have found the state without it when the apply failed (a disk
        # full in issue 22's campaign), then the wiped store.
        self._applied_to(appended.upcoming)
        self._step_down_if_idle()

    def _on_append_failed(self, event: AppendFailed) -> None:
        batch = self.in_flight
        assert batch is not None and self.writer_busy, "AppendFailed without a batch in flight"
        self.in_flight, self.writer_busy = None, False
        decision = self.role.batch_failed(event.outcome)
        if decision.unknown:
            self._emit(Note("", metric="unknown_outcomes"))
        if decision.fencing:
            self._emit(Note("", metric="fencings"))
        error = decision.error(self.shard, event.detail)
        if Mutation.ANSWER_BEFORE_COMMIT not in self.config.mutations:
            for ticket, _ in batch.answers:
                self._answer(ticket, error)
        self._release_ids(batch)
        if decision.then is Next.STEP_DOWN:
            self._emit(Note(f"shard {self.shard}: stepping down: {decision.message} ({event.detail})", warning=True))
            return
        # W2: after any abort or unknown outcome, learn the partition again before writing.
        self._emit(Note(f"shard {self.shard}: {event.detail or decision.message}; bootstrapping again", warning=True))
        self.writer_busy = True
        # REFENCE: a fresh init_transactions completes or aborts our undecided transaction at
        # once; waiting for the settled end instead would wait out the transaction timeout.
        self._emit(Fence() if decision.then is Next.REFENCE else ReadSettledEnd())

    # ---- events: ends ------------------------------------------------------------------------------------

    def _on_end_read(self, event: EndRead) -> None:
        assert event.end >= 0, event
        purpose = event.purpose
        if purpose is EndPurpose.BARRIER:
            self._barrier_answered(event.end, "")
        elif purpose is EndPurpose.SETTLE:
            assert self.writer_busy and self.role.role is Role.CATCHING_UP, (self.writer_busy, self.role.role)
            self.writer_busy = False
            if self.role.keeps_leading:
                self._start_reading(Reading.CATCH_UP, end=event.end)
            else:
                self.role.step_down()
        else:
            self._reader_done(ReaderOp.END)
            if purpose is EndPurpose.CONFIRM and self.stage is Stage.CONFIRMING and self.confirm is not None:
                confirm = self.confirm
                confirm.end, confirm.fresh = event.end, True
                confirm.next_read_ms = self._now_ms + self.config.beyond_end_poll_ms
                if self._applied() <= event.end:
                    self._confirmed()
            elif purpose is EndPurpose.FOLLOW and self.stage is Stage.READING_END:
                self.follow_end = event.end
                self._check_beyond(event.end)

    def _on_end_read_failed(self, event: EndReadFailed) -> None:
        purpose = event.purpose
        if purpose is EndPurpose.BARRIER:
            self._barrier_answered(None, event.reason)
        elif purpose is EndPurpose.SETTLE:
            assert self.writer_busy and self.role.role is Role.CATCHING_UP, (self.writer_busy, self.role.role)
            self.writer_busy = False
            self._emit(Note(f"shard {self.shard}: re-bootstrap failed: {event.reason}", warning=True))
            self.role.resync_failed()
        else:
            self._reader_done(ReaderOp.END)
            if purpose is EndPurpose.CONFIRM and self.confirm is not None:
                self.confirm.fresh = False  # keep the last end, ask again
                self.confirm.next_read_ms = self._now_ms + self.config.beyond_end_poll_ms
            elif purpose is EndPurpose.FOLLOW and self.stage is Stage.READING_END:
                self._reading_failed(f"shard {self.shard}: reading the partition end: {event.reason}")

    # ---- events: the reader --------------------------------------------------------------------------------

    def _on_fetched(self, event: Fetched) -> None:
        self._reader_done(ReaderOp.FETCH)
        if self.stage is not Stage.FETCHING or event.from_offset != self._applied():
            return  # another reading now: the next fetch asks again from the checkpoint
        assert event.position >= event.from_offset, event
        records = tuple(event.records)
        if records or event.position > event.from_offset:
            assert all(event.from_offset <= offset < event.position for offset, _ in records), event
            self._reader_op(Stage.FETCHING, ReaderOp.APPLY, ApplyReplayed(records, event.position))
            return  # the rest once the store has them (Replayed)
        self.backoff_ms = self.config.backoff_first_ms

    def _on_replayed(self, event: Replayed) -> None:
        self._reader_done(ReaderOp.APPLY)
        self._applied_to(self._applied())
        if self.stage is not Stage.FETCHING:
            return  # the reading was given up meanwhile; what was applied stays applied
        self.backoff_ms = self.config.backoff_first_ms
        if self.reading is Reading.FOLLOW and self._applied() >= self.follow_end:
            self._reached_end()

    def _on_fetch_out_of_range(self, event: FetchOutOfRange) -> None:
        self._reader_done(ReaderOp.FETCH)
        if self.stage is not Stage.FETCHING or event.from_offset != self._applied():
            return
        if event.below_start:
            self._load_snapshot(event.log_start, f"the WAL starts at {event.log_start}, above the checkpoint "
                                                 f"{self._applied()} (truncated)")
        else:
            self._check_beyond(event.log_end)

    def _on_fetch_failed(self, event: FetchFailed) -> None:
        self._reader_done(ReaderOp.FETCH)
        if self.stage is Stage.FETCHING:
            self._reading_failed(f"shard {self.shard}: {event.reason}")

    def _on_replay_apply_failed(self, event: ReplayApplyFailed) -> None:
        self._reader_done(ReaderOp.APPLY)
        if self.stage is Stage.FETCHING:
            self._reading_failed(f"shard {self.shard}: applying replayed records failed: {event.reason}")

    def _on_rewound(self, event: Rewound) -> None:
        self._reader_done(ReaderOp.REWIND)
        if self.stage is Stage.REWINDING:
            self._prepare_checkpoint()

    def _on_wiped(self, event: Wiped) -> None:
        self._reader_done(ReaderOp.WIPE)
        assert self._applied() == 0, f"wiped, but the checkpoint is {self._applied()}"
        if BROKEN in self.role.unable:  # a rebuild's wipe: following now replays everything
            self.role.clear_unable(BROKEN)
            self._stop_reading()
        elif self.stage is Stage.WIPING:
            self._fetch_stage()

    def _on_snapshot_done(self, event: SnapshotDone) -> None:
        self._reader_done(ReaderOp.LOAD)
        if self.stage is not Stage.LOADING:
            return
        at_least = self.loading_at_least
        if event.loaded:
            self._emit(Note(f"shard {self.shard}: loaded a snapshot; replaying the WAL from {self._applied()}",
                            metric="snapshot_loads"))
            if at_least > 0 and self.role.clear_unable(NEEDS_SNAPSHOT):
                self._emit(Able())
        elif at_least > 0:
            why = (f"shard {self.shard}: the WAL was truncated at offset {at_least}, above this replica's checkpoint "
                   f"{self._applied()}; it can only be rebuilt from a snapshot taken at or after {at_least}")
            if NEEDS_SNAPSHOT not in self.role.unable:
                # Leading from here would serve a state missing everything below the log start,
                # and retrying leadership would loop: leave the shard to a node that can.
                self.role.mark_unable(NEEDS_SNAPSHOT, why)
                self._emit(Note(f"{why}; not leading it", warning=True))
                self._emit(Unable(why))
            self._reading_failed(why)
            return
        # Loaded, or an empty replica with no snapshot to load (it replays the whole WAL).
        self._check_beyond(self.target_end if self.reading is Reading.CATCH_UP else None)

    # ---- the reader's course -------------------------------------------------------------------------------

    def _start_reading(self, reading: Reading, *, end: int = 0) -> None:
        """Follow, or catch up to `end`. First the checkpoint is made trustworthy: the marker
        slot this node may have assumed is read again, an empty replica loads a snapshot, a
        checkpoint beyond the end is waited out; then fetch."""
        assert self.reader_op is None, f"a new reading while {self.reader_op} is out"
        self.reading, self.confirm, self.target_end = reading, None, end
        if reading is Reading.CATCH_UP:
            self.catch_up_deadline_ms = self._now_ms + self.config.bootstrap_timeout_ms
        else:
            self.caught_up = False
        if Mutation.SKIP_MARKER_REWIND in self.config.mutations:
            self.stage = Stage.REWINDING
            self._prepare_checkpoint()
            return
        self._reader_op(Stage.REWINDING, ReaderOp.REWIND, RewindUnverified())

    def _prepare_checkpoint(self) -> None:
        if self._applied() == 0 and (self.reading is Reading.FOLLOW or self.target_end > 0):
            self._load_snapshot(0, "the replica is empty")
        else:
            self._check_beyond(self.target_end if self.reading is Reading.CATCH_UP else None)

    def _load_snapshot(self, at_least: int, why: str) -> None:
        self.loading_at_least = at_least
        self._reader_op(Stage.LOADING, ReaderOp.LOAD, LoadSnapshot(at_least, why))

    def _check_beyond(self, end: int | None) -> None:
        """Compare the checkpoint with `end` (a follower reads the end first: None)."""
        if end is None:
            self._reader_op(Stage.READING_END, ReaderOp.END, ReadEnd(EndPurpose.FOLLOW))
        elif self._applied() <= end:
            self._fetch_stage()
        else:
            self.stage = Stage.CONFIRMING
            self.confirm = _Confirm(end, True, self._now_ms + self.config.beyond_end_grace_ms,
                                    self._now_ms + self.config.beyond_end_poll_ms)

    def _confirmed(self) -> None:
        """The wait beyond the end is over: the end caught up, or the grace period passed."""
        confirm, self.confirm = self.confirm, None
        assert confirm is not None and self.stage is Stage.CONFIRMING, self.stage
        applied = self._applied()
        if self.reading is Reading.CATCH_UP and self.target_end < applied <= confirm.end:
            # The end we fenced at was stale, and so is the upcoming offset: take the shard again.
            self._reading_failed(f"shard {self.shard}: partition end moved from {self.target_end} to {confirm.end} "
                                 "while taking over; taking over again")
            return
        if self.reading is Reading.FOLLOW:
            self.follow_end = max(self.follow_end, confirm.end)
        verdict = beyond_end(applied, confirm.end, end_fresh=confirm.fresh, stopping=self.role.stopping)
        if verdict is Beyond.NO:
            self._fetch_stage()
        elif verdict is Beyond.UNCONFIRMED:
            self._reading_failed(f"shard {self.shard}: checkpoint {applied} beyond the partition end {confirm.end}, "
                                 "unconfirmed (end unreadable or stopping)")
        else:
            self._emit(Note(f"shard {self.shard}: checkpoint {applied} beyond the WAL's end {confirm.end}: the WAL "
                            "was recreated; rebuilding", metric="rebuilds", warning=True))
            self._reader_op(Stage.WIPING, ReaderOp.WIPE, Wipe(f"checkpoint {applied} beyond WAL end {confirm.end}"))

    def _fetch_stage(self) -> None:
        self.stage = Stage.FETCHING
        if self.reading is Reading.FOLLOW and self._applied() >= self.follow_end:
            self._reached_end()

    def _reached_end(self) -> None:
        if not self.caught_up:
            self.caught_up = True
        if REBUILDING in self.role.unable:
            self._emit(Note(f"shard {self.shard}: rebuilt at offset {self._applied()}"))
            if self.role.clear_unable(REBUILDING):
                self._emit(Able())

    def _reading_failed(self, why: str) -> None:
        """A reading cannot go on: a follower starts over after a backoff; a takeover gives
        this leadership up and takes the shard again after one."""
        reading = self.reading
        self._stop_reading()
        self._emit(Note(f"{why}; retrying in {self.backoff_ms / 1000:.1f}s", warning=True))
        if reading is Reading.CATCH_UP:
            self._leadership_failed()
        else:
            self.retry_at_ms = self._now_ms + self._next_backoff()

    def _leadership_failed(self) -> None:
        self.role.step_down()
        self.retake_after_ms = self._next_backoff()

    def _next_backoff(self) -> float:
        backoff, self.backoff_ms = self.backoff_ms, min(self.backoff_ms * 2, self.config.backoff_max_ms)
        return backoff

    def _reader_op(self, stage: Stage, op: ReaderOp, action: Action) -> None:
        assert self.reader_op is None, f"{op} while {self.reader_op} is out"
        self.stage, self.reader_op = stage, op
        self._emit(action)

    def _reader_done(self, op: ReaderOp) -> None:
        assert self.reader_op is op, f"{op} reported while {self.reader_op} was out"
        self.reader_op = None

    def _stop_reading(self) -> None:
        """The reading ends here; an action of it still out is answered, and its result ignored."""
        self.reading, self.stage, self.confirm = Reading.NONE, None, None

    def _applied_to(self, checkpoint: int) -> None:
        """Everything below `checkpoint` is applied (once the driver performed the apply just
        emitted): the reads waiting for it are served, and writes parked on a lock try again
        first (the apply may have released it)."""
        if self.parked:
            self.queue.extendleft(reversed(self.parked))
            self.parked = []
        if self.locked_reads:  # the apply may have released their locks
            locked, self.locked_reads = self.locked_reads, []
            for waiting in locked:
                if self._read_holders(waiting.read):
                    self.locked_reads.append(waiting)
                else:
                    self._answer(waiting.read.ticket, READY)
        ready = [w for w in self.waiters if checkpoint >= w.offset]
        if ready:
            self.waiters = [w for w in self.waiters if checkpoint < w.offset]
            for waiter in ready:
                self._serve(waiter.read)

    # ---- the read barrier --------------------------------------------------------------------------------

    def _barrier_answered(self, end: int | None, failure: str) -> None:
        assert self.round_out, "a barrier's end arrived with no query out"
        reads, self.round, self.round_out = self.round, [], False
        if end is None:
            refusal: errors.StoreError = errors.UnavailableError(
                f"shard {self.shard}: read barrier failed: {failure}")
        elif self.role.role is not Role.LEADING:
            refusal = errors.UnavailableError(f"shard {self.shard}: leadership moving; retry")
        else:
            verdict = self.role.barrier(end)
            if verdict.wait_for is not None:
                applied = self._applied()
                for read in reads:
                    if applied >= verdict.wait_for:
                        self._serve(read)
                    else:
                        self.waiters.append(_Waiter(read, verdict.wait_for,
                                                    self._now_ms + self.config.barrier_timeout_ms))
                return
            # This leader's view is stale. The probe (an empty entry at our upcoming offset)
            # settles it: if the log moved, W2 aborts it and we learn the log again; if we
            # were fenced, we step down.
            self._probe()
            refusal = errors.UnavailableError(verdict.why)
        for read in reads:
            self._answer(read.ticket, refusal)

    def _serve(self, read: _BarrierRead) -> None:
        """A read whose barrier passed: READY (or a read-only Txn's answer), unless a key it
        reads is exclusively locked by a prepared transaction, which may be decided already:
        then it waits for the resolve (T4). A read-only Txn met the locks when it was planned."""
        if read.response is None and Mutation.SKIP_READ_LOCK_WAIT not in self.config.mutations \
                and self._read_holders(read):
            self.locked_reads.append(_LockedRead(read, self._now_ms + self.config.read_kick_ms,
                                                 self._now_ms + self.config.read_lock_wait_ms))
            return
        self._answer(read.ticket, read.response or READY)

    def _read_holders(self, read: _BarrierRead) -> set[str]:
        """The prepared transactions holding an exclusive lock on what `read` reads."""
        locks = self.view.locks
        if not locks.has_locks():
            return set()
        holders = {txn_id for key in read.keys for txn_id, exclusive in locks.lock_holders(key).items()
                   if exclusive}
        if read.span is not None:
            start, end = read.span
            holders |= {p.txn_id for p in locks.prepared() if any(
                start <= key and (end is None or key < end) for key in p.prepare.exclusive_keys)}
        return holders

    def _locked_reads_tick(self, now: float) -> None:
        kick: set[str] = set()
        waiting: list[_LockedRead] = []
        for locked in self.locked_reads:
            if now >= locked.deadline_ms:
                holders = sorted(self._read_holders(locked.read))
                self._answer(locked.read.ticket, errors.UnavailableError(
                    f"shard {self.shard}: what this read reads is locked by the prepared cross-shard "
                    f"transaction(s) {holders[:3]} for {self.config.read_lock_wait_ms:.0f} ms; nothing was read: "
                    "retry"))
                continue
            if locked.kick_at_ms is not None and now >= locked.kick_at_ms:
                locked.kick_at_ms = None
                kick |= self._read_holders(locked.read)
            waiting.append(locked)
        self.locked_reads = waiting
        if kick:
            self._emit(ResolveNow(tuple(sorted(kick))))

    def _probe(self) -> None:
        if self.probing or self.role.role is not Role.LEADING:
            return
        self.probing = True
        self.queue.append(_Pending(None, probe_write(), 0))

    # ---- group commit -------------------------------------------------------------------------------------

    def _maybe_start_batch(self, *, lingered: bool = False) -> None:
        """One batch in flight; the next starts once it is done. A lone write waits `linger_ms`
        for company first (requests carried over or already queued together go at once)."""
        if self.in_flight is not None or self.committing is not None or self.writer_busy:
            return
        if not self.role.may_start_batch() or not (self.queue or self.carry):
            return
        if not lingered and len(self.queue) < self.config.batch_limits.max_records:
            if self.linger_until_ms is not None:
                return  # lingering: writes arriving meanwhile join the batch
            if not self.carry and len(self.queue) == 1 and self.config.linger_ms > 0:
                self.linger_until_ms = self._now_ms + self.config.linger_ms
                return
        self.linger_until_ms = None
        self._start_batch()

    def _start_batch(self) -> None:
        bounds = self.config.batch_limits
        upcoming = self.role.upcoming
        assert upcoming is not None
        # W6, paired with RoleMachine.replayed_to: a leader plans only from a state exactly at
        # its upcoming offset.
        assert self._applied() == upcoming, \
            f"shard {self.shard}: planning at {upcoming} from a state at {self._applied()} (W6)"
        taken = [self.carry.popleft() for _ in range(min(len(self.carry), bounds.max_records))]
        size = sum(p.size for p in taken)
        while self.queue and len(taken) < bounds.max_records and size < bounds.max_bytes:
            pending = self.queue.popleft()
            taken.append(pending)
            size += pending.size
        table: RequestTable = self.view
        if Mutation.SKIP_REQUEST_DEDUPE in self.config.mutations:
            table = _Forgetful(self.view)
        plan = plan_batch([p.write for p in taken], upcoming, self.view.get, table, self._unix_ms, bounds,
                          locks=self.view.locks, **self._horizon())
        for index, answer in plan.now:  # refusals and replays: definite, independent of the append
            pending = taken[index]
            if self._parks(pending, answer):
                continue
            self._answer_pending(pending, answer)
        for index in reversed(plan.carry):
            self.carry.appendleft(taken[index])
        answers = [(taken[index].ticket, response) for index, response in plan.after_commit]
        batch = _Batch(plan.revision, tuple(plan.payloads), answers,
                       [taken[index].write.request_id for index, _ in plan.after_commit])
        if any(taken[index].ticket is None for index, _ in plan.after_commit):
            self.probing = False  # the probe is planned: another may be queued
        if plan.payloads:
            self.role.batch_started(plan.revision, len(plan.payloads))
            assert batch_end(plan.revision, len(plan.payloads)) == plan.upcoming_if_committed
            self.in_flight, self.writer_busy = batch, True
            if Mutation.ANSWER_BEFORE_COMMIT in self.config.mutations:
                for ticket, response in answers:
                    self._answer(ticket, response)
            self._emit(Append(plan.revision, batch.payloads))
            return
        self._release_ids(batch)
        # Read-only Txns saw committed state only: the barrier makes their answers linearizable.
        for ticket, response in answers:
            assert ticket is not None, "the probe is a record: it is appended, never read through a barrier"
            if Mutation.SKIP_READ_BARRIER in self.config.mutations:
                self._answer(ticket, response)
            else:
                self.next_round.append(_BarrierRead(ticket, response))

    # ---- answers and request ids ------------------------------------------------------------------------

    def _answer(self, ticket: int | None, answer: Reply) -> None:
        if ticket is not None:
            self._emit(AnswerRequest(ticket, answer))

    def _parks(self, pending: _Pending, answer: Reply) -> bool:
        """Whether a write refused on a lock waits instead (`lock_wait_ms`): parked until the
        next apply, as long as its wait lasts. A same-request conflict is not waited on: the
        earlier attempt's outcome decides, and this one says so at once."""
        if (not isinstance(answer, errors.TxnConflictError) or answer.same_request or pending.ticket is None
                or self.config.lock_wait_ms <= 0):
            return False
        if pending.lock_wait_until_ms is None:
            pending.lock_wait_until_ms = self._now_ms + self.config.lock_wait_ms
        elif self._now_ms >= pending.lock_wait_until_ms:
            return False
        self.parked.append(pending)
        return True

    def _answer_pending(self, pending: _Pending, answer: Reply) -> None:
        self._release_id(pending.write.request_id)
        if pending.ticket is None:
            self.probing = False
        self._answer(pending.ticket, answer)

    def _release_id(self, request_id: str) -> None:
        self.in_progress.discard(request_id)

    def _release_ids(self, batch: _Batch) -> None:
        for request_id in batch.ids:
            self._release_id(request_id)

    def _refuse_waiting(self, error: errors.StoreError) -> None:
        """Leadership over: nothing queued was written, a retry anywhere is safe."""
        for line in (self.carry, self.queue):
            while line:
                self._answer_pending(line.popleft(), error)
        parked, self.parked = self.parked, []
        for pending in parked:
            self._answer_pending(pending, error)
        reads = [*self.next_round, *self.round, *(w.read for w in self.waiters), *(r.read for r in self.locked_reads)]
        self.next_round, self.round, self.waiters = [], [], []  # a query still out finds no reads
        self.locked_reads = []
        for read in reads:
            self._answer(read.ticket, error)
        self.linger_until_ms = None
        self.probing = False

    def _horizon(self) -> dict[str, int]:
        kwargs: dict[str, int] = {}
        if self.config.request_horizon_ms is not None:
            kwargs["horizon_ms"] = self.config.request_horizon_ms
        if self.config.clock_skew_ms is not None:
            kwargs["skew_ms"] = self.config.clock_skew_ms
        return kwargs

    def _applied(self) -> int:
        """The replica's checkpoint. Every apply this machine asks for is reported done
        (`Replayed`, `CommitApplied`) before anything reads the state again: never plan or serve
        from a state whose apply is still in the driver's hands (sim seed 4: a batch planned in
        the step that asked to apply the catch-up's records missed their request ids)."""
        return self.view.applied_offset

    def _emit(self, action: Action) -> None:
        self._out.append(action)

    # ---- what follows, whatever happened ---------------------------------------------------------------

    def _step_down_if_idle(self) -> None:
        """Leave a leadership that is no longer wanted, unless the writer is busy (its result
        ends it then: a fence, a batch, a settled-end read never run under a closed writer)."""
        if (not self.role.keeps_leading and self.role.role in (Role.CATCHING_UP, Role.LEADING)
                and not self.writer_busy and self.committing is None):
            self.role.step_down()

    def _advance(self) -> None:
        """Move on from wherever the last event left the replica: finish a step-down, exit,
        rebuild, take the shard, read, start a batch or a barrier round. Called after every
        event: the machine's one scheduler."""
        role = self.role
        if role.role is Role.STEPPING_DOWN and not self.writer_busy and self.committing is None:
            self._finish_leadership()
        if role.stopping:
            if (role.role in (Role.FOLLOWER, Role.STOPPED) and not self.writer_busy and self.committing is None
                    and self.reader_op is None):
                if role.role is Role.FOLLOWER:
                    role.stopped()
                self._refuse_waiting(errors.UnavailableError(f"shard {self.shard}: node shutting down"))
                self._stop_reading()
                self._emit(Exit())
                self.exited = True
            return
        if not self.started:
            return
        if role.role is Role.FOLLOWER and self.reader_op is None:
            if BROKEN in role.unable:
                self._rebuild()
                return
            if role.want_lead and self.lead_again_at_ms is None:
                self._begin_leadership()
            elif self.reading is Reading.NONE and self.retry_at_ms is None:
                if self.config.standby or REBUILDING in role.unable:
                    self._start_reading(Reading.FOLLOW)
                else:
                    self.caught_up = True  # idle at its checkpoint: catches up when it leads
        if self.stage is Stage.FETCHING and self.reader_op is None:
            self._next_fetch()
            if role.role is Role.STEPPING_DOWN and not self.writer_busy and self.committing is None:
                self._finish_leadership()  # the catch-up just gave the shard up (a stale end)
        if role.role is Role.LEADING:
            self._maybe_start_batch()
            if self.next_round and not self.round_out:
                self.round, self.next_round, self.round_out = self.next_round, [], True
                self._emit(ReadEnd(EndPurpose.BARRIER))

    def _next_fetch(self) -> None:
        if self.reading is Reading.FOLLOW:
            self._reader_op(Stage.FETCHING, ReaderOp.FETCH, Fetch(self._applied(), None))
            return
        assert self.reading is Reading.CATCH_UP and self.role.role is Role.CATCHING_UP, (self.reading, self.role.role)
        # A catch-up no longer wanted was given up when that was said (_step_down_if_idle).
        assert self.role.keeps_leading, "catching up for a leadership given up"
        applied = self._applied()
        if applied > self.target_end:
            # The replay went past the end we fenced or settled at: that end was stale (read from
            # a broker behind, or the marker of our last commit landed after it was read).
            # Leading from it would plan at an offset our state is already past (W6): take the
            # shard again, as `_confirmed` does when the end moves during a takeover.
            self._reading_failed(f"shard {self.shard}: replayed to {applied}, past the end {self.target_end} it "
                                 "was taking over at (a stale end); taking over again")
            return
        if applied == self.target_end:
            self._stop_reading()
            leads = self.role.replayed_to(self.target_end)  # W6: leads from the end it caught up to
            assert leads
            self.caught_up = True
            self.backoff_ms = self.config.backoff_first_ms
            self._emit(Note(f"shard {self.shard}: leading at offset {self.target_end} (term {self.role.term})"))
        else:
            self._reader_op(Stage.FETCHING, ReaderOp.FETCH, Fetch(self._applied(), self.target_end))

    def _begin_leadership(self) -> None:
        self._stop_reading()
        self.role.begin_fencing()
        self.writer_busy = True
        self.retake_after_ms = None
        self._emit(Fence())

    def _finish_leadership(self) -> None:
        """Nothing of the leadership runs any more: refuse what waited, close the writer, and
        take the shard again later if it is still ours (fenced by a zombie or `kvstore fence`)."""
        self.role.stepped_down()
        self._stop_reading()
        self._refuse_waiting(errors.UnavailableError(
            f"shard {self.shard}: {'node shutting down' if self.role.stopping else 'leadership lost; retry'}"))
        self._emit(CloseWriter())
        pause, self.retake_after_ms = self.retake_after_ms, None
        if self.role.keeps_leading:
            self.lead_again_at_ms = self._now_ms + (self.config.refence_pause_ms if pause is None else pause)

    def _rebuild(self) -> None:
        """A committed batch could not be applied here: wipe, then replay (`REBUILDING` until
        caught up: leading is refused meanwhile)."""
        reason = self.role.unable[BROKEN]
        self.caught_up = False
        self.role.mark_unable(REBUILDING, f"rebuilding after: {reason}")
        self._stop_reading()
        self._emit(Note(f"shard {self.shard}: rebuilding after: {reason}", metric="rebuilds", warning=True))
        self._reader_op(Stage.WIPING, ReaderOp.WIPE, Wipe(f"a committed batch could not be applied: {reason}"))


_HANDLERS: dict[type, Callable[[ReplicaMachine, Any], None]] = {
    Started: ReplicaMachine._on_started,
    LeadChanged: ReplicaMachine._on_lead_changed,
    StopRequested: ReplicaMachine._on_stop,
    Tick: ReplicaMachine._on_tick,
    WriteArrived: ReplicaMachine._on_write,
    ReadArrived: ReplicaMachine._on_read,
    ClientGone: ReplicaMachine._on_client_gone,
    ProbeRequested: ReplicaMachine._on_probe,
    Fenced: ReplicaMachine._on_fenced,
    FenceFailed: ReplicaMachine._on_fence_failed,
    EndRead: ReplicaMachine._on_end_read,
    EndReadFailed: ReplicaMachine._on_end_read_failed,
    Fetched: ReplicaMachine._on_fetched,
    FetchOutOfRange: ReplicaMachine._on_fetch_out_of_range,
    FetchFailed: ReplicaMachine._on_fetch_failed,
    Replayed: ReplicaMachine._on_replayed,
    ReplayApplyFailed: ReplicaMachine._on_replay_apply_failed,
    Rewound: ReplicaMachine._on_rewound,
    Wiped: ReplicaMachine._on_wiped,
    SnapshotDone: ReplicaMachine._on_snapshot_done,
    Appended: ReplicaMachine._on_appended,
    AppendFailed: ReplicaMachine._on_append_failed,
    CommitApplied: ReplicaMachine._on_commit_applied,
}
assert set(_HANDLERS) == set(Event.__args__), "every event needs a handler"
