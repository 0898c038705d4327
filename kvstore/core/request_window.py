"""The request-id table's bounds, as a pure rule shared by LevelDB and memory (docs/design.md §4.1, W7).

Ids are forgotten oldest first by revision:

- by time: an entry with leader time t forgets every id at the head of the table whose time is
  below t - horizon (after its own duplicate check, `kvstore.core.state.apply_entries`);
- by count: the id that takes the table over `limit` forgets the oldest.

Both happen at the exact entry that causes them, whether records come one by one or batched,
and depend only on the entries' revisions and leader times, never on a local clock: every
replica remembers the same ids however its batches were cut.

Time eviction stops at the first id young enough, so an id written by a leader whose clock
lagged a later id's may stay a little longer than the horizon; keeping an id longer is always
safe, and the scan stays one seek per apply.

An id of unknown time (0: written before WalEntry.leader_unix_ms existed) counts as older than
any horizon. When forgotten, `evicted_through_ms` takes the evicting entry's time instead of 0:
the id committed before that entry was built, which is the best bound known. (So the first
timed entry after an upgrade forgets every such id, and retries first attempted up to
MAX_CLOCK_SKEW_MS after it are refused once, rather than possibly applied twice. Ids forgotten
by count while applying entries without a time add nothing: no bound is known.)

`RequestWindow` is one apply's view: the stored table (read lazily, oldest first) plus the ids
this apply adds. The caller writes `added` and deletes `evicted_stored` with its checkpoint.
`MemoryShard` is the whole replica state in memory (keys, table, checkpoint) with the same apply:
the deterministic simulation's replica and the tests' reference model of `ShardStore`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence

from kvstore import limits
from kvstore.core.delta import store_delta
from kvstore.core.locks import LockIndex
from kvstore.core.recent_writes import RecentWrites
from kvstore.core.state import Applied, DecidedTxn, KeyState, RequestRecord
from wal.offsets import past_marker

StoredRow = tuple[int, str, int]  # (revision, request id, leader unix ms) of an id kept before this apply


class RequestWindow:
    """The request-id table during one apply (see the module's docstring)."""

    def __init__(self, *, contains: Callable[[str], bool], stored_oldest_first: Iterator[StoredRow], count: int,
                 evicted_through_ms: int, limit: int, horizon_ms: int) -> None:
        assert limit > 0 and horizon_ms > 0 and count >= 0 and evicted_through_ms >= 0
        self._contains = contains
        self._limit = limit
        self._horizon_ms = horizon_ms
        self.count = count
        self.evicted_through_ms = evicted_through_ms
        self.added: dict[str, RequestRecord] = {}  # insertion order = revision order
        self.evicted_stored: list[tuple[int, str]] = []  # (revision, id) of stored rows to delete
        self._evicted_ids: set[str] = set()
        self._stored = stored_oldest_first  # every stored row is older than this apply's
        self._stored_head: StoredRow | None = None  # read ahead
        self._stored_left = True

    def seen(self, request_id: str) -> bool:
        if request_id in self.added:
            return True
        return request_id not in self._evicted_ids and self._contains(request_id)

    def forget_older(self, leader_ms: int) -> None:
        """Apply the time bound at an entry built at `leader_ms` (> 0)."""
        assert leader_ms > 0
        cutoff_ms = leader_ms - self._horizon_ms
        while (oldest_ms := self._oldest_ms()) is not None and oldest_ms < cutoff_ms:
            self._evict_oldest(leader_ms)

    def add(self, request: RequestRecord) -> None:
        """Apply the count bound as `request` joins the table."""
        self.added[request.request_id] = request
        self.count += 1
        while self.count > self._limit:
            self._evict_oldest(request.leader_unix_ms)

    def _oldest_ms(self) -> int | None:
        """The leader time of the oldest id kept, or None when the table is empty."""
        if self._stored_head is None and self._stored_left:
            self._stored_head = next(self._stored, None)
            self._stored_left = self._stored_head is not None
        if self._stored_head is not None:
            return self._stored_head[2]
        if self.added:
            return next(iter(self.added.values())).leader_unix_ms
        return None

    def _evict_oldest(self, evicting_ms: int) -> None:
        oldest_ms = self._oldest_ms()
        assert oldest_ms is not None, f"table of {self.count} ids has none to evict"
        if self._stored_head is not None:
            revision, rid, _ = self._stored_head
            self._stored_head = None
            self.evicted_stored.append((revision, rid))
            self._evicted_ids.add(rid)
        else:
            del self.added[next(iter(self.added))]
        self.count -= 1
        self.evicted_through_ms = max(self.evicted_through_ms, oldest_ms or evicting_ms)


@dataclasses.dataclass
class MemoryShard:
    """One shard's replica state in memory, applied exactly as `ShardStore.apply` applies it."""

    max_request_ids: int = limits.MAX_REQUEST_IDS
    request_id_horizon_ms: int = limits.REQUEST_ID_HORIZON_MS
    keys: dict[bytes, KeyState] = dataclasses.field(default_factory=dict)
    requests: collections.OrderedDict[str, RequestRecord] = dataclasses.field(
        default_factory=collections.OrderedDict)  # revision order
    applied_offset: int = 0  # the checkpoint: every record below it applied, none above
    evicted_through_ms: int = 0
    unverified: int | None = None  # the marker slot a leader assumed, not read (`ShardStore.unverified`)
    locks: LockIndex = dataclasses.field(default_factory=LockIndex)  # prepared cross-shard transactions
    # The decision table (coordinator shard): decisions not yet resolved by every participant.
    decisions: dict[str, DecidedTxn] = dataclasses.field(default_factory=dict)
    # Not durable (`ShardStore.recent`): what the records applied since the replica started wrote.
    recent: RecentWrites = dataclasses.field(default_factory=RecentWrites, compare=False, repr=False)

    def get(self, key: bytes) -> KeyState | None:
        return self.keys.get(key)

    @property
    def read_revision(self) -> int:
        """`ShardStore.read_revision`: the checkpoint, or the assumed marker slot while there is one."""
        return self.applied_offset if self.unverified is None else self.unverified

    def request(self, request_id: str) -> RequestRecord | None:
        return self.requests.get(request_id)

    def decided_txn(self, txn_id: str) -> DecidedTxn | None:
        return self.decisions.get(txn_id)

    def decided(self) -> list[DecidedTxn]:
        """The decision table, oldest decision first."""
        return sorted(self.decisions.values(), key=lambda d: d.revision)

    def decided_request(self, request_id: str) -> DecidedTxn | None:
        """The decision in the table that recorded the client's `request_id` as its outcome."""
        for decided in self.decisions.values():  # the model: a store keeps an index
            if decided.decision.request_id == request_id:
                return decided
        return None

    def apply(self, records: Sequence[tuple[int, bytes]], new_checkpoint: int, *,
              unverified: int | None = None) -> Applied:
        """`ShardStore.apply` in memory: the same `kvstore.core.delta.store_delta`, written to
        dicts, so that the simulation checks the apply a node runs."""
        window = RequestWindow(
            contains=self.requests.__contains__,
            # Lazily: an apply reads only the head it evicts (a copy of the table cost O(table) per
            # apply, 15 % of the simulation's time). Never resumed after the writes below.
            stored_oldest_first=((r.revision, r.request_id, r.leader_unix_ms) for r in self.requests.values()),
            count=len(self.requests), evicted_through_ms=self.evicted_through_ms, limit=self.max_request_ids,
            horizon_ms=self.request_id_horizon_ms)
        delta = store_delta(self, window, records, new_checkpoint, unverified=unverified)
        applied = delta.applied
        for txn_id, decided in applied.decided.items():
            if decided is None:
                self.decisions.pop(txn_id, None)
            else:
                self.decisions[txn_id] = decided
        for key, state in applied.writes.items():
            if state is None:
                self.keys.pop(key, None)
            else:
                self.keys[key] = state
        for _revision, rid in delta.forgotten:
            del self.requests[rid]
        for request in delta.remembered:
            self.requests[request.request_id] = request
        assert len(self.requests) == delta.request_count, (len(self.requests), delta.request_count)
        self.evicted_through_ms = delta.evicted_through_ms
        if delta.mark_unverified is not None:
            self.unverified = delta.mark_unverified
        elif delta.clear_unverified:
            self.unverified = None
        self.applied_offset = delta.checkpoint
        self.locks.change(applied.prepared)
        self.recent.note(applied.changed[0], applied.changed[2])
        return applied

    def restarted(self) -> None:
        """The process restarted: what is not durable (`recent`) is gone."""
        self.recent = RecentWrites(floor=self.read_revision)

    def rewind_unverified(self) -> bool:
        """`ShardStore.rewind_unverified`: move the checkpoint back over the assumed marker slot."""
        if self.unverified is None or not past_marker(self.applied_offset, self.unverified):
            return False
        self.applied_offset, self.unverified = self.unverified, None
        return True

    def load(self, snapshot: MemoryShard) -> None:
        """Become a copy of `snapshot` (a snapshot loaded: its cut is the checkpoint)."""
        loaded = snapshot.copy()
        self.keys, self.requests, self.locks, self.decisions = (loaded.keys, loaded.requests, loaded.locks,
                                                                 loaded.decisions)
        self.recent = RecentWrites(floor=loaded.applied_offset)
        self.applied_offset, self.evicted_through_ms, self.unverified = (loaded.applied_offset,
                                                                         loaded.evicted_through_ms, None)

    def wipe(self) -> None:
        """`ShardStore.wipe`: empty, at checkpoint 0, every request id forgotten."""
        self.keys.clear()
        self.requests.clear()
        self.locks = LockIndex()
        self.decisions = {}
        self.recent = RecentWrites()
        self.applied_offset, self.evicted_through_ms, self.unverified = 0, 0, None

    def copy(self) -> MemoryShard:
        """A durable copy (what survives a crash in the simulation: LevelDB's state and checkpoint)."""
        return MemoryShard(self.max_request_ids, self.request_id_horizon_ms, dict(self.keys),
                           collections.OrderedDict(self.requests), self.applied_offset, self.evicted_through_ms,
                           self.unverified, LockIndex(self.locks.prepared()), dict(self.decisions))
