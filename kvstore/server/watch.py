"""Watch streams on a node: the bounded queue each stream reads, and WAL history as changes.

A replica offers every change it applies (live) to its watchers; a Watch from an older revision
first reads the WAL's history (`decode_changes`) up to where live changes take over
(`Watcher.live_from`), so a stream sees each change once and in order (docs/api.md, Watch).
"""

from __future__ import annotations

import asyncio

import wal
from kvstore import limits
from kvstore.core.state import Change, ChangeType, KeyState, decode_entry, effect_key


class Watcher:
    """A bounded queue of changes for one Watch stream; cut off if it falls too far behind."""

    def __init__(self, key: bytes, prefix: bytes) -> None:
        self.key = key
        self.prefix = prefix
        self.queue: asyncio.Queue[tuple[int, Change] | None] = asyncio.Queue(maxsize=limits.WATCH_QUEUE_EVENTS)
        # Per shard: changes below this revision come from WAL history, not from live apply.
        self.live_from: dict[int, int] = {}
        self.overflowed = False
        self.ended_why: str | None = None  # why the replica ended the stream (it went back or jumped ahead)

    def register(self, shard: int, applied: int, start: int | None) -> None:
        """Live changes of `shard` from `applied` (the replica's checkpoint now) on; history fills
        [start, applied). Never a change below `start`: a replica behind it (rebuilding, lagging)
        must not hand its older changes to a watch that asked to begin later."""
        self.live_from[shard] = applied if start is None else max(applied, start)

    def matches(self, key: bytes) -> bool:
        return key.startswith(self.prefix) if self.prefix else key == self.key

    def offer(self, shard: int, change: Change) -> None:
        if self.overflowed or not self.matches(change.key) or change.revision < self.live_from.get(shard, 0):
            return
        try:
            self.queue.put_nowait((shard, change))
        except asyncio.QueueFull:
            self.overflowed = True
            self.close()

    def close(self, why: str | None = None) -> None:
        """End the stream: None is the end-of-stream marker, room is made for it if needed.
        `why`: the replica's state went back or jumped ahead, so the changes it applies next are
        no continuation of this stream; the watcher hears UNAVAILABLE and watches again from
        the last revision it saw (history fills the rest)."""
        if why is not None and self.ended_why is None:
            self.ended_why = why
        if self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


def decode_changes(records: list[wal.AcceptedRecord]) -> list[Change]:
    """Changes carried by WAL records, for Watch history (versions are not known there: 0)."""
    out: list[Change] = []
    for rec in records:
        entry = decode_entry(rec.payload)
        if entry is None:
            continue
        for effect in entry.effects:
            key = effect_key(effect)
            if effect.WhichOneof("kind") == "put":
                out.append(Change(ChangeType.PUT, key, KeyState(effect.put.value, 0, rec.offset, 0), rec.offset))
            else:
                out.append(Change(ChangeType.DELETE, key, None, rec.offset))
    return out
