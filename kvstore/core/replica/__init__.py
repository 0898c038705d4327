"""One shard replica's whole protocol as a pure machine, in parts (docs/design.md §5.1).

| module | what |
| --- | --- |
| `events.py` | what happens to a replica: plain, printable data |
| `actions.py` | what the machine asks its driver to do: plain, printable data |
| `config.py` | the machine's bounds (`ReplicaConfig`), `Mutation`, what it reads of the store (`StateView`) |
| `context.py` | what the parts share within one step: bounds, the store, the time, the actions out |
| `machine.py` | `ReplicaMachine`: the leadership, the one scheduler (`_advance`), every event's handler |
| `reader.py` | the reader's states, one enum with its table of valid moves (`_VALID`) |
| `catchup.py` | following and a takeover's catch-up: the checkpoint made trustworthy, then fetch (W6) |
| `batching.py` | group commit: admission, linger, carry-over, one batch in flight, answers after the commit (W5) |
| `writes.py` | what a write carries in: its request as data; the machine builds the planner's `Write` |
| `performers.py` | the driver contract: one table of performers, one per action type |
| `trace.py` | a machine's run as text (printed, parsed back) and its replay through the machine alone |
| `barrier.py` | the read barrier's rounds, its waits, and reads waiting on a prepared transaction's locks (T4) |

The names drivers use are re-exported here, so `from kvstore.core.replica import ...` keeps
meaning the machine and its interface.
"""

from kvstore.core.replica.actions import (
    METRICS,
    READY,
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
    Ready,
    Reply,
    ResolveNow,
    RewindUnverified,
    SetTerm,
    Unable,
    Wipe,
)
from kvstore.core.replica.config import Mutation, ReplicaConfig, StateView
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
from kvstore.core.replica.machine import ReplicaMachine
from kvstore.core.replica.reader import ReaderState
from kvstore.core.replica.writes import (
    ClientRequest,
    DecideTxn,
    ForgetTxns,
    PrepareTxn,
    ResolveTxn,
    WriteRequest,
    write_for,
)

__all__ = [
    "METRICS",
    "READY",
    "Able",
    "Action",
    "AnswerRequest",
    "Append",
    "AppendFailed",
    "Appended",
    "ApplyCommitted",
    "ApplyReplayed",
    "ClientGone",
    "ClientRequest",
    "CloseWriter",
    "CommitApplied",
    "DecideTxn",
    "EndPurpose",
    "EndRead",
    "EndReadFailed",
    "Event",
    "Exit",
    "Fence",
    "FenceFailed",
    "Fenced",
    "Fetch",
    "FetchFailed",
    "FetchOutOfRange",
    "Fetched",
    "ForgetTxns",
    "LeadChanged",
    "LoadSnapshot",
    "Mutation",
    "Note",
    "PrepareTxn",
    "ProbeRequested",
    "ReadArrived",
    "ReadEnd",
    "ReadSettledEnd",
    "ReaderState",
    "Ready",
    "ReplayApplyFailed",
    "Replayed",
    "ReplicaConfig",
    "ReplicaMachine",
    "Reply",
    "ResolveNow",
    "ResolveTxn",
    "RewindUnverified",
    "Rewound",
    "SetTerm",
    "SnapshotDone",
    "Started",
    "StateView",
    "StopOverdue",
    "StopRequested",
    "Tick",
    "Unable",
    "Wipe",
    "Wiped",
    "WriteArrived",
    "WriteRequest",
    "write_for",
]
