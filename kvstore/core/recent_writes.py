"""Which keys a replica's recent records wrote, and where: what validates an optimistic read; pure.

A read that spans shards (a Scan, a read-only Txn) reads each shard at its own moment, so a
cross-shard transaction resolved at one shard between two of those moments would show in part
(docs/design.md §10, T4). The store has no old versions to read at one instant instead; it reads
optimistically and then validates (`kvstore.core.cut`): once every shard was read, each shard is
asked again whether anything it was read for changed since the revision it was read at. This
index answers that: per key, the revision of its last write (put or delete, so a key created
and deleted again in between is seen), for the last `capacity` keys written.

What it does not hold it does not guess: below `floor` (a replica opened, wiped, loaded from a
snapshot, or keys forgotten for room) it knows nothing, and a read older than the floor fails
validation (the reader tries again). It is not replica state: every replica builds its own from
the records it applies, and a new leader starts from what its replica applied as a follower.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterable, Sequence

DEFAULT_CAPACITY = 65_536  # keys remembered per shard (a key written again takes no more room)


class RecentWrites:
    """Last write revision per recently written key, with the floor below which it knows nothing."""

    def __init__(self, floor: int = 0, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity > 0 and floor >= 0, (capacity, floor)
        self.capacity = capacity
        self.floor = floor  # every write below it may be unknown here
        self._last: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # oldest write first
        self._sorted: list[bytes] = []  # the same keys in key order (span questions)

    def reset(self, floor: int) -> None:
        """Forget everything: the replica's state jumped (opened, wiped, a snapshot loaded)."""
        self.floor = floor
        self._last.clear()
        self._sorted.clear()

    def note(self, keys: Sequence[bytes], revisions: Sequence[int]) -> None:
        """Records applied: `keys[i]` written at `revisions[i]` (in order)."""
        last, ordered = self._last, self._sorted
        for key, revision in zip(keys, revisions, strict=True):  # bounded by the apply's effects
            if key in last:
                last.move_to_end(key)
            else:
                bisect.insort(ordered, key)
            last[key] = revision
        while len(last) > self.capacity:  # bounded: one key evicted per key over capacity
            key, revision = last.popitem(last=False)
            del ordered[bisect.bisect_left(ordered, key)]
            self.floor = max(self.floor, revision + 1)

    def unchanged_since(self, revision: int, *, keys: Iterable[bytes] = (),
                        span: tuple[bytes, bytes | None] | None = None) -> bool:
        """Whether no record at or after `revision` wrote any of `keys` or any key in `span`
        ([start, end), end None: to the end), as far as this index can tell: False when
        `revision` lies below what it knows (`floor`)."""
        if revision < self.floor:
            return False
        last = self._last
        for key in keys:
            if last.get(key, -1) >= revision:
                return False
        if span is not None:
            start, end = span
            ordered = self._sorted
            at = bisect.bisect_left(ordered, start)
            stop = len(ordered) if end is None else bisect.bisect_left(ordered, end)
            for key in ordered[at:stop]:  # bounded by the capacity
                if last[key] >= revision:
                    return False
        return True

    def __len__(self) -> int:
        return len(self._last)
