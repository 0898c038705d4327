"""The replica's reader: where it stands, in one enum, every move checked against `_VALID`.

Why: a reading (a standby following the shard, a takeover catching up to the end it fenced at,
a rebuild's wipe) first makes the checkpoint trustworthy, then fetches (docs/design.md §5.1,
the reader's diagram). What it reads for and how far along it is are one state here, as
`kvstore.core.role.Role` is for the leadership: an impossible move is a bug that fails loudly,
never a combination of flags nobody drew.

Beside the state, at most one reader action is out (`Reader.out`, the action itself), and only
the event answering it clears it (`Reader.done`, paired with `Reader.send`). A reading that
ends leaves its action out: the answer clears it and changes nothing else (stale results are
dropped by the state they find, `kvstore.core.replica.catchup`).
"""

from __future__ import annotations

import enum

from kvstore.core.replica.actions import ApplyReplayed, Fetch, LoadSnapshot, ReadEnd, RewindUnverified, Wipe

ReaderAction = RewindUnverified | LoadSnapshot | ReadEnd | Wipe | Fetch | ApplyReplayed

FOLLOW, CATCH_UP, REBUILD = "follow", "catch_up", "rebuild"


class ReaderState(enum.Enum):
    """(what it reads for, how far along). IDLE: no reading (leading, fencing, idle without
    standby, waiting to retry)."""

    IDLE = ("", "")
    FOLLOW_REWINDING = (FOLLOW, "rewinding")  # over an assumed marker slot
    FOLLOW_LOADING = (FOLLOW, "loading")  # a snapshot into an empty replica, or below a truncated start
    FOLLOW_READING_END = (FOLLOW, "reading_end")  # the end a follower catches up to
    FOLLOW_CONFIRMING = (FOLLOW, "confirming")  # the checkpoint lies beyond the end: re-reading it a while
    FOLLOW_WIPING = (FOLLOW, "wiping")  # beyond the end for good: the WAL was recreated
    FOLLOW_FETCHING = (FOLLOW, "fetching")  # tailing the shard as a standby
    CATCH_UP_REWINDING = (CATCH_UP, "rewinding")
    CATCH_UP_LOADING = (CATCH_UP, "loading")
    CATCH_UP_CONFIRMING = (CATCH_UP, "confirming")
    CATCH_UP_WIPING = (CATCH_UP, "wiping")
    CATCH_UP_FETCHING = (CATCH_UP, "fetching")  # replaying to the end this leadership fenced (or settled) at
    REBUILD_WIPING = (REBUILD, "wiping")  # a committed batch could not be applied: empty, then follow

    @property
    def purpose(self) -> str:
        return self.value[0]

    @property
    def stage(self) -> str:
        return self.value[1]

    def at(self, stage: str) -> ReaderState:
        """The same reading at `stage`."""
        return ReaderState((self.purpose, stage))


def _reading(purpose: str) -> dict[ReaderState, frozenset[ReaderState]]:
    def s(stage: str) -> ReaderState:
        return ReaderState((purpose, stage))

    ends = {s("reading_end")} if purpose == FOLLOW else set()  # a catch-up knows its end already
    idle = ReaderState.IDLE
    table = {
        s("rewinding"): frozenset({s("loading"), *ends, s("confirming"), s("fetching"), idle}),
        s("loading"): frozenset({*ends, s("confirming"), s("fetching"), idle}),
        s("confirming"): frozenset({s("fetching"), s("wiping"), idle}),
        s("wiping"): frozenset({s("fetching"), idle}),
        s("fetching"): frozenset({s("fetching"), s("loading"), s("confirming"), idle}),
    }
    if purpose == FOLLOW:
        table[s("reading_end")] = frozenset({s("confirming"), s("fetching"), idle})
    return table


_VALID: dict[ReaderState, frozenset[ReaderState]] = {
    ReaderState.IDLE: frozenset({ReaderState.IDLE, ReaderState.FOLLOW_REWINDING, ReaderState.CATCH_UP_REWINDING,
                                 ReaderState.REBUILD_WIPING}),
    **_reading(FOLLOW),
    **_reading(CATCH_UP),
    ReaderState.REBUILD_WIPING: frozenset({ReaderState.IDLE}),
}
assert set(_VALID) == set(ReaderState), "every reader state needs its moves"


class Reader:
    """The reader's state and the one action of it that is out."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.state = ReaderState.IDLE
        self.out: ReaderAction | None = None

    def enter(self, state: ReaderState) -> None:
        assert state in _VALID[self.state], f"shard {self.shard}: no reader move {self.state.name} -> {state.name}"
        self.state = state

    def send(self, action: ReaderAction, to: ReaderState | None = None) -> ReaderAction:
        """`action` goes out (at most one at a time), in `to` if the reading moves with it."""
        assert self.out is None, f"{type(action).__name__} while {type(self.out).__name__} is out"
        if to is not None:
            self.enter(to)
        self.out = action
        return action

    def done(self, kind: type[ReaderAction]) -> None:
        """The event answering the action out arrived (paired with `send`)."""
        assert isinstance(self.out, kind), f"{kind.__name__} reported while {type(self.out).__name__} was out"
        self.out = None
