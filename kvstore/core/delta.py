"""What applying a batch of accepted WAL records changes in a replica's state: one pure function
behind every store (W5).

A replica's state is written by two stores: LevelDB on a node (`kvstore.storage.shard_store.ShardStore`)
and memory in the simulation and the tests (`kvstore.core.request_window.MemoryShard`). Both used
to compute their apply themselves (the checks on the checkpoint, the request-id window around
`kvstore.core.state.apply_entries`, the order ids join the table, what happens to the assumed
marker slot), and every rule kept twice is a rule that can drift: the simulation would then check
a store no node runs. `store_delta` computes all of it once, from the state before the apply; a
store only writes the `StoreDelta` it is given, in one batch with its checkpoint.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvstore.core.locks import LockView
from kvstore.core.state import Applied, DecidedTxn, KeyState, RequestRecord, apply_entries

if TYPE_CHECKING:
    from kvstore.core.request_window import RequestWindow


class StoreState(Protocol):
    """What a delta reads of a replica's state as it stands before the apply."""

    @property
    def applied_offset(self) -> int: ...

    def get(self, key: bytes) -> KeyState | None: ...

    def decided_txn(self, txn_id: str) -> DecidedTxn | None: ...

    @property
    def locks(self) -> LockView: ...


@dataclasses.dataclass(frozen=True, slots=True)
class StoreDelta:
    """Everything one apply changes, for a store to write at once with its checkpoint (W5).

    `applied` carries the keys' new states (`writes`, None: deleted), the prepared and decision
    tables' changes (`prepared`, `decided`, in order, None: gone) and the effects for watchers
    and the recent-writes index (`changed`). The request-id table loses `forgotten` first and
    then gains `remembered`: an id forgotten may come back in the same apply."""

    applied: Applied
    forgotten: list[tuple[int, str]]  # (revision, request id) of stored ids the window forgot
    remembered: list[RequestRecord]  # ids the table gains, in (revision, id) order, as LevelDB keeps them
    request_count: int  # ids kept after the apply
    evicted_through_ms: int
    checkpoint: int
    mark_unverified: int | None  # a leader's own commit: this marker slot is assumed, not read
    clear_unverified: bool  # the checkpoint moved on: any slot assumed before is proven or read


_REVISION_AND_ID = operator.attrgetter("revision", "request_id")


def store_delta(state: StoreState, window: RequestWindow, records: Sequence[tuple[int, bytes]],
                new_checkpoint: int, *, unverified: int | None = None) -> StoreDelta:
    """The change of applying accepted WAL records (offset, payload), in offset order, to `state`
    and moving its checkpoint to `new_checkpoint`; pure (`window` is the request-id table as
    stored, read lazily, and is used up by this call).

    `unverified`: the leader's own commit, whose marker slot (new_checkpoint - 1) it assumed
    rather than read; it stays marked until a later apply moves the checkpoint on (a replay read
    the slot, or the leader's next batch landed right after it, which proves the marker there).
    """
    assert unverified is None or unverified == new_checkpoint - 1, "only the marker's slot is unverified"
    current = state.applied_offset
    assert new_checkpoint >= current, f"checkpoint would go back from {current} to {new_checkpoint}"
    # The ends suffice: apply_entries refuses records out of order before anything is written
    # (a check per record cost ~0.1 µs of a replay's few).
    assert not records or (current <= records[0][0] and records[-1][0] < new_checkpoint), (
        f"records outside [{current}, {new_checkpoint})"
    )
    applied = apply_entries(state.get, window.seen, records, on_request=window.add,
                            on_leader_time=window.forget_older, prepared=state.locks.prepared_txn,
                            decided=state.decided_txn)
    # Already in this order as apply_entries records them (sorting a sorted list is one pass);
    # sorted all the same, because two stores forget ids at one revision in the order kept here.
    remembered = sorted(window.added.values(), key=_REVISION_AND_ID)
    return StoreDelta(applied=applied, forgotten=window.evicted_stored, remembered=remembered,
                      request_count=window.count, evicted_through_ms=window.evicted_through_ms,
                      checkpoint=new_checkpoint, mark_unverified=unverified,
                      clear_unverified=unverified is None and new_checkpoint > current)
