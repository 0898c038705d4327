"""The driver contract: one table of action performers, shared by every driver of the machine.

Why: the node (`kvstore.server.replica.ShardReplica`), the simulation (`tests.sim.replica.Replica`),
the unit tests' `Drive` and the trace replayer (`kvstore.core.replica.trace`) all drive the one
machine. Each fills this table with its own I/O (a `Performers`), and performs a list of
actions with `perform_all`, so that the rules of performing are written once, here:

* every action type has exactly one performer (`PERFORMER_OF`, checked against `Action` at
  import, and each name against `Performers`);
* actions are performed in the order the machine returned them;
* the results of a driver's local, synchronous work (a rewind, a wipe, an apply, a snapshot it
  loads at once) are returned as events, to be stepped after the whole list, never inside it:
  no event is stepped inside another's actions;
* `CommitApplied` comes after everything in the list with `ApplyCommitted` (the batch's answers
  among them): the machine's bookkeeping of a commit, and its paired W1/W2 assertions, run only
  once every client of the batch has its committed answer, and an apply that failed is reported
  (its error in the event), never raised (W5, docs/design.md §5.1).

Everything else a performer does (a call to Kafka in a thread, a message to the simulated
broker) reports its result later, as an event, through the driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstore.core.replica.actions import (
    Able,
    Action,
    AnswerRequest,
    Append,
    ApplyCommitted,
    ApplyReplayed,
    CloseWriter,
    Exit,
    Fence,
    Fetch,
    LoadSnapshot,
    Note,
    ReadEnd,
    ReadSettledEnd,
    ResolveNow,
    RewindUnverified,
    SetTerm,
    Unable,
    Wipe,
)
from kvstore.core.replica.events import CommitApplied, Event, ReplayApplyFailed, Replayed, Rewound, SnapshotDone, Wiped


class Performers(Protocol):
    """What a driver does for each action. Those returning a value are local and synchronous:
    `perform_all` turns the value into the answering event."""

    def perform_fence(self, action: Fence) -> None: ...

    def perform_set_term(self, action: SetTerm) -> None: ...

    def perform_append(self, action: Append) -> None: ...

    def perform_read_end(self, action: ReadEnd) -> None: ...

    def perform_read_settled_end(self, action: ReadSettledEnd) -> None: ...

    def perform_fetch(self, action: Fetch) -> None: ...

    def perform_apply_replayed(self, action: ApplyReplayed) -> str | None:
        """Apply the records with their checkpoint; the reason it failed (nothing applied), or None."""
        ...

    def perform_apply_committed(self, action: ApplyCommitted) -> str | None:
        """Apply the committed batch (W5); the reason it failed, or None. Never raises: the
        batch is committed either way, and its answers follow."""
        ...

    def perform_answer(self, action: AnswerRequest) -> None: ...

    def perform_rewind(self, action: RewindUnverified) -> None: ...

    def perform_wipe(self, action: Wipe) -> None: ...

    def perform_load_snapshot(self, action: LoadSnapshot) -> SnapshotDone | None:
        """Done at once (the answer), or None: reported later."""
        ...

    def perform_close_writer(self, action: CloseWriter) -> None: ...

    def perform_unable(self, action: Unable) -> None: ...

    def perform_able(self, action: Able) -> None: ...

    def perform_note(self, action: Note) -> None: ...

    def perform_resolve_now(self, action: ResolveNow) -> None: ...

    def perform_exit(self, action: Exit) -> None: ...


PERFORMER_OF: dict[type, str] = {
    Fence: "perform_fence",
    SetTerm: "perform_set_term",
    Append: "perform_append",
    ReadEnd: "perform_read_end",
    ReadSettledEnd: "perform_read_settled_end",
    Fetch: "perform_fetch",
    ApplyReplayed: "perform_apply_replayed",
    ApplyCommitted: "perform_apply_committed",
    AnswerRequest: "perform_answer",
    RewindUnverified: "perform_rewind",
    Wipe: "perform_wipe",
    LoadSnapshot: "perform_load_snapshot",
    CloseWriter: "perform_close_writer",
    Unable: "perform_unable",
    Able: "perform_able",
    Note: "perform_note",
    ResolveNow: "perform_resolve_now",
    Exit: "perform_exit",
}
assert set(PERFORMER_OF) == set(Action.__args__), "every action needs exactly one performer"
assert sorted(PERFORMER_OF.values()) == sorted(
    name for name in vars(Performers) if name.startswith("perform_")), "the table and the protocol disagree"


def perform_all(performers: Performers, actions: Sequence[Action]) -> list[Event]:
    """Perform `actions` in order; return the results of local work, to be stepped (in this
    order) after the whole list."""
    results: list[Event] = []
    committed: CommitApplied | None = None
    for action in actions:
        result = getattr(performers, PERFORMER_OF[type(action)])(action)
        if isinstance(action, ApplyCommitted):
            assert committed is None, "two committed batches in one list"
            committed = CommitApplied(result)
        elif isinstance(action, ApplyReplayed):
            results.append(Replayed() if result is None else ReplayApplyFailed(result))
        elif isinstance(action, RewindUnverified):
            results.append(Rewound())
        elif isinstance(action, Wipe):
            results.append(Wiped())
        elif result is not None:
            assert isinstance(action, LoadSnapshot) and isinstance(result, SnapshotDone), (action, result)
            results.append(result)
    if committed is not None:
        results.append(committed)
    return results
