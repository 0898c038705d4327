"""`kvstore.core.replica.ReplicaMachine`, event by event: scenario tables (as tests/unit/test_guard.py
does for the guard), no Kafka, no asyncio, no clock.

A scenario is a list of steps: an event, the time it arrives at, and the actions the machine must
return (by name, with the fields that matter), then checks of its state. `Drive` performs what a
driver does to the store itself (apply, rewind, wipe) so that the view the machine reads is the
one a node would have; every other result is reported by the scenario, explicitly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvstore import errors
from kvstore.core import replica as core
from kvstore.core.batch import BatchLimits
from kvstore.core.evaluate import evaluate_put
from kvstore.core.replica import (
    READY,
    Appended,
    AppendFailed,
    ClientGone,
    CommitApplied,
    EndPurpose,
    EndRead,
    EndReadFailed,
    Fenced,
    FenceFailed,
    Fetched,
    FetchFailed,
    FetchOutOfRange,
    LeadChanged,
    Mutation,
    ProbeRequested,
    ReadArrived,
    ReaderState,
    ReplayApplyFailed,
    Replayed,
    ReplicaConfig,
    ReplicaMachine,
    Rewound,
    SnapshotDone,
    Started,
    StopOverdue,
    StopRequested,
    Tick,
    Wiped,
    WriteArrived,
)
from kvstore.core.replica.machine import _HANDLERS
from kvstore.core.replica.performers import perform_all
from kvstore.core.replica.reader import _VALID as reader_moves
from kvstore.core.replica.trace import StorePerformers
from kvstore.core.request_window import MemoryShard
from kvstore.core.role import BROKEN, NEEDS_SNAPSHOT, REBUILDING, AppendOutcome, Role
from kvstore.v1 import kv_pb2

UNIX_MS = 1_750_000_000_000
CONFIG = ReplicaConfig(shard=0, batch_limits=BatchLimits(4, 1 << 20, 1 << 19), max_pending=3, linger_ms=2,
                       bootstrap_timeout_ms=1_000, barrier_timeout_ms=500, refence_pause_ms=300,
                       beyond_end_grace_ms=2_000, beyond_end_poll_ms=500, backoff_first_ms=100, backoff_max_ms=400)


def entry(key: bytes, revision: int, request_id: str = "") -> bytes:
    """A WAL entry putting `key` (what a leader would have appended at `revision`)."""
    evaluation = evaluate_put(kv_pb2.PutRequest(key=key, value=b"v", request_id=request_id), lambda _k: None, 0,
                              revision)
    assert evaluation.entry is not None
    return evaluation.entry.SerializeToString()


def put(key: bytes, request_id: str = "") -> core.ClientRequest:
    return core.ClientRequest(kv_pb2.PutRequest(key=key, value=b"v", request_id=request_id,
                                                first_attempt_unix_ms=UNIX_MS), 0)


def txn_get(key: bytes) -> core.ClientRequest:
    """A read-only Txn (Get ops only): no record, answered through a barrier."""
    return core.ClientRequest(kv_pb2.TxnRequest(compares=[kv_pb2.Compare(key=key, target=kv_pb2.Compare.TARGET_VERSION,
                                                               op=kv_pb2.Compare.OP_EQUAL, version=0)],
                                      success=[kv_pb2.TxnOp(get=kv_pb2.GetRequest(key=key))]), 0)


class Drive(StorePerformers):
    """A machine over a `MemoryShard`, with the store's side of a driver (apply, rewind, wipe),
    performed through the core's one table (`kvstore.core.replica.performers`, the replay's
    `StorePerformers`); every other result is the scenario's to report, and so are the local
    ones but `Replayed`."""

    def __init__(self, config: ReplicaConfig = CONFIG, store: MemoryShard | None = None) -> None:
        super().__init__(store or MemoryShard())
        self.machine = ReplicaMachine(config, self.store)
        self.now_ms = 0.0
        self.auto_apply = True  # apply replayed records and report them, as a driver does

    def step(self, event: core.Event, at_ms: float | None = None) -> list[core.Action]:
        if at_ms is not None:
            self.now_ms = at_ms
        actions = self.machine.step(event, now_ms=self.now_ms, unix_ms=UNIX_MS + int(self.now_ms))
        for result in perform_all(self, actions):
            if isinstance(result, core.Replayed) and self.auto_apply:  # applied and reported
                actions += self.step(result)
        return actions

    def perform_apply_replayed(self, action: core.ApplyReplayed) -> str | None:
        return super().perform_apply_replayed(action) if self.auto_apply else None


def shown(action: core.Action) -> str:
    """An action as the tables name it: its class, and the fields that matter for the protocol."""
    name = type(action).__name__
    if isinstance(action, core.AnswerRequest):
        answer = action.answer
        what = ("READY" if answer is READY else type(answer).__name__)
        return f"Answer({action.ticket},{what})"
    if isinstance(action, core.Fetch):
        return f"Fetch({action.from_offset},{action.upto})"
    if isinstance(action, core.Append):
        return f"Append({action.revision},{len(action.payloads)})"
    if isinstance(action, core.ReadEnd):
        return f"ReadEnd({action.purpose.value})"
    if isinstance(action, (core.ApplyReplayed, core.ApplyCommitted)):
        return f"{name}({action.checkpoint})"
    if isinstance(action, core.LoadSnapshot):
        return f"LoadSnapshot({action.at_least})"
    if isinstance(action, core.SetTerm):
        return f"SetTerm({action.term})"
    if isinstance(action, core.Note):
        return f"Note({action.metric})" if action.metric else "Note"
    return name


Step = tuple[core.Event, float | None, list[str]]
Check = Callable[[Drive], Any]


def run(drive: Drive, steps: Sequence[Step]) -> Drive:
    for number, (event, at_ms, expected) in enumerate(steps):
        got = [shown(a) for a in drive.step(event, at_ms)]
        got = [g for g in got if g != "Note"]  # log lines: not part of the protocol
        assert got == expected, f"step {number} {event!r}: {got}, expected {expected}"
    return drive


# ---- ready-made starting points ------------------------------------------------------------------------

def following(end: int = 0, records: Sequence[tuple[int, bytes]] = (), config: ReplicaConfig = CONFIG) -> Drive:
    """A standby that caught up to `end` (its records applied) and has a fetch out."""
    drive = Drive(config)
    run(drive, [
        (Started(), 0, ["RewindUnverified"]),
        (Rewound(), None, ["LoadSnapshot(0)"]),  # an empty replica looks for a snapshot first
        (SnapshotDone(False), None, ["ReadEnd(follow)"]),
        (EndRead(EndPurpose.FOLLOW, end), None, ["Fetch(0,None)"]),
    ])
    if end:
        run(drive, [(Fetched(0, records, end), None, [f"ApplyReplayed({end})", f"Fetch({end},None)"])])
    assert drive.machine.caught_up
    return drive


def leading(end: int = 2, config: ReplicaConfig = CONFIG) -> Drive:
    """A leader at `end` (term end + 1), nothing queued."""
    records = [(0, entry(b"a", 0))] if end else []
    drive = following(end, records, config)
    run(drive, [
        (LeadChanged(True), None, []),  # the follower's fetch is out: it returns first
        (Fetched(end, (), end), None, ["Fence"]),
        (Fenced(end), None, ["Note(leader_changes)", f"SetTerm({end + 1})", "RewindUnverified"]),
        (Rewound(), None, []),  # at the end already: leading
    ])
    assert drive.machine.role.role is Role.LEADING and drive.machine.role.upcoming == end
    return drive


def reading_the_end_at(checkpoint: int) -> Drive:
    """A replica whose store holds a record and the checkpoint `checkpoint`, started: rewound,
    and reading the end it follows to (a ReadEnd out)."""
    store = MemoryShard()
    store.apply([(0, entry(b"a", 0))], checkpoint)
    drive = Drive(store=store)
    run(drive, [(Started(), 0, ["RewindUnverified"]), (Rewound(), None, ["ReadEnd(follow)"])])
    return drive


def committed(drive: Drive, revision: int, count: int) -> Appended:
    offsets = tuple(range(revision, revision + count))
    return Appended(offsets, revision + count + 1, revision + count)


def state(drive: Drive, role: Role | None = None, reader: ReaderState | None = None, **fields: Any) -> None:
    m = drive.machine
    if role is not None:
        assert m.role.role is role, (m.role.role, role)
    if reader is not None:
        assert m.reader is reader, (m.reader, reader)
    for name, value in fields.items():
        assert getattr(m, name) == value, (name, getattr(m, name), value)


# ---- following -----------------------------------------------------------------------------------------

def test_a_standby_rewinds_loads_reads_the_end_then_tails() -> None:
    drive = following(3, [(0, entry(b"a", 0)), (1, entry(b"b", 1))])
    assert drive.store.applied_offset == 3 and drive.store.get(b"b") is not None
    run(drive, [(Fetched(3, (), 3), None, ["Fetch(3,None)"])])  # an empty poll: poll again


def test_a_replica_with_state_skips_the_snapshot_and_a_snapshot_loaded_is_counted() -> None:
    drive = reading_the_end_at(2)
    run(drive, [])
    empty = Drive()
    run(empty, [(Started(), 0, ["RewindUnverified"]), (Rewound(), None, ["LoadSnapshot(0)"])])
    empty.store.apply([], 40)  # what a loaded snapshot leaves: its cut as the checkpoint
    run(empty, [(SnapshotDone(True), None, ["Note(snapshot_loads)", "ReadEnd(follow)"]),
                (EndRead(EndPurpose.FOLLOW, 45), None, ["Fetch(40,None)"])])
    assert not empty.machine.caught_up


def test_without_standby_a_replica_idles_at_its_checkpoint() -> None:
    drive = Drive()
    drive.machine.config = dataclasses.replace(CONFIG, standby=False)  # as a node's `set_standby`
    run(drive, [(Started(), 0, [])])
    assert drive.machine.caught_up and drive.machine.reader is ReaderState.IDLE


def test_a_fetch_from_an_old_position_or_for_another_reading_is_dropped() -> None:
    drive = following(2, [(0, entry(b"a", 0))])
    run(drive, [(Fetched(0, [(0, entry(b"a", 0))], 2), None, ["Fetch(2,None)"])])  # from where it no longer is
    assert drive.store.applied_offset == 2


def test_a_failed_fetch_backs_off_then_the_reading_starts_over() -> None:
    drive = following(2, [(0, entry(b"a", 0))])
    run(drive, [
        (FetchFailed("broker down"), 10, []),
        (Tick(), 50, []),
        (Tick(), 110, ["RewindUnverified"]),  # after the 100 ms backoff: from the top
        (Rewound(), None, ["ReadEnd(follow)"]),
        (EndReadFailed(EndPurpose.FOLLOW, "still down"), 120, []),  # a second failure: 200 ms now
        (Tick(), 250, []),
        (Tick(), 320, ["RewindUnverified"]),
    ])
    assert drive.machine.catch_up.backoff_ms == 400


def test_a_replay_apply_that_fails_backs_off() -> None:
    """The store refused the records (nothing applied): the reading starts over after a backoff."""
    drive = following(2, [(0, entry(b"a", 0))])
    drive.auto_apply = False
    run(drive, [(Fetched(2, [(2, entry(b"b", 2))], 3), 0, ["ApplyReplayed(3)"]),
                (ReplayApplyFailed("disk full"), 0, [])])
    assert drive.machine.catch_up.retry_at_ms == 100 and drive.machine.reader is ReaderState.IDLE
    assert drive.store.applied_offset == 2


def test_nothing_is_planned_or_fetched_until_the_store_applied_the_replayed_records() -> None:
    """Sim seed 4: a catch-up planned its first batch in the step that asked for the apply of its
    last records, from a store that did not have them yet, and appended request ids again."""
    drive = following(2, [(0, entry(b"a", 0))])
    drive.auto_apply = False
    run(drive, [(LeadChanged(True), 0, []), (Fetched(2, (), 2), 0, ["Fence"]),
                (Fenced(4), 0, ["Note(leader_changes)", "SetTerm(5)", "RewindUnverified"]),
                (Rewound(), None, ["Fetch(2,4)"]),
                (WriteArrived(1, put(b"x", "r"), 10), 0, ["Answer(1,UnavailableError)"]),
                (Fetched(2, [(2, entry(b"b", 2, "r"))], 4), 0, ["ApplyReplayed(4)"])])
    assert drive.machine.role.role is Role.CATCHING_UP  # not leading on a state it does not have
    drive.store.apply([(2, entry(b"b", 2, "r"))], 4)
    run(drive, [(Replayed(), 0, []), (WriteArrived(2, put(b"x", "r"), 10), 0, ["Answer(2,PutResponse)"])])


def test_a_checkpoint_beyond_the_end_is_waited_out_then_wiped() -> None:
    drive = reading_the_end_at(10)
    run(drive, [
        (EndRead(EndPurpose.FOLLOW, 5), None, []),  # beyond: wait, re-reading the end
        (Tick(), 500, ["ReadEnd(confirm)"]),
        (EndRead(EndPurpose.CONFIRM, 6), 510, []),
        (Tick(), 1_010, ["ReadEnd(confirm)"]),
        (EndReadFailed(EndPurpose.CONFIRM, "down"), 1_020, []),
        (Tick(), 1_520, ["ReadEnd(confirm)"]),
        (EndRead(EndPurpose.CONFIRM, 7), 1_530, []),
        (Tick(), 2_000, ["Note(rebuilds)", "Wipe"]),  # still beyond a fresh end after the grace
        (Wiped(), None, ["Fetch(0,None)"]),
    ])


def test_a_stale_end_that_catches_up_is_no_reason_to_wipe() -> None:
    drive = reading_the_end_at(10)
    run(drive, [
        (EndRead(EndPurpose.FOLLOW, 5), None, []),
        (Tick(), 500, ["ReadEnd(confirm)"]),
        (EndRead(EndPurpose.CONFIRM, 12), 510, ["Fetch(10,None)"]),  # a broker back with its real end
    ])
    assert drive.machine.catch_up.follow_end == 12


def test_an_end_unreadable_through_the_grace_concludes_nothing() -> None:
    drive = reading_the_end_at(10)
    run(drive, [
        (EndRead(EndPurpose.FOLLOW, 5), None, []),
        (Tick(), 500, ["ReadEnd(confirm)"]),
        (EndReadFailed(EndPurpose.CONFIRM, "down"), 510, []),
        (Tick(), 2_000, []),  # unconfirmed: retry the reading later, never wipe
    ])
    assert drive.store.applied_offset == 10 and drive.machine.catch_up.retry_at_ms == 2_100


def test_below_a_truncated_log_start_a_snapshot_or_nothing() -> None:
    drive = following(2, [(0, entry(b"a", 0))])
    run(drive, [
        (FetchOutOfRange(2, True, 100, 150), None, ["LoadSnapshot(100)"]),
        (SnapshotDone(False), 5, ["Unable"]),  # needs a snapshot: refuses to lead, retries later
        (LeadChanged(True), None, ["Unable"]),
    ])
    assert NEEDS_SNAPSHOT in drive.machine.role.unable and not drive.machine.role.want_lead
    run(drive, [
        (Tick(), 105, ["RewindUnverified"]),
        (Rewound(), None, ["ReadEnd(follow)"]),
        (EndRead(EndPurpose.FOLLOW, 150), None, ["Fetch(2,None)"]),
        (FetchOutOfRange(2, True, 100, 150), None, ["LoadSnapshot(100)"]),
    ])
    drive.store.apply([], 120)  # a snapshot at 120 came along
    run(drive, [(SnapshotDone(True), None, ["Note(snapshot_loads)", "Able", "ReadEnd(follow)"])])
    assert not drive.machine.role.unable


def test_above_the_end_the_fetch_waits_the_end_out() -> None:
    drive = following(5, [(0, entry(b"a", 0))])
    run(drive, [(FetchOutOfRange(5, False, 0, 3), 0, []), (Tick(), 500, ["ReadEnd(confirm)"]),
                (EndRead(EndPurpose.CONFIRM, 9), 510, ["Fetch(5,None)"])])


# ---- taking the shard ------------------------------------------------------------------------------------

def test_taking_over_fences_catches_up_to_the_fenced_end_then_leads() -> None:
    drive = following(2, [(0, entry(b"a", 0))])
    run(drive, [
        (LeadChanged(True), None, []),
        (Fetched(2, (), 2), None, ["Fence"]),
        (Fenced(6), None, ["Note(leader_changes)", "SetTerm(7)", "RewindUnverified"]),
        (Rewound(), 50, ["Fetch(2,6)"]),
    ])
    assert drive.machine.wake_at_ms() == 1_000  # the catch-up's deadline, counted from the fence
    run(drive, [
        (WriteArrived(1, put(b"x"), 10), None, ["Answer(1,UnavailableError)"]),  # taking over: retry
        (Fetched(2, [(3, entry(b"b", 3))], 6), None, ["ApplyReplayed(6)"]),
    ])
    state(drive, Role.LEADING, ReaderState.IDLE)
    assert drive.machine.role.upcoming == 6 and drive.machine.term == 7


def test_a_replay_past_the_end_it_took_over_at_takes_the_shard_again() -> None:
    """Issue 22's campaign: after an undelivered batch, the settled end read 1151 while the
    replay reached 1152; leading from 1151 tripped the W6 assertion. Now: take the shard again."""
    drive = following(2, [(0, entry(b"a", 0))])
    run(drive, [
        (LeadChanged(True), None, []),
        (Fetched(2, (), 2), None, ["Fence"]),
        (Fenced(6), 10, ["Note(leader_changes)", "SetTerm(7)", "RewindUnverified"]),
        (Rewound(), None, ["Fetch(2,6)"]),
        (Fetched(2, [(3, entry(b"b", 3)), (6, entry(b"c", 6))], 7), None,
         ["ApplyReplayed(7)", "CloseWriter"]),  # past 6: no leading from a stale end
    ])
    assert drive.machine.role.role is not Role.LEADING and drive.machine.role.upcoming is None
    assert drive.store.applied_offset == 7  # what was replayed stays applied
    run(drive, [(Tick(), 200, ["Fence"])])  # after the backoff: take it again


def test_a_catch_up_past_its_deadline_gives_the_shard_up_and_takes_it_again() -> None:
    drive = following(2, [(0, entry(b"a", 0))])
    run(drive, [
        (LeadChanged(True), None, []), (Fetched(2, (), 2), None, ["Fence"]),
        (Fenced(9), 10, ["Note(leader_changes)", "SetTerm(10)", "RewindUnverified"]),
        (Rewound(), None, ["Fetch(2,9)"]),
        (Tick(), 1_010, ["CloseWriter"]),  # bootstrap stuck: give it up (the fetch still out)
        (Fetched(2, (), 2), 1_020, ["RewindUnverified"]),  # dropped; following again meanwhile
        (Rewound(), None, ["ReadEnd(follow)"]),
        (EndRead(EndPurpose.FOLLOW, 9), None, ["Fetch(2,None)"]),
        (Tick(), 1_110, []),  # the backoff (100 ms) is over, but the fetch is out
        (Fetched(2, (), 2), None, ["Fence"]),
    ])


def test_a_fence_that_fails_backs_off_and_resigning_while_fencing_steps_down() -> None:
    drive = following()
    run(drive, [
        (LeadChanged(True), None, []), (Fetched(0, (), 0), 0, ["Fence"]),
        (FenceFailed("coordinator moving"), 0, ["CloseWriter", "RewindUnverified"]),
        (Rewound(), None, ["LoadSnapshot(0)"]),
        (SnapshotDone(False), None, ["ReadEnd(follow)"]),
        (EndRead(EndPurpose.FOLLOW, 0), None, ["Fetch(0,None)"]),
        (Fetched(0, (), 0), 150, ["Fetch(0,None)"]),
        (Tick(), 150, []),  # the fetch is out
        (Fetched(0, (), 0), 160, ["Fence"]),
        (LeadChanged(False), None, []),
        (Fenced(0), None, ["CloseWriter", "RewindUnverified"]),  # given up meanwhile: step down
    ])
    state(drive, Role.FOLLOWER, ReaderState.FOLLOW_REWINDING)


def test_resigning_while_catching_up_steps_down_at_once() -> None:
    drive = following(2, [(0, entry(b"a", 0))])
    run(drive, [
        (LeadChanged(True), None, []), (Fetched(2, (), 2), None, ["Fence"]),
        (Fenced(9), None, ["Note(leader_changes)", "SetTerm(10)", "RewindUnverified"]),
        (LeadChanged(False), None, ["CloseWriter"]),  # the rewind is out: the reading resumes after
        (Rewound(), None, ["RewindUnverified"]),
    ])
    state(drive, Role.FOLLOWER, ReaderState.FOLLOW_REWINDING)


def test_the_end_moving_while_taking_over_means_taking_over_again() -> None:
    drive = reading_the_end_at(8)
    run(drive, [
                (EndRead(EndPurpose.FOLLOW, 8), None, ["Fetch(8,None)"]), (LeadChanged(True), None, []),
                (Fetched(8, (), 8), None, ["Fence"]),
                (Fenced(5), 0, ["Note(leader_changes)", "SetTerm(6)", "RewindUnverified"]),  # a stale end
                (Rewound(), None, []),
                (Tick(), 500, ["ReadEnd(confirm)"]),
                (EndRead(EndPurpose.CONFIRM, 9), 510, ["CloseWriter", "RewindUnverified"])])
    assert drive.machine.lead_again_at_ms == 610  # after a 100 ms backoff


# ---- group commit ----------------------------------------------------------------------------------------

def test_a_lone_write_lingers_is_appended_answered_after_the_commit_then_bookkept() -> None:
    drive = leading(2)
    run(drive, [
        (WriteArrived(1, put(b"k", "r1"), 10), 100, []),  # lingers 2 ms for company
        (Tick(), 101, []),
        (Tick(), 102, ["Append(2,1)"]),
        (WriteArrived(2, put(b"k", "r1"), 10), None, ["Answer(2,UnknownOutcomeError)"]),  # its id is in flight
        (committed(drive, 2, 1), None, ["ApplyCommitted(4)", "Answer(1,PutResponse)"]),
        (CommitApplied(), None, []),
        (WriteArrived(3, put(b"k", "r1"), 10), None, ["Answer(3,PutResponse)"]),  # a replay of the id
    ])
    assert drive.machine.role.upcoming == 4 and drive.store.unverified == 3


def test_writes_queued_together_go_at_once_and_a_full_batch_carries_the_rest() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, [])])
    for ticket in (2, 3):
        run(drive, [(WriteArrived(ticket, put(b"b%d" % ticket), 10), None, [])])
    run(drive, [(WriteArrived(4, put(b"c"), 10), None, ["Answer(4,OverloadedError)"]),  # max_pending 3
                (Tick(), 102, ["Append(2,3)"])])
    for ticket in (5, 6, 7):
        run(drive, [(WriteArrived(ticket, put(b"d%d" % ticket), 10), None, [])])
    run(drive, [(committed(drive, 2, 3), None, ["ApplyCommitted(6)", "Answer(1,PutResponse)",
                                                 "Answer(2,PutResponse)", "Answer(3,PutResponse)"]),
                (CommitApplied(), None, ["Append(6,3)"])])


def test_a_client_that_gives_up_while_queued_is_not_written() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a", "r"), 10), 100, []), (ClientGone(1), None, []),
                (Tick(), 102, []), (ClientGone(99), None, [])])
    assert not drive.machine.batching.in_progress and not drive.machine.batching.queue


def test_an_aborted_batch_learns_the_settled_end_replays_and_leads_on() -> None:
    drive = leading(2)
    run(drive, [
        (WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
        (WriteArrived(2, put(b"b"), 10), None, []),
        (AppendFailed(AppendOutcome.ABORTED, "W2"), None, ["Answer(1,UnavailableError)", "ReadSettledEnd"]),
        (EndRead(EndPurpose.SETTLE, 6), None, ["RewindUnverified"]),
        (Rewound(), None, ["Fetch(2,6)"]),
        (Fetched(2, [(4, entry(b"f", 4))], 6), None, ["ApplyReplayed(6)"]),  # leading again: b lingers
        (Tick(), 104, ["Append(6,1)"]),
    ])
    assert drive.machine.role.upcoming == 6


def test_an_unknown_outcome_fences_again_with_a_new_term() -> None:
    drive = leading(2)
    run(drive, [
        (WriteArrived(1, put(b"a", "r"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
        (AppendFailed(AppendOutcome.UNKNOWN, "timeout"), None,
         ["Note(unknown_outcomes)", "Answer(1,UnknownOutcomeError)", "Fence"]),
        (Fenced(5), None, ["SetTerm(6)", "RewindUnverified"]),
        (Rewound(), None, ["Fetch(2,5)"]),
        (Fetched(2, [(2, entry(b"a", 2, "r"))], 5), None, ["ApplyReplayed(5)"]),
        (WriteArrived(2, put(b"a", "r"), 10), None, ["Answer(2,PutResponse)"]),  # it did commit: a replay
    ])
    state(drive, Role.LEADING)


def test_a_fenced_leader_steps_down_and_takes_the_shard_back_after_a_pause() -> None:
    drive = leading(2)
    run(drive, [
        (WriteArrived(1, put(b"a"), 10), 100, []), (WriteArrived(2, put(b"b"), 10), None, []),
        (Tick(), 102, ["Append(2,2)"]),
        (WriteArrived(3, put(b"c"), 10), None, []),
        (AppendFailed(AppendOutcome.FENCED, "fenced"), 110,
         ["Note(fencings)", "Answer(1,UnavailableError)", "Answer(2,UnavailableError)",
          "Answer(3,UnavailableError)", "CloseWriter", "RewindUnverified"]),
    ])
    assert drive.machine.lead_again_at_ms == 410
    run(drive, [(Rewound(), None, ["ReadEnd(follow)"]), (EndRead(EndPurpose.FOLLOW, 9), None, ["Fetch(2,None)"]),
                (Tick(), 410, []), (Fetched(2, (), 2), None, ["Fence"])])


def test_a_settled_end_that_cannot_be_read_ends_the_leadership() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                (AppendFailed(AppendOutcome.ABORTED, "x"), None, ["Answer(1,UnavailableError)", "ReadSettledEnd"]),
                (EndReadFailed(EndPurpose.SETTLE, "open transaction"), 103, ["CloseWriter", "RewindUnverified"])])
    assert drive.machine.lead_again_at_ms == 403


def test_resigning_with_a_batch_in_flight_answers_it_then_steps_down() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                (WriteArrived(2, put(b"b"), 10), None, []),
                (LeadChanged(False), None, []),
                (WriteArrived(3, put(b"c"), 10), None, ["Answer(3,NotLeaderError)"]),
                (committed(drive, 2, 1), None, ["ApplyCommitted(4)", "Answer(1,PutResponse)"]),
                (CommitApplied(), None, ["Answer(2,UnavailableError)", "CloseWriter", "RewindUnverified"])])
    assert drive.machine.lead_again_at_ms is None


def test_an_abort_while_resigning_steps_down() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                (LeadChanged(False), None, []),
                (AppendFailed(AppendOutcome.ABORTED, "x"), None,
                 ["Answer(1,UnavailableError)", "CloseWriter", "RewindUnverified"])])


def test_settled_end_after_resigning_steps_down() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                (AppendFailed(AppendOutcome.ABORTED, "x"), None, ["Answer(1,UnavailableError)", "ReadSettledEnd"]),
                (LeadChanged(False), None, []),
                (EndRead(EndPurpose.SETTLE, 6), None, ["CloseWriter", "RewindUnverified"])])


def test_a_failed_apply_after_commit_answers_committed_gives_up_and_rebuilds() -> None:
    drive = leading(2)
    run(drive, [
        (WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
        (committed(drive, 2, 1), None, ["ApplyCommitted(4)", "Answer(1,PutResponse)"]),
        (CommitApplied("disk full"), None, ["Note(apply_failures)", "Unable", "CloseWriter", "Note(rebuilds)",
                                            "Wipe"]),
        (LeadChanged(True), None, ["Unable"]),  # offered back at once: refused until rebuilt
        (Wiped(), None, ["RewindUnverified"]),
        (Rewound(), None, ["LoadSnapshot(0)"]),
        (SnapshotDone(False), None, ["ReadEnd(follow)"]),
        (EndRead(EndPurpose.FOLLOW, 4), None, ["Fetch(0,None)"]),
        (Fetched(0, [(0, entry(b"a", 0)), (2, entry(b"a", 2))], 4), None,
         ["ApplyReplayed(4)", "Able", "Fetch(4,None)"]),
    ])
    assert not drive.machine.role.unable and REBUILDING not in drive.machine.role.unable


def test_the_probe_appends_an_empty_entry_once() -> None:
    drive = leading(2)
    run(drive, [(ProbeRequested(), 100, []), (ProbeRequested(), None, []), (Tick(), 102, ["Append(2,1)"]),
                (ProbeRequested(), None, []),  # the first is written: another may be queued
                (AppendFailed(AppendOutcome.FENCED, "fenced"), None, ["Note(fencings)", "CloseWriter",
                                                                       "RewindUnverified"])])
    assert not drive.machine.batching.queue  # the second probe was refused with the leadership


def test_a_probe_on_a_follower_is_nothing() -> None:
    drive = following()
    run(drive, [(ProbeRequested(), None, [])])


# ---- the read barrier ------------------------------------------------------------------------------------

def test_reads_share_a_round_and_a_later_one_waits_for_the_next_query() -> None:
    drive = leading(2)
    run(drive, [
        (ReadArrived(1), 100, ["ReadEnd(barrier)"]),
        (ReadArrived(2), None, []),  # the query is out: the next round
        (EndRead(EndPurpose.BARRIER, 2), None, ["Answer(1,READY)", "ReadEnd(barrier)"]),
        (EndRead(EndPurpose.BARRIER, 2), None, ["Answer(2,READY)"]),
    ])


def test_a_barrier_waits_for_the_batch_in_flight_to_be_applied() -> None:
    drive = leading(2)
    run(drive, [
        (WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
        (ReadArrived(2), None, ["ReadEnd(barrier)"]),
        (EndRead(EndPurpose.BARRIER, 4), None, []),  # its own batch: wait until applied
        (committed(drive, 2, 1), None, ["ApplyCommitted(4)", "Answer(1,PutResponse)"]),
        (CommitApplied(), None, ["Answer(2,READY)"]),  # applied: only now
    ])


def test_a_barrier_waiting_for_a_batch_whose_apply_fails_is_refused() -> None:
    """Issue 22's campaign: a disk full failed the apply of a committed batch; a read told READY
    at commit found the state without it, then the wiped store (acknowledged keys absent)."""
    drive = leading(2)
    run(drive, [
        (WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
        (ReadArrived(2), None, ["ReadEnd(barrier)"]),
        (EndRead(EndPurpose.BARRIER, 4), None, []),
        (committed(drive, 2, 1), None, ["ApplyCommitted(4)", "Answer(1,PutResponse)"]),
        (CommitApplied("IOError: No space left on device"), None,
         ["Note(apply_failures)", "Unable", "Answer(2,UnavailableError)", "CloseWriter", "Note(rebuilds)", "Wipe"]),
    ])


def test_a_high_watermark_beyond_our_writes_refuses_and_probes() -> None:
    drive = leading(2)
    run(drive, [(ReadArrived(1), 100, ["ReadEnd(barrier)"]),
                (EndRead(EndPurpose.BARRIER, 7), None, ["Answer(1,UnavailableError)"])])
    assert drive.machine.batching.probing and len(drive.machine.batching.queue) == 1


def test_a_barrier_that_cannot_read_the_end_or_waits_too_long_refuses() -> None:
    drive = leading(2)
    run(drive, [
        (ReadArrived(1), 100, ["ReadEnd(barrier)"]),
        (EndReadFailed(EndPurpose.BARRIER, "timed out"), None, ["Answer(1,UnavailableError)"]),
        (WriteArrived(2, put(b"a"), 10), 200, []), (Tick(), 202, ["Append(2,1)"]),
        (ReadArrived(3), None, ["ReadEnd(barrier)"]),
        (EndRead(EndPurpose.BARRIER, 4), 210, []),
        (Tick(), 709, []),
        (Tick(), 710, ["Answer(3,UnavailableError)"]),  # barrier_timeout_ms 500
        (ClientGone(3), None, []),
    ])


def test_a_read_on_a_follower_is_refused_and_one_during_a_step_down_too() -> None:
    drive = following()
    run(drive, [(ReadArrived(1, "n2:1"), None, ["Answer(1,NotLeaderError)"])])
    drive = leading(2)
    run(drive, [(ReadArrived(1), 100, ["ReadEnd(barrier)"]), (ReadArrived(2), None, []),
                (LeadChanged(False), None, ["Answer(2,UnavailableError)", "Answer(1,UnavailableError)", "CloseWriter",
                                            "RewindUnverified"]),
                (EndRead(EndPurpose.BARRIER, 2), None, [])])  # the round's reads were refused already


def test_a_read_only_txn_is_answered_through_the_barrier() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, txn_get(b"k"), 10), 100, []), (Tick(), 102, ["ReadEnd(barrier)"]),
                (EndRead(EndPurpose.BARRIER, 2), None, ["Answer(1,TxnResponse)"])])


def test_a_barrier_of_a_resigning_leader_is_served_by_its_last_batch_or_refused() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                (ReadArrived(2), None, ["ReadEnd(barrier)"]), (LeadChanged(False), None, []),
                (EndRead(EndPurpose.BARRIER, 4), None, []),  # still leading until the batch is done
                (committed(drive, 2, 1), None, ["ApplyCommitted(4)", "Answer(1,PutResponse)"]),
                (CommitApplied(), None, ["Answer(2,READY)", "CloseWriter", "RewindUnverified"])])
    drive = leading(2)
    run(drive, [(ReadArrived(1), 100, ["ReadEnd(barrier)"]),  # a query out holds nothing: stop at once
                (StopRequested(), None, ["Answer(1,UnavailableError)", "CloseWriter", "Exit"])])


# ---- stopping --------------------------------------------------------------------------------------------

def test_stopping_a_leader_refuses_the_queue_closes_the_writer_and_exits() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []),
                (StopRequested(), None, ["Answer(1,UnavailableError)", "CloseWriter", "Exit"])])
    assert drive.machine.exited and drive.machine.role.role is Role.STOPPED
    with pytest.raises(AssertionError):
        drive.step(Tick())


def test_stopping_waits_for_the_batch_in_flight_and_the_reader() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                (StopRequested(), None, []),
                (AppendFailed(AppendOutcome.CANCELLED, "node stopping"), None,
                 ["Note(unknown_outcomes)", "Answer(1,UnknownOutcomeError)", "CloseWriter", "Exit"])])
    drive = following()
    run(drive, [(StopRequested(), None, []), (Fetched(0, (), 0), None, ["Exit"])])


def test_a_stop_overdue_takes_each_call_out_as_failed_and_exits() -> None:
    """The node's bound on a stop passed (`StopOverdue`): the machine, not the driver, knows
    what is out and what its failure means (it was `ShardReplica._cut_short`)."""
    appending = leading(2)
    run(appending, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                    (StopRequested(), None, []),
                    (StopOverdue(), None, ["Note(unknown_outcomes)", "Answer(1,UnknownOutcomeError)", "CloseWriter",
                                           "Exit"])])
    fencing = following()
    run(fencing, [(LeadChanged(True), None, []), (Fetched(0, (), 0), 0, ["Fence"]), (StopRequested(), None, []),
                  (StopOverdue(), None, ["CloseWriter", "Exit"])])
    settling = leading(2)
    run(settling, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                   (AppendFailed(AppendOutcome.ABORTED, "x"), None, ["Answer(1,UnavailableError)", "ReadSettledEnd"]),
                   (StopRequested(), None, []), (StopOverdue(), None, ["CloseWriter", "Exit"])])
    for drive in (following(), reading_the_end_at(2)):  # a fetch, an end out
        run(drive, [(StopRequested(), None, []), (StopOverdue(), None, ["Exit"])])
    loading = Drive()
    run(loading, [(Started(), 0, ["RewindUnverified"]), (Rewound(), None, ["LoadSnapshot(0)"]),
                  (StopRequested(), None, []), (StopOverdue(), None, ["Exit"])])
    assert loading.machine.exited


def test_a_stop_overdue_leaves_the_drivers_own_work_and_needs_a_stop() -> None:
    rewinding = Drive()
    run(rewinding, [(Started(), 0, ["RewindUnverified"]), (StopRequested(), None, []), (StopOverdue(), None, [])])
    assert not rewinding.machine.exited  # a rewind is the driver's synchronous work: its answer comes
    run(rewinding, [(Rewound(), None, ["Exit"])])
    with pytest.raises(AssertionError):
        following().step(StopOverdue())


def test_the_reader_moves_only_as_its_table_allows() -> None:
    drive = following()
    with pytest.raises(AssertionError):
        drive.machine.catch_up.reader.enter(ReaderState.CATCH_UP_FETCHING)
    assert all(ReaderState.IDLE in moves for moves in reader_moves.values())  # any reading may end


def test_perform_all_answers_local_work_after_the_list() -> None:
    class Failing(Drive):
        def perform_apply_replayed(self, action: core.ApplyReplayed) -> str | None:
            return "disk full"

        def perform_apply_committed(self, action: core.ApplyCommitted) -> str | None:
            return "disk full"

        def perform_load_snapshot(self, action: core.LoadSnapshot) -> core.SnapshotDone | None:
            return core.SnapshotDone(False)

    results = perform_all(Failing(), [core.ApplyCommitted((), 2, 1), core.AnswerRequest(1, READY),
                                      core.ApplyReplayed((), 3), core.LoadSnapshot(0, "empty"),
                                      core.RewindUnverified(), core.Wipe("x")])
    assert results == [core.ReplayApplyFailed("disk full"), core.SnapshotDone(False), core.Rewound(), core.Wiped(),
                       core.CommitApplied("disk full")]


# ---- mutations (the simulation's teeth) ------------------------------------------------------------------

def test_each_mutation_breaks_its_rule() -> None:
    def with_(mutation: Mutation) -> Drive:
        return leading(0, dataclasses.replace(CONFIG, mutations=frozenset({mutation})))

    barrier = with_(Mutation.SKIP_READ_BARRIER)
    run(barrier, [(ReadArrived(1), None, ["Answer(1,READY)"]),
                  (WriteArrived(2, txn_get(b"k"), 10), 100, []), (Tick(), 102, ["Answer(2,TxnResponse)"])])
    rewind = Drive(dataclasses.replace(CONFIG, mutations=frozenset({Mutation.SKIP_MARKER_REWIND})))
    run(rewind, [(Started(), 0, ["LoadSnapshot(0)"])])  # straight past the rewind
    dedupe = with_(Mutation.SKIP_REQUEST_DEDUPE)
    run(dedupe, [(WriteArrived(1, put(b"a", "r"), 10), 100, []), (Tick(), 102, ["Append(0,1)"]),
                 (committed(dedupe, 0, 1), None, ["ApplyCommitted(2)", "Answer(1,PutResponse)"]),
                 (CommitApplied(), None, []),
                 (WriteArrived(2, put(b"a", "r"), 10), 200, []), (Tick(), 202, ["Append(2,1)"])])  # written again
    early = with_(Mutation.ANSWER_BEFORE_COMMIT)
    run(early, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Answer(1,PutResponse)", "Append(0,1)"]),
                (AppendFailed(AppendOutcome.ABORTED, "x"), None, ["ReadSettledEnd"])])


# ---- invariants of the interface -------------------------------------------------------------------------

def test_every_event_has_a_handler_and_every_metric_a_name() -> None:
    assert set(_HANDLERS) == set(core.Event.__args__)  # type: ignore[attr-defined]
    with pytest.raises(AssertionError):
        core.Note("x", metric="no_such_metric")


def test_results_nobody_asked_for_are_bugs() -> None:
    drive = following()
    with pytest.raises(AssertionError):
        drive.step(Fenced(3))  # no fence out
    drive = following()
    with pytest.raises(AssertionError):
        drive.step(Wiped())  # no wipe out
    drive = Drive()
    run(drive, [(Started(), 0, ["RewindUnverified"])])
    with pytest.raises(AssertionError):
        drive.step(Started())


def test_a_broken_replica_is_refused_leadership_with_its_reason() -> None:
    drive = following()
    drive.machine.role.mark_unable(BROKEN, "disk full")
    run(drive, [(LeadChanged(True), None, ["Unable"])])
    assert errors.UnavailableError  # the module's errors are the ones answered


# ---- corners: stale results, the ones that count, and what a driver reads ----------------------------

def test_results_of_a_reading_given_up_are_dropped() -> None:
    drive = following(2, [(0, entry(b"a", 0))])
    run(drive, [(FetchFailed("x"), 0, [])])  # the reading ends; a retry is due at 100
    for stale in (EndRead(EndPurpose.FOLLOW, 5), EndReadFailed(EndPurpose.FOLLOW, "late")):
        drive.machine.catch_up.reader.out = core.ReadEnd(EndPurpose.FOLLOW)  # as if it had been out
        run(drive, [(stale, None, [])])
    for stale_fetch in (FetchOutOfRange(2, True, 10, 20), FetchFailed("late")):
        drive.machine.catch_up.reader.out = core.Fetch(2, None)
        run(drive, [(stale_fetch, None, [])])
    drive.machine.catch_up.reader.out = core.LoadSnapshot(0, "")
    run(drive, [(SnapshotDone(True), None, [])])
    drive.machine.catch_up.reader.out = core.Wipe("")
    drive.store.wipe()
    run(drive, [(Wiped(), None, [])])
    drive.machine.catch_up.reader.out = core.RewindUnverified()
    run(drive, [(Rewound(), None, [])])
    assert drive.machine.reader is ReaderState.IDLE and drive.machine.catch_up.retry_at_ms == 100


def test_records_applied_after_the_reading_was_given_up_stay_applied() -> None:
    drive = following(2, [(0, entry(b"a", 0))])
    drive.auto_apply = False
    run(drive, [(Fetched(2, [(2, entry(b"b", 2))], 3), 0, ["ApplyReplayed(3)"]), (StopRequested(), 0, [])])
    drive.store.apply([(2, entry(b"b", 2))], 3)
    run(drive, [(Replayed(), 0, ["Exit"])])


def test_what_a_driver_reads_holding_pending_and_wake_times() -> None:
    drive = leading(2)
    m = drive.machine
    assert m.holding and m.pending_writes == 0 and m.wake_at_ms() is None
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []), (WriteArrived(2, put(b"b"), 10), 100, [])])
    assert m.pending_writes == 2 and m.wake_at_ms() == 102
    run(drive, [(ClientGone(2), None, []), (Tick(), 102, ["Append(2,1)"]), (ReadArrived(3), None, ["ReadEnd(barrier)"]),
                (EndRead(EndPurpose.BARRIER, 4), 103, [])])
    assert m.wake_at_ms() == 603  # the read's barrier timeout
    follower = following()
    assert not follower.machine.holding and follower.machine.wake_at_ms() is None


def test_a_tick_before_the_next_re_read_of_a_stale_end_waits() -> None:
    drive = reading_the_end_at(10)
    run(drive, [
                (EndRead(EndPurpose.FOLLOW, 5), None, []), (Tick(), 200, [])])
    assert drive.machine.wake_at_ms() == 500


def test_a_catch_up_beyond_a_confirmed_end_wipes_and_replays_everything() -> None:
    drive = reading_the_end_at(10)
    run(drive, [
                (EndRead(EndPurpose.FOLLOW, 10), None, ["Fetch(10,None)"]), (LeadChanged(True), None, []),
                (Fetched(10, (), 10), None, ["Fence"]),
                (Fenced(3), 0, ["Note(leader_changes)", "SetTerm(4)", "RewindUnverified"]),  # the WAL was recreated
                (Rewound(), None, []),
                (Tick(), 2_000, ["Note(rebuilds)", "Wipe"]),
                (Wiped(), None, ["Fetch(0,3)"]),
                (Fetched(0, [(0, entry(b"n", 0))], 3), None, ["ApplyReplayed(3)"])])
    state(drive, Role.LEADING)


def test_a_rebuild_with_another_reason_left_stays_unable() -> None:
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                (committed(drive, 2, 1), None, ["ApplyCommitted(4)", "Answer(1,PutResponse)"])])
    drive.machine.role.mark_unable(NEEDS_SNAPSHOT, "also truncated")
    run(drive, [(CommitApplied("disk full"), None, ["Note(apply_failures)", "Unable", "CloseWriter",
                                                     "Note(rebuilds)", "Wipe"]),
                (Wiped(), None, ["RewindUnverified"]), (Rewound(), None, ["LoadSnapshot(0)"]),
                (SnapshotDone(False), None, ["ReadEnd(follow)"]),
                (EndRead(EndPurpose.FOLLOW, 0), None, ["Fetch(0,None)"])])  # caught up, still unable: no Able
    assert NEEDS_SNAPSHOT in drive.machine.role.unable and REBUILDING not in drive.machine.role.unable


def test_a_second_snapshot_miss_is_not_told_twice() -> None:
    drive = following(2, [(0, entry(b"a", 0))])
    run(drive, [(FetchOutOfRange(2, True, 100, 150), 0, ["LoadSnapshot(100)"]), (SnapshotDone(False), 0, ["Unable"]),
                (Tick(), 100, ["RewindUnverified"]), (Rewound(), None, ["ReadEnd(follow)"]),
                (EndRead(EndPurpose.FOLLOW, 150), None, ["Fetch(2,None)"]),
                (FetchOutOfRange(2, True, 100, 150), None, ["LoadSnapshot(100)"]),
                (SnapshotDone(False), None, [])])


def test_planning_refuses_an_oversized_record_and_carries_what_does_not_fit() -> None:
    small = dataclasses.replace(CONFIG, batch_limits=BatchLimits(4, 300, 200))
    drive = leading(2, small)
    big = core.ClientRequest(kv_pb2.PutRequest(key=b"big", value=b"x" * 500), 0)
    run(drive, [(WriteArrived(1, big, 10), 100, []), (Tick(), 102, ["Answer(1,InvalidRequestError)"])])
    mid = [core.ClientRequest(kv_pb2.PutRequest(key=b"m%d" % i, value=b"x" * 120), 0) for i in range(3)]
    run(drive, [(WriteArrived(2 + i, w, 10), 200, []) for i, w in enumerate(mid)])
    run(drive, [(Tick(), 202, ["Append(2,2)"]),
                (committed(drive, 2, 2), None, ["ApplyCommitted(5)", "Answer(2,PutResponse)", "Answer(3,PutResponse)"]),
                (CommitApplied(), None, ["Append(5,1)"])])  # the carried one goes first, at once


def test_the_request_horizon_comes_from_the_config() -> None:
    narrow = dataclasses.replace(CONFIG, request_horizon_ms=1_000, clock_skew_ms=10)
    drive = leading(2, narrow)
    old = core.ClientRequest(kv_pb2.PutRequest(key=b"k", value=b"v", request_id="r",
                                               first_attempt_unix_ms=UNIX_MS - 60_000), 0)
    drive.store.evicted_through_ms = UNIX_MS  # ids older than this may be forgotten
    run(drive, [(WriteArrived(1, old, 10), 100, ["Answer(1,RequestExpiredError)"])])


def test_events_before_started_change_intent_only() -> None:
    drive = Drive()
    run(drive, [(LeadChanged(True), 0, []), (Started(), 0, ["Fence"]),
                (Fenced(0), 10, ["Note(leader_changes)", "SetTerm(1)", "RewindUnverified"])])
    assert not drive.machine.caught_up
    run(drive, [(Rewound(), None, [])])
    assert drive.machine.caught_up  # a leader caught up to its end (a node's readiness)


def test_answer_before_commit_leaves_an_applied_batch_unanswered_after() -> None:
    early = leading(0, dataclasses.replace(CONFIG, mutations=frozenset({Mutation.ANSWER_BEFORE_COMMIT})))
    run(early, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Answer(1,PutResponse)", "Append(0,1)"]),
                (committed(early, 0, 1), None, ["ApplyCommitted(2)"])])


def test_an_abort_that_retired_the_producer_fences_again_with_a_new_term() -> None:
    """Sim seed 15: a produce timed out during a broker outage and the abort failed too, so the
    writer retired its producer; reading the settled end would have left the fence to the next
    append, which would fence a newer leader with records stamped with the old term."""
    drive = leading(2)
    run(drive, [(WriteArrived(1, put(b"a"), 10), 100, []), (Tick(), 102, ["Append(2,1)"]),
                (AppendFailed(AppendOutcome.ABORTED_RETIRED, "flush timed out"), None,
                 ["Answer(1,UnavailableError)", "Fence"]),
                (Fenced(20), None, ["SetTerm(21)", "RewindUnverified"])])


# ---- writes meeting a prepared cross-shard transaction's lock (docs/design.md §10) -----------------------


def _lock(drive: Drive, key: bytes, txn_id: str = "t") -> None:
    from kvstore.core.state import PreparedTxn
    from kvstore.internal.v1 import wal_entry_pb2

    drive.store.locks.add(PreparedTxn(wal_entry_pb2.TxnPrepare(txn_id=txn_id, exclusive_keys=[key]), 0, 0))


def test_a_write_on_a_locked_key_waits_for_the_next_apply_then_goes() -> None:
    drive = leading()
    _lock(drive, b"k")
    run(drive, [(WriteArrived(1, put(b"k"), 10), 0, []),
                (Tick(), 2, [])])  # planned after the linger: parked on the lock, unanswered
    assert len(drive.machine.batching.parked) == 1 and drive.machine.pending_writes == 1
    assert drive.machine.wake_at_ms() == 2 + CONFIG.lock_wait_ms
    drive.store.locks.remove("t")  # the resolve, as an apply releases it...
    run(drive, [(WriteArrived(2, put(b"other"), 10), 3, []),
                (Tick(), 5, ["Append(2,1)"]),
                (committed(drive, 2, 1), None, ["ApplyCommitted(4)", "Answer(2,PutResponse)"]),
                (CommitApplied(), 6, []),  # ...and the parked write is queued again, first...
                (Tick(), 8, ["Append(4,1)"])])  # ...going after the linger as a lone write does
    assert not drive.machine.batching.parked


def test_a_write_locked_past_its_wait_is_refused_definitely() -> None:
    drive = leading()
    _lock(drive, b"k")
    run(drive, [(WriteArrived(1, put(b"k", "r-1"), 10), 0, []),
                (Tick(), 2, []),
                (Tick(), 2 + CONFIG.lock_wait_ms, ["Answer(1,TxnConflictError)"])])
    assert not drive.machine.batching.parked and "r-1" not in drive.machine.batching.in_progress
    # Gone while parked: forgotten; and leadership lost: refused with everything queued.
    run(drive, [(WriteArrived(2, put(b"k"), 10), 600, []), (Tick(), 610, []), (ClientGone(2), None, [])])
    assert not drive.machine.batching.parked
    run(drive, [(WriteArrived(3, put(b"k"), 10), 700, []), (Tick(), 710, [])])
    actions = [shown(a) for a in drive.step(LeadChanged(False))]
    assert "Answer(3,UnavailableError)" in actions and not drive.machine.batching.parked


def _resolve(txn_id: str = "t") -> core.WriteRequest:
    from kvstore.core.replica.writes import ResolveTxn
    from kvstore.internal.v1 import wal_entry_pb2

    return ResolveTxn(wal_entry_pb2.TxnResolve(txn_id=txn_id, commit=False, coordinator=1))


def test_a_lone_resolve_lingers_longer_for_company() -> None:
    """Nobody's answer waits on a resolve: it waits `patient_linger_ms`, not `linger_ms`, so the
    next transaction's prepare shares its Kafka transaction instead of queueing behind it."""
    drive = leading()
    _lock(drive, b"k")
    assert CONFIG.patient_linger_ms > CONFIG.linger_ms
    run(drive, [(WriteArrived(1, _resolve(), 10), 100, []),
                (Tick(), 100 + CONFIG.linger_ms, []),
                (Tick(), 100 + CONFIG.patient_linger_ms, ["Append(2,1)"])])


def test_a_client_write_ends_a_resolves_wait_at_once() -> None:
    drive = leading()
    _lock(drive, b"k")
    run(drive, [(WriteArrived(1, _resolve(), 10), 100, []),
                (WriteArrived(2, put(b"other"), 10), 101, ["Append(2,2)"]),  # company found: both go now
                (committed(drive, 2, 2), None, ["ApplyCommitted(5)", "Answer(1,TxnResolve)", "Answer(2,PutResponse)"])])
    assert not drive.store.locks.has_locks()


def test_a_resolve_that_a_parked_write_or_a_read_may_wait_on_lingers_as_any_write() -> None:
    parked = leading()
    _lock(parked, b"k")
    run(parked, [(WriteArrived(1, put(b"k"), 10), 0, []),
                 (Tick(), 2, [])])  # parked on the lock
    assert parked.machine.batching.parked
    run(parked, [(WriteArrived(2, _resolve(), 10), 10, []),
                 (Tick(), 10 + CONFIG.linger_ms, ["Append(2,1)"])])
    # A linearizable read arriving while a resolve lingers may be about to wait on its lock: the
    # batch starts at once, in the step the read's barrier round goes out.
    drive = leading()
    _lock(drive, b"k")
    run(drive, [(WriteArrived(1, _resolve(), 10), 100, []),
                (ReadArrived(2, "", (b"k",)), 101, ["Append(2,1)", "ReadEnd(barrier)"])])


def test_resolves_queued_together_go_at_once_and_a_forget_is_patient_too() -> None:
    from kvstore.core.txn import forget_write

    drive = leading()
    _lock(drive, b"k", "t1")
    _lock(drive, b"j", "t2")
    run(drive, [(WriteArrived(1, _resolve("t1"), 10), 100, []),
                (WriteArrived(2, _resolve("t2"), 10), 101, ["Append(2,2)"])])  # company: no more waiting
    assert forget_write(["t1"], drive.store).patient


def test_a_parked_write_planned_again_past_its_wait_is_refused() -> None:
    drive = leading()
    _lock(drive, b"k")
    run(drive, [(WriteArrived(1, put(b"k"), 10), 0, []), (Tick(), 2, []),
                (WriteArrived(2, put(b"other"), 10), 3, []), (Tick(), 5, ["Append(2,1)"]),
                (committed(drive, 2, 1), 600, ["ApplyCommitted(4)", "Answer(2,PutResponse)"]),
                (CommitApplied(), 600, []),
                (Tick(), 602, ["Answer(1,TxnConflictError)"])])  # still locked, and its wait is over


def test_without_a_lock_wait_a_locked_write_is_refused_at_once() -> None:
    drive = leading(config=dataclasses.replace(CONFIG, lock_wait_ms=0))
    _lock(drive, b"k")
    run(drive, [(WriteArrived(1, put(b"k"), 10), 0, []), (Tick(), 2, ["Answer(1,TxnConflictError)"])])


# ---- reads of keys a prepared cross-shard transaction locked (T4) -----------------------------------------


def test_a_read_of_a_locked_key_waits_for_the_apply_that_releases_it() -> None:
    drive = leading(2)
    _lock(drive, b"k")
    run(drive, [(ReadArrived(1, "", (b"k",)), 100, ["ReadEnd(barrier)"]),
                (ReadArrived(2, "", (b"free",)), None, []),
                (EndRead(EndPurpose.BARRIER, 2), None, ["ReadEnd(barrier)"]),  # 1 passed: now the lock
                (EndRead(EndPurpose.BARRIER, 2), None, ["Answer(2,READY)"])])
    assert len(drive.machine.barrier.locked_reads) == 1
    assert drive.machine.wake_at_ms() == 100 + CONFIG.read_kick_ms
    run(drive, [(WriteArrived(3, put(b"x"), 10), 110, []), (Tick(), 112, ["Append(2,1)"]),
                (committed(drive, 2, 1), None, ["ApplyCommitted(4)", "Answer(3,PutResponse)"]),  # still locked
                (CommitApplied(), None, [])])
    drive.store.locks.remove("t")  # the resolve, applied with the next batch
    run(drive, [(WriteArrived(4, put(b"y"), 10), 120, []), (Tick(), 122, ["Append(4,1)"]),
                (committed(drive, 4, 1), None, ["ApplyCommitted(6)", "Answer(4,PutResponse)"]),
                (CommitApplied(), None, ["Answer(1,READY)"])])


def test_a_read_locked_too_long_asks_for_a_resolve_then_gives_up() -> None:
    drive = leading(2)
    _lock(drive, b"k", "stuck")
    run(drive, [(ReadArrived(1, "", (b"k",)), 100, ["ReadEnd(barrier)"]),
                (EndRead(EndPurpose.BARRIER, 2), None, []),
                (Tick(), 100 + CONFIG.read_kick_ms, ["ResolveNow"]),
                (Tick(), 100 + CONFIG.read_lock_wait_ms - 1, []),
                (Tick(), 100 + CONFIG.read_lock_wait_ms, ["Answer(1,UnavailableError)"])])
    assert not drive.machine.barrier.locked_reads and drive.machine.wake_at_ms() is None


def test_a_scan_waits_on_a_lock_in_its_range_only() -> None:
    drive = leading(2)
    _lock(drive, b"m")
    run(drive, [(ReadArrived(1, "", (), (b"a", b"c")), 100, ["ReadEnd(barrier)"]),
                (EndRead(EndPurpose.BARRIER, 2), None, ["Answer(1,READY)"]),
                (ReadArrived(2, "", (), (b"k", None)), 101, ["ReadEnd(barrier)"]),
                (EndRead(EndPurpose.BARRIER, 2), None, [])])
    run(drive, [(ClientGone(2), None, [])])
    assert not drive.machine.barrier.locked_reads
    run(drive, [(ReadArrived(3, "", (b"m",)), 200, ["ReadEnd(barrier)"]),
                (EndRead(EndPurpose.BARRIER, 2), None, [])])
    actions = [shown(a) for a in drive.step(LeadChanged(False))]
    assert "Answer(3,UnavailableError)" in actions and not drive.machine.barrier.locked_reads


def test_the_mutation_serves_a_locked_key_at_once() -> None:
    drive = leading(2, config=dataclasses.replace(CONFIG, mutations=frozenset({Mutation.SKIP_READ_LOCK_WAIT})))
    _lock(drive, b"k")
    run(drive, [(ReadArrived(1, "", (b"k",)), 100, ["ReadEnd(barrier)"]),
                (EndRead(EndPurpose.BARRIER, 2), None, ["Answer(1,READY)"])])
