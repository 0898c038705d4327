"""One shard replica's whole protocol as a pure machine: events in, actions out, no I/O.

This is to the store what `wal.guard.Guard` is to the log (docs/design.md §5.1): the asyncio
node (`kvstore.server.replica.ShardReplica`), the deterministic simulation (tests/sim) and the
unit tests are drivers of this one machine, each through the one table of performers
(`kvstore.core.replica.performers`). A driver reports what happened (`step(event, now_ms=,
unix_ms=)`), performs the actions returned, in order, and reports their results as further
events; it decides nothing. The machine reads the replica's committed state through a read-only
`StateView` (admission and batch planning look keys and request ids up; a read of local state is
not I/O in the protocol's sense, as etcd's raft reads its `Storage`), and keeps no clock: time
arrives with every event, and `wake_at_ms()` says when it next wants a `Tick`.

What it decides, by part:

* **leadership** (here, composing `kvstore.core.role.RoleMachine`: the leadership's states,
  terms, the append decision table): fence (W4), what a failed append leads to (re-fence,
  settled end, step down: W2, W7), stepping down and taking the shard again after a pause,
  rebuilding after a committed batch could not be applied, stopping;
* **catching up** (`catchup.CatchUp` over `reader.Reader`): following, a takeover's replay to
  the fenced end (W6), recovering the checkpoint;
* **group commit** (`batching.GroupCommit`): admission, linger, carry-over, one batch in
  flight, apply and answer after the commit (W5);
* **linearizable reads** (`barrier.Barrier`): the read-barrier rounds, the verdict, the waits.

Every action that the machine needs a result of is answered by exactly one event naming it
(`Fence` -> `Fenced` | `FenceFailed`, ...). Transitions of the leadership and of the reader
are explicit and checked (`kvstore.core.role._VALID`, `kvstore.core.replica.reader._VALID`);
so is every event against the state it may arrive in. A `Mutation` deliberately breaks one
rule, for the simulation to prove that it catches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore import errors
from kvstore.core.replica.actions import (
    READY,
    Action,
    AnswerRequest,
    CloseWriter,
    Exit,
    Fence,
    Fetch,
    LoadSnapshot,
    Note,
    ReadEnd,
    ReadSettledEnd,
    SetTerm,
    Unable,
)
from kvstore.core.replica.barrier import Barrier, BarrierRead
from kvstore.core.replica.batching import GroupCommit
from kvstore.core.replica.catchup import CatchUp
from kvstore.core.replica.config import Mutation, ReplicaConfig, StateView
from kvstore.core.replica.context import Context
from kvstore.core.replica.events import (
    Appended,
    AppendFailed,
    ClientGone,
    CommitApplied,
    EndPurpose,
    EndRead,
    EndReadFailed,
    Event,
    Fenced,
    FenceFailed,
    Fetched,
    FetchFailed,
    FetchOutOfRange,
    LeadChanged,
    ProbeRequested,
    ReadArrived,
    ReplayApplyFailed,
    Replayed,
    Rewound,
    SnapshotDone,
    Started,
    StopOverdue,
    StopRequested,
    Tick,
    Wiped,
    WriteArrived,
)
from kvstore.core.replica.reader import ReaderState
from kvstore.core.replica.writes import write_for
from kvstore.core.role import BROKEN, REBUILDING, AppendOutcome, Next, Role, RoleMachine


class ReplicaMachine:
    """One shard replica's protocol. Drivers report events and perform actions (module docstring)."""

    def __init__(self, config: ReplicaConfig, view: StateView) -> None:
        self.ctx = Context(config, view)
        self.shard = config.shard
        self.role = RoleMachine(config.shard)
        self.started = False
        self.exited = False
        self.lead_again_at_ms: float | None = None  # a leadership that ended while the shard is still ours
        self.retake_after_ms: float | None = None  # a failed leadership: retake after this backoff
        # The writer: at most one of fence / append / settled-end read at a time, never closed under one.
        self.writer_busy = False
        self.catch_up = CatchUp(self.ctx, self.role, self._leadership_failed)
        self.batching = GroupCommit(self.ctx)
        self.barrier = Barrier(self.ctx)

    # ---- what drivers ask --------------------------------------------------------------------------------

    @property
    def config(self) -> ReplicaConfig:
        return self.ctx.config

    @config.setter
    def config(self, config: ReplicaConfig) -> None:
        """A driver changes a setting (`standby`) between steps; the shard never changes."""
        assert config.shard == self.shard, (config.shard, self.shard)
        self.ctx.config = config

    @property
    def term(self) -> int:
        return self.role.term

    @property
    def caught_up(self) -> bool:
        """Reached the end seen when the reading started (a node's readiness)."""
        return self.catch_up.caught_up

    @property
    def reader(self) -> ReaderState:
        return self.catch_up.state

    @property
    def holding(self) -> bool:
        """Still acting as leader, or a batch or fence still running (what the group waits for
        before it gives the shard to another node)."""
        return (self.role.role not in (Role.FOLLOWER, Role.STOPPED) or self.writer_busy
                or self.batching.committing is not None)

    @property
    def pending_writes(self) -> int:
        return self.batching.pending

    def wake_at_ms(self) -> float | None:
        """The earliest time a `Tick` has something to do, or None."""
        times = [*self.batching.wake_times(), *self.catch_up.wake_times(), *self.barrier.wake_times(),
                 *(t for t in (self.lead_again_at_ms,) if t is not None)]
        return min(times) if times else None

    # ---- the one entry point ---------------------------------------------------------------------------

    def step(self, event: Event, *, now_ms: float, unix_ms: int) -> list[Action]:
        """Everything that follows from `event` at monotonic time `now_ms` (`unix_ms` stamps
        batches and judges request-id horizons)."""
        assert not self.exited, f"shard {self.shard}: {event!r} after Exit"
        ctx = self.ctx
        ctx.now_ms, ctx.unix_ms = now_ms, unix_ms
        ctx.out = []
        _HANDLERS[type(event)](self, event)
        if not self.exited:
            self._advance()
        out, ctx.out = ctx.out, []
        return out

    # ---- events: intent and time ----------------------------------------------------------------------

    def _on_started(self, event: Started) -> None:
        assert not self.started, "Started twice"
        self.started = True

    def _on_lead_changed(self, event: LeadChanged) -> None:
        unable = self.role.set_lead(event.lead)
        if unable is not None:
            self.ctx.emit(Note(f"shard {self.shard}: not taking leadership: {unable}", warning=True))
            self.ctx.emit(Unable(unable))
        if not self.role.want_lead:
            self.lead_again_at_ms = None
            self._step_down_if_idle()

    def _on_stop(self, event: StopRequested) -> None:
        self.role.stop()
        self.lead_again_at_ms = self.catch_up.retry_at_ms = None
        self._step_down_if_idle()
        if self.role.role is Role.FOLLOWER:
            self.catch_up.stop()  # a wait beyond the end is cut short: nothing is concluded while stopping

    def _on_stop_overdue(self, event: StopOverdue) -> None:
        """Every call still out is taken as failed, as its cancellation would end it: the writer's
        first (then the machine moves on as it would after that result), then the reader's."""
        assert self.role.stopping, "StopOverdue before StopRequested"
        reason = "node stopping"
        if self.batching.in_flight is not None:
            self._on_append_failed(AppendFailed(AppendOutcome.CANCELLED,
                                                "node stopping while the batch was committing"))
        elif self.writer_busy and self.role.role is Role.FENCING:
            self._on_fence_failed(FenceFailed(reason))
        elif self.writer_busy:
            self._on_end_read(EndReadFailed(EndPurpose.SETTLE, reason))
        self._advance()
        out = self.catch_up.reader.out
        if self.exited or out is None:
            return
        if isinstance(out, Fetch):
            self.catch_up.on_fetch_failed(FetchFailed(reason))
        elif isinstance(out, LoadSnapshot):
            self.catch_up.on_snapshot_done(SnapshotDone(False))
        elif isinstance(out, ReadEnd):
            self.catch_up.on_end_read_failed(EndReadFailed(out.purpose, reason))
        # A rewind, a wipe or an apply is the driver's own synchronous work: never left out.

    def _on_tick(self, event: Tick) -> None:
        now = self.ctx.now_ms
        if self.catch_up.retry_at_ms is not None and now >= self.catch_up.retry_at_ms:
            self.catch_up.retry_at_ms = None
        if self.lead_again_at_ms is not None and now >= self.lead_again_at_ms:
            self.lead_again_at_ms = None
        if self.batching.linger_over(now):
            self._maybe_start_batch(lingered=True)
        self.batching.refuse_late_parked(now)
        self.barrier.tick(now)
        self.catch_up.tick(now)

    # ---- events: requests -----------------------------------------------------------------------------

    def _on_write(self, event: WriteArrived) -> None:
        refusal = self.role.write_refusal(event.leader_hint)  # the one leadership check of a write
        if refusal is not None:
            self.ctx.emit(AnswerRequest(event.ticket, refusal))
            return
        self.batching.arrive(event.ticket, write_for(event.request, self.ctx.view), event.size)

    def _on_read(self, event: ReadArrived) -> None:
        refusal = self.role.write_refusal(event.leader_hint)
        if refusal is not None:
            self.ctx.emit(AnswerRequest(event.ticket, refusal))
        elif self.ctx.broken(Mutation.SKIP_READ_BARRIER):
            self.ctx.emit(AnswerRequest(event.ticket, READY))
        else:
            self.barrier.arrive(BarrierRead(event.ticket, None, event.keys, event.span))

    def _on_client_gone(self, event: ClientGone) -> None:
        """Not written if still queued (its id is free again); not awaited anywhere else."""
        if not self.batching.gone(event.ticket):
            self.barrier.gone(event.ticket)

    def _on_probe(self, event: ProbeRequested) -> None:
        self._probe()

    def _probe(self) -> None:
        if self.role.role is Role.LEADING:
            self.batching.probe()

    # ---- events: the writer ------------------------------------------------------------------------------

    def _on_fenced(self, event: Fenced) -> None:
        assert self.writer_busy and self.role.role is Role.FENCING, (self.writer_busy, self.role.role)
        self.writer_busy = False
        first = not self.role.refencing
        if not self.role.fenced(event.end):
            return  # given up meanwhile: STEPPING_DOWN, finished in _advance
        if first:
            self.ctx.emit(Note(f"shard {self.shard}: fenced in at {event.end} (term {self.role.term})",
                               metric="leader_changes"))
        self.ctx.emit(SetTerm(self.role.term))
        self.catch_up.start_catch_up(event.end)

    def _on_fence_failed(self, event: FenceFailed) -> None:
        assert self.writer_busy and self.role.role is Role.FENCING, (self.writer_busy, self.role.role)
        self.writer_busy = False
        self.ctx.emit(Note(f"shard {self.shard}: fencing failed: {event.reason}", warning=True))
        self._leadership_failed()

    def _on_appended(self, event: Appended) -> None:
        assert self.writer_busy, "Appended with the writer idle"
        self.writer_busy = False
        # W5: answered only now, the batch committed, and before the machine's own bookkeeping
        # (at CommitApplied): nothing that raises there can turn a committed write into a failure.
        self.batching.appended(event)

    def _on_commit_applied(self, event: CommitApplied) -> None:
        appended = self.batching.commit_applied()
        self.role.batch_committed(appended.offsets, appended.upcoming)  # the paired W1/W2 checks
        if event.error is not None:
            self.ctx.emit(Note(f"shard {self.shard}: applying a committed batch failed ({event.error}); giving the "
                               "shard up and rebuilding", metric="apply_failures", warning=True))
            self.role.apply_failed(event.error)
            self.ctx.emit(Unable(event.error))
            return
        # Reads waiting for this batch are served only now that the store holds it: served at
        # Appended, a read would have found the state without it when the apply failed (a disk
        # full in issue 22's campaign), then the wiped store.
        self._applied_to(appended.upcoming)
        self._step_down_if_idle()

    def _on_append_failed(self, event: AppendFailed) -> None:
        assert self.batching.in_flight is not None and self.writer_busy, "AppendFailed without a batch in flight"
        self.writer_busy = False
        decision = self.role.batch_failed(event.outcome)
        if decision.unknown:
            self.ctx.emit(Note("", metric="unknown_outcomes"))
        if decision.fencing:
            self.ctx.emit(Note("", metric="fencings"))
        self.batching.failed(decision.error(self.shard, event.detail))
        if decision.then is Next.STEP_DOWN:
            self.ctx.emit(Note(f"shard {self.shard}: stepping down: {decision.message} ({event.detail})",
                               warning=True))
            return
        # W2: after any abort or unknown outcome, learn the partition again before writing.
        self.ctx.emit(Note(f"shard {self.shard}: {event.detail or decision.message}; bootstrapping again",
                           warning=True))
        self.writer_busy = True
        # REFENCE: a fresh init_transactions completes or aborts our undecided transaction at
        # once; waiting for the settled end instead would wait out the transaction timeout.
        self.ctx.emit(Fence() if decision.then is Next.REFENCE else ReadSettledEnd())

    # ---- events: ends ------------------------------------------------------------------------------------

    def _on_end_read(self, event: EndRead | EndReadFailed) -> None:
        """An end, or the failure to read it, goes to the part that asked: the barrier's round,
        the writer's settled end, or the reader."""
        end = event.end if isinstance(event, EndRead) else None
        assert end is None or end >= 0, event
        if event.purpose is EndPurpose.BARRIER:
            if self.barrier.answered(end, event.reason if isinstance(event, EndReadFailed) else "", self.role):
                self._probe()
        elif event.purpose is EndPurpose.SETTLE:
            assert self.writer_busy and self.role.role is Role.CATCHING_UP, (self.writer_busy, self.role.role)
            self.writer_busy = False
            if isinstance(event, EndReadFailed):
                self.ctx.emit(Note(f"shard {self.shard}: re-bootstrap failed: {event.reason}", warning=True))
                self.role.resync_failed()
            elif self.role.keeps_leading:
                self.catch_up.start_catch_up(event.end)
            else:
                self.role.step_down()
        elif isinstance(event, EndReadFailed):
            self.catch_up.on_end_read_failed(event)
        else:
            self.catch_up.on_end_read(event)

    # ---- events: the reader --------------------------------------------------------------------------------

    def _on_replayed(self, event: Replayed) -> None:
        self.catch_up.replay_done()
        self._applied_to(self.ctx.applied())
        self.catch_up.on_replayed()

    def _applied_to(self, checkpoint: int) -> None:
        """Everything below `checkpoint` is applied (once the driver performed the apply just
        emitted): writes parked on a lock try again first (the apply may have released it),
        and the reads waiting for it are served."""
        self.batching.unpark()
        self.barrier.applied_to(checkpoint)

    # ---- what follows, whatever happened ---------------------------------------------------------------

    def _maybe_start_batch(self, *, lingered: bool = False) -> None:
        if self.writer_busy:
            return
        # Any linearizable read in flight may be about to wait on a lock a lingering resolve releases.
        barrier = self.barrier
        waiters = bool(barrier.locked_reads or barrier.round or barrier.next_round)
        read_only = self.batching.maybe_start(self.role, lingered=lingered, waiters=waiters)
        if self.batching.in_flight is not None:
            self.writer_busy = True
        # Read-only Txns saw committed state only: the barrier makes their answers linearizable.
        for ticket, response in read_only or ():
            if self.ctx.broken(Mutation.SKIP_READ_BARRIER):
                self.ctx.answer(ticket, response)
            else:
                self.barrier.arrive(BarrierRead(ticket, response))

    def _refuse_waiting(self, error: errors.StoreError) -> None:
        """Leadership over: nothing queued was written, a retry anywhere is safe."""
        self.batching.refuse_all(error)
        self.barrier.refuse_all(error)
        self.batching.forget_linger()

    def _step_down_if_idle(self) -> None:
        """Leave a leadership that is no longer wanted, unless the writer is busy (its result
        ends it then: a fence, a batch, a settled-end read never run under a closed writer)."""
        if (not self.role.keeps_leading and self.role.role in (Role.CATCHING_UP, Role.LEADING)
                and not self.writer_busy and self.batching.committing is None):
            self.role.step_down()

    def _leadership_failed(self) -> None:
        self.role.step_down()
        self.retake_after_ms = self.catch_up.next_backoff()

    def _idle(self) -> bool:
        return not self.writer_busy and self.batching.committing is None

    def _advance(self) -> None:
        """Move on from wherever the last event left the replica: finish a step-down, exit,
        rebuild, take the shard, read, start a batch or a barrier round. Called after every
        event: the machine's one scheduler."""
        role = self.role
        if role.role is Role.STEPPING_DOWN and self._idle():
            self._finish_leadership()
        if role.stopping:
            if role.role in (Role.FOLLOWER, Role.STOPPED) and self._idle() and self.catch_up.reader.out is None:
                if role.role is Role.FOLLOWER:
                    role.stopped()
                self._refuse_waiting(errors.UnavailableError(f"shard {self.shard}: node shutting down"))
                self.catch_up.stop()
                self.ctx.emit(Exit())
                self.exited = True
            return
        if not self.started:
            return
        if role.role is Role.FOLLOWER and self.catch_up.reader.out is None:
            if BROKEN in role.unable:
                self._rebuild()
                return
            if role.want_lead and self.lead_again_at_ms is None:
                self._begin_leadership()
            elif self.catch_up.state is ReaderState.IDLE and self.catch_up.retry_at_ms is None:
                if self.config.standby or REBUILDING in role.unable:
                    self.catch_up.start_following()
                else:
                    self.catch_up.caught_up = True  # idle at its checkpoint: catches up when it leads
        if self.catch_up.fetching and self.catch_up.reader.out is None:
            self.catch_up.next_fetch()
            if role.role is Role.STEPPING_DOWN and self._idle():
                self._finish_leadership()  # the catch-up just gave the shard up (a stale end)
        if role.role is Role.LEADING:
            self._maybe_start_batch()
            self.barrier.send()

    def _begin_leadership(self) -> None:
        self.catch_up.stop()
        self.role.begin_fencing()
        self.writer_busy = True
        self.retake_after_ms = None
        self.ctx.emit(Fence())

    def _finish_leadership(self) -> None:
        """Nothing of the leadership runs any more: refuse what waited, close the writer, and
        take the shard again later if it is still ours (fenced by a zombie or `kvstore fence`)."""
        self.role.stepped_down()
        self.catch_up.stop()
        self._refuse_waiting(errors.UnavailableError(
            f"shard {self.shard}: {'node shutting down' if self.role.stopping else 'leadership lost; retry'}"))
        self.ctx.emit(CloseWriter())
        pause, self.retake_after_ms = self.retake_after_ms, None
        if self.role.keeps_leading:
            self.lead_again_at_ms = self.ctx.now_ms + (self.config.refence_pause_ms if pause is None else pause)

    def _rebuild(self) -> None:
        """A committed batch could not be applied here: wipe, then replay (`REBUILDING` until
        caught up: leading is refused meanwhile)."""
        reason = self.role.unable[BROKEN]
        self.role.mark_unable(REBUILDING, f"rebuilding after: {reason}")
        self.ctx.emit(Note(f"shard {self.shard}: rebuilding after: {reason}", metric="rebuilds", warning=True))
        self.catch_up.rebuild(reason)


def _to_catch_up(handler: Callable[[CatchUp, Any], None]) -> Callable[[ReplicaMachine, Any], None]:
    return lambda machine, event: handler(machine.catch_up, event)


_HANDLERS: dict[type, Callable[[ReplicaMachine, Any], None]] = {
    Started: ReplicaMachine._on_started,
    LeadChanged: ReplicaMachine._on_lead_changed,
    StopRequested: ReplicaMachine._on_stop,
    StopOverdue: ReplicaMachine._on_stop_overdue,
    Tick: ReplicaMachine._on_tick,
    WriteArrived: ReplicaMachine._on_write,
    ReadArrived: ReplicaMachine._on_read,
    ClientGone: ReplicaMachine._on_client_gone,
    ProbeRequested: ReplicaMachine._on_probe,
    Fenced: ReplicaMachine._on_fenced,
    FenceFailed: ReplicaMachine._on_fence_failed,
    EndRead: ReplicaMachine._on_end_read,
    EndReadFailed: ReplicaMachine._on_end_read,
    Fetched: _to_catch_up(CatchUp.on_fetched),
    FetchOutOfRange: _to_catch_up(CatchUp.on_fetch_out_of_range),
    FetchFailed: _to_catch_up(CatchUp.on_fetch_failed),
    Replayed: ReplicaMachine._on_replayed,
    ReplayApplyFailed: _to_catch_up(CatchUp.on_replay_apply_failed),
    Rewound: lambda machine, _event: machine.catch_up.on_rewound(),
    Wiped: lambda machine, _event: machine.catch_up.on_wiped(),
    SnapshotDone: _to_catch_up(CatchUp.on_snapshot_done),
    Appended: ReplicaMachine._on_appended,
    AppendFailed: ReplicaMachine._on_append_failed,
    CommitApplied: ReplicaMachine._on_commit_applied,
}
assert set(_HANDLERS) == set(Event.__args__), "every event needs a handler"
