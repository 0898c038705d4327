"""What the machine asks its driver to do: plain, frozen, printable data.

Why: the driver performs these in order and decides nothing (docs/design.md §5.1), so an
action says everything the I/O needs and nothing about why. Every action that needs a result
names the event that answers it; `performers.PERFORMERS` names the one performer of each.
"""

from __future__ import annotations

import dataclasses
import enum

from kvstore.core.batch import Answer
from kvstore.core.replica.events import EndPurpose


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

