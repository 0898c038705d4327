"""What happens to a replica, as the machine is told: plain, frozen, printable data.

Why: an event is the only way anything reaches the machine (docs/design.md §5.1), so a list of
them, with the times they came at, is a complete account of a run. Nothing here holds a
closure or a live object: a trace of events can be printed, parsed back and stepped through a
fresh machine (`kvstore.core.replica.trace`). Every event that answers an action names it in
its docstring; `machine._HANDLERS` has one handler per event (checked at import).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from kvstore.core.replica.writes import WriteRequest
from kvstore.core.role import AppendOutcome


class EndPurpose(enum.Enum):
    """Why an end is read: its answer goes to the part of the machine that asked."""

    FOLLOW = "follow"  # the end a follower catches up to (then `caught_up`)
    CONFIRM = "confirm"  # re-reading while a checkpoint lies beyond the end
    BARRIER = "barrier"  # a read barrier's high watermark
    SETTLE = "settle"  # the settled end after an aborted batch (LSO == HW)


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
class StopOverdue:
    """A graceful stop outlived the driver's bound with calls still out (the node's: twice its
    call timeout). The driver only says that time is up; which calls are out, and what their
    failure means, is the machine's to know: each is taken as failed, as a cancellation would
    end it (an append as CANCELLED, its clients told "unknown outcome"), and the replica exits."""


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passed (`wake_at_ms` asked for it, or the driver looks in)."""


@dataclasses.dataclass(frozen=True)
class WriteArrived:
    """A write: its request as data (`kvstore.core.replica.writes`), which the machine turns
    into the planner's `Write`; `size` its request bytes (a batch's pre-bound), `leader_hint`
    where the group says the leader is (for a refusal)."""

    ticket: int
    request: WriteRequest
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


Event = (Started | LeadChanged | StopRequested | StopOverdue | Tick | WriteArrived | ReadArrived | ClientGone
         | ProbeRequested | Fenced | FenceFailed | EndRead | EndReadFailed | Fetched | FetchOutOfRange | FetchFailed
         | Replayed | ReplayApplyFailed | Rewound | Wiped | SnapshotDone | Appended | AppendFailed | CommitApplied)
