"""Watch streams on a node: the bounded queue each stream reads, WAL history as changes, and
the streams the KV and peer services serve (`Watches`).

A replica offers every change it applies (live) to its watchers; a Watch from an older revision
first reads the WAL's history (`decode_changes`) up to where live changes take over
(`Watcher.live_from`), so a stream sees each change once and in order (docs/api.md, Watch).
A watch over shards this node does not all hold is one part per node, merged here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import grpc.aio

import wal
from kvstore import errors, limits
from kvstore.core import reads, validation
from kvstore.core.entries import decode_entry
from kvstore.core.evaluate import key_value
from kvstore.core.state import Change, ChangeType, KeyState, effect_key
from kvstore.internal.v1 import peer_pb2
from kvstore.server import routing
from kvstore.v1 import kv_pb2


class ReadPosition(Protocol):
    @property
    def read_revision(self) -> int: ...


if TYPE_CHECKING:
    from kvstore.server.node import Node
    from kvstore.server.peers import Peers
    from kvstore.server.replica import ShardReplica


@dataclasses.dataclass
class Progress:
    """In a watcher's queue: every matching change of `shard` below `revision` is ahead of it.
    While no change of its shard is queued behind it and the stream has not taken it, a later
    progress of that shard moves its revision instead of queueing another: a reader that stops
    reading holds at most one per shard (`Watcher.progress`)."""

    shard: int
    revision: int
    taken: bool = False  # the stream took it off the queue: it can no longer move


class Watcher:
    """A bounded queue of changes for one Watch stream; cut off if it falls too far behind.
    `progress_every_s`: the stream asked for progress events (None: it did not)."""

    def __init__(self, key: bytes, prefix: bytes, progress_every_s: float | None = None) -> None:
        self.key = key
        self.prefix = prefix
        self.queue: asyncio.Queue[tuple[int, Change] | Progress | None] = asyncio.Queue(
            maxsize=limits.WATCH_QUEUE_EVENTS)
        self.progress_every_s = progress_every_s
        self._progress: dict[int, tuple[float, int]] = {}  # shard -> (when, revision) of its last progress
        self._movable: dict[int, Progress] = {}  # shard -> its queued progress, no change of it queued behind
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
            self._movable.pop(shard, None)  # a change behind it: that progress must not move past it
        except asyncio.QueueFull:
            self.overflowed = True
            self.close(f"this watcher fell {limits.WATCH_QUEUE_EVENTS} events behind (WATCH_QUEUE_EVENTS)")

    def progress(self, shard: int, revision: int, now_s: float) -> None:
        """After `shard` applied records up to `revision` (every change below it offered): queue a
        progress event, at most one per `progress_every_s` per shard and only past the last one.
        Queued behind the changes it covers, so the client sees them first. Skipped, never an
        overflow, when the queue is full: a later one will say as much."""
        if self.progress_every_s is None or self.overflowed or self.ended_why is not None:
            return
        last = self._progress.get(shard)
        if last is None:  # the clock starts at the shard's first apply after registering
            self._progress[shard] = (now_s, self.live_from.get(shard, 0))
            return
        if now_s - last[0] < self.progress_every_s or revision <= max(last[1], self.live_from.get(shard, 0)):
            return
        queued = self._movable.get(shard)
        if queued is not None and not queued.taken:
            queued.revision = revision  # nothing of its shard behind it: it may say more
        else:
            mark = Progress(shard, revision)
            try:
                self.queue.put_nowait(mark)
            except asyncio.QueueFull:
                return
            self._movable[shard] = mark
        self._progress[shard] = (now_s, revision)

    def close(self, why: str) -> None:
        """End the stream with UNAVAILABLE saying `why` (the node stops serving the shard, the
        replica's state went back or jumped ahead, the watcher fell behind): the client watches
        again from the last change it received, and history fills the rest. Every change still
        queued is dropped with the end marker, never only the oldest: what the client received
        stays a prefix of the changes, so resuming after the last one loses nothing."""
        if self.ended_why is None:
            self.ended_why = why
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


def registration_revision(store: ReadPosition) -> int:
    """Where a watch's live changes begin: the store's verified position (`read_revision`), not
    its checkpoint. Past an assumed commit-marker slot, a rewind may still apply a record found
    in that slot; a watch registered at the checkpoint would drop that change as "before it", and
    a later progress event would tell the client it had been delivered."""
    return store.read_revision


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


class Watches:
    """The Watch streams this node serves: a client's (KVService.Watch), over any shards, and the
    parts other nodes ask of it (PeerService.WatchShards), over shards it holds."""

    def __init__(self, node: Node, peers: Peers) -> None:
        self.node = node
        self.peers = peers

    async def watch(self, request: kv_pb2.WatchRequest,
                    context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[kv_pb2.WatchResponse]:
        if not request.prefix:
            validation.check_key(request.key)
        shards = [self.node.shard_for(request.key)] if not request.prefix else list(range(self.node.config.shards))
        starts = reads.watch_starts(request, shards, self.node.config.shards)
        local = [s for s in shards if self.node.holds_shard(s)]
        if len(local) == len(shards):
            async for event in self.here(request, shards, starts, context):
                yield event
            return
        async for event in self._spread(request, shards, starts, context):
            yield event

    async def here(self, request: kv_pb2.WatchRequest, shards: list[int], starts: dict[int, int],
                   context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[kv_pb2.WatchResponse]:
        """The watch over `shards`, every one of which this node holds (NotHeldError otherwise)."""
        watching = sum(len(r.watchers) for r in self.node.replicas.values())
        if watching >= limits.MAX_WATCHERS:
            raise errors.OverloadedError(f"{watching} watches open; limit MAX_WATCHERS is {limits.MAX_WATCHERS}")
        replicas = [self.node.replica(s) for s in shards]
        for replica in replicas:  # before the watch is registered: a clean refusal, nothing started
            if replica.shard in starts:
                await _check_history(replica, starts[replica.shard])
        watcher = Watcher(request.key, request.prefix,
                          self.node.config.watch_progress_ms / 1000 if request.progress_notify else None)
        for replica in replicas:
            watcher.register(replica.shard, registration_revision(replica.store), starts.get(replica.shard))
            replica.watchers.add(watcher)
        try:
            # Registered: every change applied from here on reaches the queue. Saying so lets a
            # caller start writing without sleeping first, and tells it the watch is not lost.
            yield kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_CREATED, start_revisions=[
                kv_pb2.ShardRevision(shard=replica.shard,
                                     revision=starts.get(replica.shard, watcher.live_from[replica.shard]))
                for replica in replicas])
            for replica in replicas:
                if replica.shard in starts:
                    async for event in _history(replica, watcher, starts[replica.shard]):
                        yield event
            while True:
                item = await watcher.queue.get()
                if item is None:  # the stream never just ends: the client resumes from what it got
                    raise errors.UnavailableError(f"{watcher.ended_why}; watch again from the last revision seen")
                if isinstance(item, Progress):
                    item.taken = True
                    yield kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PROGRESS, start_revisions=[
                        kv_pb2.ShardRevision(shard=item.shard, revision=item.revision)])
                    continue
                shard, change = item
                yield _event(shard, change)
        finally:
            for replica in replicas:
                replica.watchers.discard(watcher)

    async def _spread(self, request: kv_pb2.WatchRequest, shards: list[int], starts: dict[int, int],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[kv_pb2.WatchResponse]:
        """A watch over shards this node does not all hold: one part per node (this one for the
        shards it holds, PeerService.WatchShards on a leader or replica for the others), merged
        into one stream; TYPE_CREATED once every part is registered. Order holds per shard, as it
        does on one node. A part that ends ends the watch: UNAVAILABLE, watch again from the last
        revision seen (nothing is lost, nothing repeats)."""
        local, remote = routing.plan(self.node, shards, kv_pb2.CONSISTENCY_STALE)
        parts: list[AsyncIterator[kv_pb2.WatchResponse]] = []
        if local:
            parts.append(self.here(request, local, {s: starts[s] for s in local if s in starts}, context))
        for address, group in remote.items():
            parts.append(self._remote(address, request, group, starts))
        queue: asyncio.Queue[kv_pb2.WatchResponse | Exception | None] = asyncio.Queue(limits.WATCH_QUEUE_EVENTS)
        created = 0

        async def pump(part: AsyncIterator[kv_pb2.WatchResponse]) -> None:
            try:
                async for event in part:
                    await queue.put(event)
                await queue.put(None)
            # The watch ends with any error of a part. Not a cancellation: that propagates, since
            # nobody reads the queue any more and a put could wait forever.
            except Exception as exc:
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(part)) for part in parts]
        begins: list[kv_pb2.ShardRevision] = []  # every part's start revisions, for the one TYPE_CREATED
        # A part's changes that come before every part registered (its history, a live write) wait
        # for TYPE_CREATED, which is always first; bounded as a watcher's queue is.
        early: list[kv_pb2.WatchResponse] = []
        try:
            while True:
                item = await queue.get()
                if isinstance(item, errors.StoreError):
                    raise item
                if isinstance(item, grpc.aio.AioRpcError):
                    raise errors.UnavailableError(f"a part of this watch served by another node ended "
                                                  f"({item.code().name}: {item.details()}); watch again from the "
                                                  "last revision seen") from item
                if item is None or isinstance(item, Exception):
                    raise errors.UnavailableError("a part of this watch served by another node ended; watch again "
                                                  "from the last revision seen")
                if item.type == kv_pb2.WatchResponse.TYPE_CREATED:
                    created += 1
                    begins.extend(item.start_revisions)
                    if created == len(parts):
                        begins.sort(key=lambda b: b.shard)
                        yield kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_CREATED, start_revisions=begins)
                        for event in early:
                            yield event
                        early.clear()
                    continue
                if created < len(parts):
                    if len(early) >= limits.WATCH_QUEUE_EVENTS:
                        raise errors.UnavailableError(f"{len(early)} changes before every part of this watch "
                                                      "registered (WATCH_QUEUE_EVENTS); watch again")
                    early.append(item)
                    continue
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _remote(self, address: str, request: kv_pb2.WatchRequest, shards: list[int],
                      starts: dict[int, int]) -> AsyncIterator[kv_pb2.WatchResponse]:
        watch = kv_pb2.WatchRequest(key=request.key, prefix=request.prefix, progress_notify=request.progress_notify)
        if len(shards) == 1 and not request.prefix and shards[0] in starts:
            watch.start_revision = starts[shards[0]]
        else:
            watch.start_revisions.extend(kv_pb2.ShardRevision(shard=s, revision=starts[s]) for s in shards
                                         if s in starts)
        self.node.metrics.forwarded.labels(method="Watch.part").inc()
        stream = self.peers.peer(address).WatchShards(peer_pb2.WatchShardsRequest(watch=watch, shards=shards))
        async for reply in stream:
            yield reply.event


async def _check_history(replica: ShardReplica, start: int) -> None:
    """Refuse a watch whose history starts below the shard's log start (truncated: etcd's
    ErrCompacted), instead of finding out after TYPE_CREATED. UNAVAILABLE if the log start
    cannot be read now."""
    config = replica.config
    try:
        log_start = await asyncio.to_thread(replica.ends.log_start, config.topic, replica.shard)
    except Exception as exc:  # librdkafka's error: the broker is away; the watch may be retried
        raise errors.UnavailableError(f"shard {replica.shard}: cannot read the WAL's log start for the watch's "
                                      f"history: {exc}") from exc
    if start < log_start:
        raise errors.CompactedError(replica.shard, start, log_start)


async def _history(replica: ShardReplica, watcher: Watcher, start: int) -> AsyncIterator[kv_pb2.WatchResponse]:
    """Changes in [start, live_from) of one shard, read back from the WAL. A truncation that
    races the watch (the log start passed `start` after `_check_history`) ends the stream
    with the same OUT_OF_RANGE."""
    end = watcher.live_from[replica.shard]
    if start >= end:
        return
    config = replica.config
    replayer = await asyncio.to_thread(lambda: wal.Replayer(config.bootstrap_servers, config.topic, replica.shard,
                                                            start, security=config.kafka_security))
    try:
        while replayer.position < end:
            try:
                records = await asyncio.to_thread(replayer.poll_once, 0.5)
            except wal.OffsetOutOfRangeError as exc:
                if exc.below_start:
                    raise errors.CompactedError(replica.shard, replayer.position, exc.log_start) from exc
                raise errors.UnavailableError(f"shard {replica.shard}: watch history: {exc}") from exc
            for change in decode_changes([r for r in records if r.offset < end]):
                if watcher.matches(change.key):
                    yield _event(replica.shard, change)
    finally:
        await asyncio.to_thread(replayer.close)


def _event(shard: int, change: Change) -> kv_pb2.WatchResponse:
    if change.type is ChangeType.PUT:
        assert change.state is not None
        return kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PUT, kv=key_value(change.key, change.state),
                                    shard=shard)
    return kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_DELETE,
                                kv=kv_pb2.KeyValue(key=change.key, mod_revision=change.revision), shard=shard)
