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

import collections
from collections.abc import Iterable, Sequence

DEFAULT_CAPACITY = 65_536  # keys remembered per shard (a key written again takes no more room)


class RecentWrites:
    """Last write revision per recently written key, with the floor below which it knows nothing.

    One ordered map, in order of each key's last write: noting a write and forgetting the
    oldest are O(1) (a replay notes every record it applies), and since that order is the order
    of revisions, a span question walks back from the newest write only as far as the revision
    it asks about: O(keys written since), never the whole index."""

    def __init__(self, floor: int = 0, capacity: int = DEFAULT_CAPACITY) -> None:
        assert capacity > 0 and floor >= 0, (capacity, floor)
        self.capacity = capacity
        self.floor = floor  # every write below it may be unknown here
        self._last: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # oldest write first
        self._newest = -1  # the largest revision noted: what keeps `_last` in revision order

    def reset(self, floor: int) -> None:
        """Forget everything: the replica's state jumped (opened, wiped, a snapshot loaded)."""
        self.floor = floor
        self._last.clear()
        self._newest = -1

    def note(self, keys: Sequence[bytes], revisions: Sequence[int]) -> None:
        """Records applied: `keys[i]` written at `revisions[i]`. A revision below one noted before
        is noted as that one: never a lower answer, and since reads happen between applies, one
        apply's writes are all before or all after any read's revision (no answer changes)."""
        last, newest = self._last, self._newest
        for key, revision in zip(keys, revisions, strict=True):  # bounded by the apply's effects
            newest = max(newest, revision)
            last[key] = newest
            last.move_to_end(key)
        self._newest = newest
        while len(last) > self.capacity:  # bounded: one key evicted per key over capacity
            _key, revision = last.popitem(last=False)
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
            for key, written in reversed(last.items()):  # newest first; bounded by the capacity
                if written < revision:
                    break  # every older entry was written before too
                if start <= key and (end is None or key < end):
                    return False
        return True

    def __len__(self) -> int:
        return len(self._last)
