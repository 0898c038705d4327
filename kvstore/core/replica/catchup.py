"""Catching up: a standby following the shard, and a takeover replaying to the end it fenced at.

Both are one course of the reader (`kvstore.core.replica.reader`, docs/design.md §5.1): make
the checkpoint trustworthy (rewind over an assumed marker slot, load a snapshot into an empty
replica, wait out a checkpoint beyond the end), then fetch and apply until the end.

Invariants kept here:

* *The marker's slot is read again* before anything else (`RewindUnverified`): a record a
  foreign writer slipped into the slot this node assumed its marker took is applied here as
  everywhere (skip-marker-rewind is the mutation that forgets it).
* *W6*: a catch-up leads only from the end it fenced or settled at, once everything below it is
  applied (`RoleMachine.replayed_to`); a replay that went past that end, or an end that moved
  while taking over, means that end was stale: the shard is taken again, never led from it.
* *Nothing jumps*: a log start above the checkpoint loads a snapshot or refuses to lead
  (NEEDS_SNAPSHOT); a checkpoint beyond the end is believed only after `beyond_end_grace_ms`
  of fresh reads (`kvstore.core.recovery.beyond_end`), then wiped and replayed.
* *Stale results are dropped*: an answer counts only in the state that asked for it, and a
  poll only from the current checkpoint; what was applied stays applied.
* *Bounded*: a catch-up gives up after `bootstrap_timeout_ms`; retries back off, doubling up to
  `backoff_max_ms`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvstore.core.recovery import Beyond, beyond_end
from kvstore.core.replica.actions import (
    Able,
    ApplyReplayed,
    Fetch,
    LoadSnapshot,
    Note,
    ReadEnd,
    RewindUnverified,
    Unable,
    Wipe,
)
from kvstore.core.replica.config import Mutation
from kvstore.core.replica.context import Context
from kvstore.core.replica.events import (
    EndPurpose,
    EndRead,
    EndReadFailed,
    Fetched,
    FetchFailed,
    FetchOutOfRange,
    ReplayApplyFailed,
    SnapshotDone,
)
from kvstore.core.replica.reader import CATCH_UP, FOLLOW, Reader, ReaderState
from kvstore.core.role import BROKEN, NEEDS_SNAPSHOT, REBUILDING, Role, RoleMachine


@dataclasses.dataclass
class Confirm:
    """A checkpoint beyond the end, being waited out (`kvstore.core.recovery.beyond_end`)."""

    end: int
    fresh: bool  # `end` was read by the last attempt, not kept from an earlier one
    deadline_ms: float
    next_read_ms: float


class CatchUp:
    def __init__(self, ctx: Context, role: RoleMachine, leadership_failed: Callable[[], None]) -> None:
        self.ctx = ctx
        self.role = role
        self._leadership_failed = leadership_failed  # a failed catch-up gives the leadership up
        self.reader = Reader(ctx.shard)
        self.caught_up = False  # reached the end seen when the reading started (a node's readiness)
        self.follow_end = 0  # the end a follower catches up to
        self.target_end = 0  # the end a catch-up replays to (W6)
        self.deadline_ms = 0.0  # a catch-up still fetching then gives the leadership up
        self.confirm: Confirm | None = None
        self.loading_at_least = 0
        self.retry_at_ms: float | None = None  # a failed reading starts over then
        self.backoff_ms = ctx.config.backoff_first_ms

    @property
    def state(self) -> ReaderState:
        return self.reader.state

    @property
    def fetching(self) -> bool:
        return self.reader.state.stage == "fetching"

    def _catching_up(self) -> bool:
        return self.reader.state.purpose == CATCH_UP

    # ---- starting and ending ------------------------------------------------------------------

    def start_following(self) -> None:
        self._start(FOLLOW, 0)

    def start_catch_up(self, end: int) -> None:
        self._start(CATCH_UP, end)

    def _start(self, purpose: str, end: int) -> None:
        """Follow, or catch up to `end`. First the checkpoint is made trustworthy: the marker
        slot this node may have assumed is read again, an empty replica loads a snapshot, a
        checkpoint beyond the end is waited out; then fetch."""
        ctx = self.ctx
        assert self.reader.out is None, f"a new reading while {self.reader.out} is out"
        self.confirm, self.target_end = None, end
        if purpose == CATCH_UP:
            self.deadline_ms = ctx.now_ms + ctx.config.bootstrap_timeout_ms
        else:
            self.caught_up = False
        rewinding = ReaderState((purpose, "rewinding"))
        if ctx.broken(Mutation.SKIP_MARKER_REWIND):
            self.reader.enter(rewinding)
            self._prepare_checkpoint()
            return
        ctx.emit(self.reader.send(RewindUnverified(), rewinding))

    def stop(self) -> None:
        """The reading ends here; an action of it still out is answered, and its result ignored."""
        self.reader.enter(ReaderState.IDLE)
        self.confirm = None

    def rebuild(self, reason: str) -> None:
        """A committed batch could not be applied here: wipe (then the machine follows again)."""
        self.caught_up = False
        self.stop()
        self.ctx.emit(self.reader.send(Wipe(f"a committed batch could not be applied: {reason}"),
                                       ReaderState.REBUILD_WIPING))

    def failed(self, why: str) -> None:
        """A reading cannot go on: a follower starts over after a backoff; a takeover gives
        this leadership up and takes the shard again after one."""
        catching_up = self._catching_up()
        self.stop()
        self.ctx.emit(Note(f"{why}; retrying in {self.backoff_ms / 1000:.1f}s", warning=True))
        if catching_up:
            self._leadership_failed()
        else:
            self.retry_at_ms = self.ctx.now_ms + self.next_backoff()

    def next_backoff(self) -> float:
        backoff, self.backoff_ms = self.backoff_ms, min(self.backoff_ms * 2, self.ctx.config.backoff_max_ms)
        return backoff

    # ---- the course -------------------------------------------------------------------------

    def _prepare_checkpoint(self) -> None:
        if self.ctx.applied() == 0 and (not self._catching_up() or self.target_end > 0):
            self._load_snapshot(0, "the replica is empty")
        else:
            self._check_beyond(self.target_end if self._catching_up() else None)

    def _load_snapshot(self, at_least: int, why: str) -> None:
        self.loading_at_least = at_least
        self.ctx.emit(self.reader.send(LoadSnapshot(at_least, why), self.reader.state.at("loading")))

    def _check_beyond(self, end: int | None) -> None:
        """Compare the checkpoint with `end` (a follower reads the end first: None)."""
        ctx = self.ctx
        if end is None:
            ctx.emit(self.reader.send(ReadEnd(EndPurpose.FOLLOW), ReaderState.FOLLOW_READING_END))
        elif ctx.applied() <= end:
            self._fetch_stage()
        else:
            self.reader.enter(self.reader.state.at("confirming"))
            self.confirm = Confirm(end, True, ctx.now_ms + ctx.config.beyond_end_grace_ms,
                                   ctx.now_ms + ctx.config.beyond_end_poll_ms)

    def _confirmed(self) -> None:
        """The wait beyond the end is over: the end caught up, or the grace period passed."""
        ctx = self.ctx
        confirm, self.confirm = self.confirm, None
        assert confirm is not None and self.reader.state.stage == "confirming", self.reader.state
        applied = ctx.applied()
        if self._catching_up() and self.target_end < applied <= confirm.end:
            # The end we fenced at was stale, and so is the upcoming offset: take the shard again.
            self.failed(f"shard {ctx.shard}: partition end moved from {self.target_end} to {confirm.end} "
                        "while taking over; taking over again")
            return
        if not self._catching_up():
            self.follow_end = max(self.follow_end, confirm.end)
        verdict = beyond_end(applied, confirm.end, end_fresh=confirm.fresh, stopping=self.role.stopping)
        if verdict is Beyond.NO:
            self._fetch_stage()
        elif verdict is Beyond.UNCONFIRMED:
            self.failed(f"shard {ctx.shard}: checkpoint {applied} beyond the partition end {confirm.end}, "
                        "unconfirmed (end unreadable or stopping)")
        else:
            ctx.emit(Note(f"shard {ctx.shard}: checkpoint {applied} beyond the WAL's end {confirm.end}: the WAL "
                          "was recreated; rebuilding", metric="rebuilds", warning=True))
            ctx.emit(self.reader.send(Wipe(f"checkpoint {applied} beyond WAL end {confirm.end}"),
                                      self.reader.state.at("wiping")))

    def _fetch_stage(self) -> None:
        self.reader.enter(self.reader.state.at("fetching"))
        if not self._catching_up() and self.ctx.applied() >= self.follow_end:
            self._reached_end()

    def _reached_end(self) -> None:
        if not self.caught_up:
            self.caught_up = True
        if REBUILDING in self.role.unable:
            self.ctx.emit(Note(f"shard {self.ctx.shard}: rebuilt at offset {self.ctx.applied()}"))
            if self.role.clear_unable(REBUILDING):
                self.ctx.emit(Able())

    def next_fetch(self) -> None:
        """Fetching, nothing out: poll on, or (a catch-up at its end) lead."""
        ctx = self.ctx
        if not self._catching_up():
            ctx.emit(self.reader.send(Fetch(ctx.applied(), None), ReaderState.FOLLOW_FETCHING))
            return
        assert self.role.role is Role.CATCHING_UP, (self.reader.state, self.role.role)
        # A catch-up no longer wanted was given up when that was said (_step_down_if_idle).
        assert self.role.keeps_leading, "catching up for a leadership given up"
        applied = ctx.applied()
        if applied > self.target_end:
            # The replay went past the end we fenced or settled at: that end was stale (read from
            # a broker behind, or the marker of our last commit landed after it was read).
            # Leading from it would plan at an offset our state is already past (W6): take the
            # shard again, as `_confirmed` does when the end moves during a takeover.
            self.failed(f"shard {ctx.shard}: replayed to {applied}, past the end {self.target_end} it "
                        "was taking over at (a stale end); taking over again")
            return
        if applied == self.target_end:
            self.stop()
            leads = self.role.replayed_to(self.target_end)  # W6: leads from the end it caught up to
            assert leads
            self.caught_up = True
            self.backoff_ms = ctx.config.backoff_first_ms
            ctx.emit(Note(f"shard {ctx.shard}: leading at offset {self.target_end} (term {self.role.term})"))
        else:
            ctx.emit(self.reader.send(Fetch(ctx.applied(), self.target_end), ReaderState.CATCH_UP_FETCHING))

    # ---- time ---------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        ctx = self.ctx
        confirm = self.confirm
        if confirm is not None and self.reader.out is None:
            if now >= confirm.deadline_ms:
                self._confirmed()
            elif now >= confirm.next_read_ms:
                ctx.emit(self.reader.send(ReadEnd(EndPurpose.CONFIRM)))
        if self.reader.state is ReaderState.CATCH_UP_FETCHING and now >= self.deadline_ms:
            self.failed(f"shard {ctx.shard}: bootstrap stuck at {ctx.applied()} of {self.target_end}")

    def wake_times(self) -> list[float]:
        times = [self.retry_at_ms] if self.retry_at_ms is not None else []
        if self.reader.state is ReaderState.CATCH_UP_FETCHING:
            times.append(self.deadline_ms)
        if self.confirm is not None and self.reader.out is None:
            times.append(min(self.confirm.next_read_ms, self.confirm.deadline_ms))
        return times

    # ---- the reader's results ---------------------------------------------------------------------

    def on_end_read(self, event: EndRead) -> None:
        """FOLLOW or CONFIRM (the machine routes BARRIER and SETTLE elsewhere)."""
        ctx = self.ctx
        self.reader.done(ReadEnd)
        state = self.reader.state
        if event.purpose is EndPurpose.CONFIRM and state.stage == "confirming" and self.confirm is not None:
            confirm = self.confirm
            confirm.end, confirm.fresh = event.end, True
            confirm.next_read_ms = ctx.now_ms + ctx.config.beyond_end_poll_ms
            if ctx.applied() <= event.end:
                self._confirmed()
        elif event.purpose is EndPurpose.FOLLOW and state is ReaderState.FOLLOW_READING_END:
            self.follow_end = event.end
            self._check_beyond(event.end)

    def on_end_read_failed(self, event: EndReadFailed) -> None:
        ctx = self.ctx
        self.reader.done(ReadEnd)
        if event.purpose is EndPurpose.CONFIRM and self.confirm is not None:
            self.confirm.fresh = False  # keep the last end, ask again
            self.confirm.next_read_ms = ctx.now_ms + ctx.config.beyond_end_poll_ms
        elif event.purpose is EndPurpose.FOLLOW and self.reader.state is ReaderState.FOLLOW_READING_END:
            self.failed(f"shard {ctx.shard}: reading the partition end: {event.reason}")

    def on_fetched(self, event: Fetched) -> None:
        self.reader.done(Fetch)
        if not self.fetching or event.from_offset != self.ctx.applied():
            return  # another reading now: the next fetch asks again from the checkpoint
        assert event.position >= event.from_offset, event
        records = tuple(event.records)
        if records or event.position > event.from_offset:
            assert all(event.from_offset <= offset < event.position for offset, _ in records), event
            self.ctx.emit(self.reader.send(ApplyReplayed(records, event.position), self.reader.state))
            return  # the rest once the store has them (Replayed)
        self.backoff_ms = self.ctx.config.backoff_first_ms

    def replay_done(self) -> None:
        """`Replayed`, part one: the apply is no longer out (the machine serves what waited on it)."""
        self.reader.done(ApplyReplayed)

    def on_replayed(self) -> None:
        """`Replayed`, part two: the reading moves on, if it is still the one that fetched."""
        if not self.fetching:
            return  # the reading was given up meanwhile; what was applied stays applied
        self.backoff_ms = self.ctx.config.backoff_first_ms
        if not self._catching_up() and self.ctx.applied() >= self.follow_end:
            self._reached_end()

    def on_fetch_out_of_range(self, event: FetchOutOfRange) -> None:
        self.reader.done(Fetch)
        if not self.fetching or event.from_offset != self.ctx.applied():
            return
        if event.below_start:
            self._load_snapshot(event.log_start, f"the WAL starts at {event.log_start}, above the checkpoint "
                                                 f"{self.ctx.applied()} (truncated)")
        else:
            self._check_beyond(event.log_end)

    def on_fetch_failed(self, event: FetchFailed) -> None:
        self.reader.done(Fetch)
        if self.fetching:
            self.failed(f"shard {self.ctx.shard}: {event.reason}")

    def on_replay_apply_failed(self, event: ReplayApplyFailed) -> None:
        self.reader.done(ApplyReplayed)
        if self.fetching:
            self.failed(f"shard {self.ctx.shard}: applying replayed records failed: {event.reason}")

    def on_rewound(self) -> None:
        self.reader.done(RewindUnverified)
        if self.reader.state.stage == "rewinding":
            self._prepare_checkpoint()

    def on_wiped(self) -> None:
        self.reader.done(Wipe)
        assert self.ctx.applied() == 0, f"wiped, but the checkpoint is {self.ctx.applied()}"
        if BROKEN in self.role.unable:  # a rebuild's wipe: following now replays everything
            self.role.clear_unable(BROKEN)
            self.stop()
        elif self.reader.state.stage == "wiping":
            self._fetch_stage()

    def on_snapshot_done(self, event: SnapshotDone) -> None:
        ctx = self.ctx
        self.reader.done(LoadSnapshot)
        if self.reader.state.stage != "loading":
            return
        at_least = self.loading_at_least
        if event.loaded:
            ctx.emit(Note(f"shard {ctx.shard}: loaded a snapshot; replaying the WAL from {ctx.applied()}",
                          metric="snapshot_loads"))
            if at_least > 0 and self.role.clear_unable(NEEDS_SNAPSHOT):
                ctx.emit(Able())
        elif at_least > 0:
            why = (f"shard {ctx.shard}: the WAL was truncated at offset {at_least}, above this replica's checkpoint "
                   f"{ctx.applied()}; it can only be rebuilt from a snapshot taken at or after {at_least}")
            if NEEDS_SNAPSHOT not in self.role.unable:
                # Leading from here would serve a state missing everything below the log start,
                # and retrying leadership would loop: leave the shard to a node that can.
                self.role.mark_unable(NEEDS_SNAPSHOT, why)
                ctx.emit(Note(f"{why}; not leading it", warning=True))
                ctx.emit(Unable(why))
            self.failed(why)
            return
        # Loaded, or an empty replica with no snapshot to load (it replays the whole WAL).
        self._check_beyond(self.target_end if self._catching_up() else None)
