"""The watch queue's rules: which live changes reach a stream, and how a replica ends it."""

from __future__ import annotations

import asyncio

from kvstore.core.state import Change, ChangeType, KeyState
from kvstore.server.watch import Watcher


def _put(key: bytes, revision: int) -> Change:
    return Change(ChangeType.PUT, key, KeyState(b"v", 1, revision, revision), revision)


def _drain(watcher: Watcher) -> list[tuple[int, int] | None]:
    out: list[tuple[int, int] | None] = []
    while not watcher.queue.empty():
        item = watcher.queue.get_nowait()
        out.append(None if item is None else (item[0], item[1].revision))
    return out


def _in_loop(test: object) -> None:
    async def run() -> None:
        test()  # type: ignore[operator]

    asyncio.run(run())


def test_a_replica_behind_the_start_never_hands_over_older_changes() -> None:
    """Issue 22's campaign: a watch resumed at 1917 on a replica rebuilding from 0 got 209, 216, ..."""

    def test() -> None:
        watcher = Watcher(b"", b"k")
        watcher.register(1, applied=100, start=1917)
        assert watcher.live_from[1] == 1917  # history [1917, 100) is empty; live from the start
        for revision in (209, 1916, 1917, 1918):
            watcher.offer(1, _put(b"k1", revision))
        assert _drain(watcher) == [(1, 1917), (1, 1918)]

    _in_loop(test)


def test_live_from_the_checkpoint_when_history_fills_below_it() -> None:
    def test() -> None:
        watcher = Watcher(b"", b"k")
        watcher.register(0, applied=50, start=10)  # history gives [10, 50)
        watcher.register(2, applied=70, start=None)  # from now
        watcher.offer(0, _put(b"k0", 49))
        watcher.offer(0, _put(b"k0", 50))
        watcher.offer(2, _put(b"k2", 69))
        watcher.offer(2, _put(b"k2", 70))
        watcher.offer(2, _put(b"other", 71))  # not under the prefix
        assert watcher.live_from == {0: 50, 2: 70}
        assert _drain(watcher) == [(0, 50), (2, 70)]

    _in_loop(test)


def test_an_ended_stream_says_why_and_the_first_reason_stays() -> None:
    def test() -> None:
        watcher = Watcher(b"", b"k")
        watcher.register(0, applied=0, start=None)
        watcher.offer(0, _put(b"k", 1))
        watcher.close("shard 0: the replica serving this watch is rebuilding")
        watcher.close("shard 0: node shutting down")
        assert watcher.ended_why == "shard 0: the replica serving this watch is rebuilding"
        # What was queued is dropped with the end: the client resumes after what it received.
        assert _drain(watcher) == [None]

    _in_loop(test)


def test_a_full_queue_ends_with_every_change_dropped_never_only_the_oldest() -> None:
    """Review finding: dropping only the oldest queued change to make room for the end marker
    let the client receive newer ones and resume past the one dropped. Now what the client got is
    always a prefix of the changes; the resume's history brings the rest."""
    from kvstore import limits

    def test() -> None:
        watcher = Watcher(b"", b"k")
        watcher.register(0, applied=0, start=None)
        for revision in range(1, limits.WATCH_QUEUE_EVENTS + 2):  # one more than fits: it overflows
            watcher.offer(0, _put(b"k", revision))
        assert watcher.overflowed and "fell" in (watcher.ended_why or "")
        assert _drain(watcher) == [None]

    _in_loop(test)


def test_a_spread_watch_sends_created_before_any_parts_change() -> None:
    """Review finding: a part's history (or a live write) could reach the client before the
    merged `created`; the client then gave up on the watch. Early changes now wait for it."""
    from types import SimpleNamespace

    from kvstore.server import routing
    from kvstore.server.watch import Watches
    from kvstore.v1 import kv_pb2

    created = kv_pb2.WatchResponse.TYPE_CREATED

    async def local(*_: object) -> object:
        yield kv_pb2.WatchResponse(type=created, start_revisions=[kv_pb2.ShardRevision(shard=0, revision=5)])
        yield kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PUT, shard=0, kv=kv_pb2.KeyValue(key=b"k0"))
        await asyncio.sleep(3600)

    async def remote(*_: object) -> object:
        await asyncio.sleep(0.05)  # registers later than the local part
        yield kv_pb2.WatchResponse(type=created, start_revisions=[kv_pb2.ShardRevision(shard=1, revision=7)])
        yield kv_pb2.WatchResponse(type=kv_pb2.WatchResponse.TYPE_PUT, shard=1, kv=kv_pb2.KeyValue(key=b"k1"))
        await asyncio.sleep(3600)

    async def run() -> list[kv_pb2.WatchResponse]:
        watches = Watches.__new__(Watches)
        watches.node = None  # type: ignore[assignment]  # routing.plan is replaced below
        watches.here = local  # type: ignore[method-assign,assignment]
        watches._remote = remote  # type: ignore[method-assign,assignment]
        original = routing.plan
        routing.plan = lambda *_: ([0], {"peer:1": [1]})  # type: ignore[assignment]
        try:
            stream = watches._spread(kv_pb2.WatchRequest(prefix=b"k"), [0, 1], {}, SimpleNamespace())
            got = [await stream.__anext__() for _ in range(3)]
            await stream.aclose()
            return got
        finally:
            routing.plan = original  # type: ignore[assignment]

    got = asyncio.run(run())
    assert got[0].type == created and [(b.shard, b.revision) for b in got[0].start_revisions] == [(0, 5), (1, 7)]
    assert sorted(e.kv.key for e in got[1:]) == [b"k0", b"k1"]


def test_progress_is_queued_behind_the_changes_it_covers_at_most_once_per_interval() -> None:
    from kvstore.server.watch import Progress

    def test() -> None:
        watcher = Watcher(b"", b"k", progress_every_s=1.0)
        watcher.register(0, applied=10, start=None)
        watcher.progress(0, 12, now_s=0.0)  # the first apply starts the clock: nothing yet
        watcher.offer(0, _put(b"k0", 12))
        watcher.progress(0, 13, now_s=0.5)  # too soon
        watcher.progress(0, 13, now_s=1.1)
        watcher.progress(0, 13, now_s=2.5)  # nothing new since
        watcher.progress(0, 20, now_s=2.6)
        items = []
        while not watcher.queue.empty():
            items.append(watcher.queue.get_nowait())
        # 13 then 20: one item, moved (nothing of shard 0 queued between them, nobody read it yet)
        assert [(i[0], i[1].revision) if isinstance(i, tuple) else i for i in items] == [(0, 12), Progress(0, 20)]
        silent = Watcher(b"", b"k")  # a stream that did not ask
        silent.register(0, applied=10, start=None)
        silent.progress(0, 12, now_s=0.0)
        silent.progress(0, 30, now_s=100.0)
        assert silent.queue.empty()

    _in_loop(test)


def test_a_reader_that_stops_reading_holds_at_most_one_progress_per_shard() -> None:
    """Review: progress items piled up in a stalled stream's bounded queue until a change
    overflowed it. A queued progress with no change of its shard behind it moves instead."""
    from kvstore.server.watch import Progress

    def test() -> None:
        watcher = Watcher(b"", b"k", progress_every_s=1.0)
        watcher.register(0, applied=10, start=None)
        watcher.register(1, applied=10, start=None)
        for shard in (0, 1):
            watcher.progress(shard, 10, now_s=0.0)
        for tick in range(1, 50):
            for shard in (0, 1):
                watcher.progress(shard, 10 + tick, now_s=float(tick))
        assert watcher.queue.qsize() == 2  # one per shard, however long nobody reads
        first = watcher.queue.get_nowait()
        assert first == Progress(0, 59)
        first.taken = True  # the stream took it: the next one is a new item
        watcher.offer(1, _put(b"k1", 60))  # a change of shard 1 behind its progress: that one stays put
        watcher.progress(0, 61, now_s=51.0)
        watcher.progress(1, 61, now_s=51.0)
        items = [watcher.queue.get_nowait() for _ in range(watcher.queue.qsize())]
        assert [i if isinstance(i, Progress) else (i[0], i[1].revision) for i in items] == [
            Progress(1, 59), (1, 60), Progress(0, 61), Progress(1, 61)]

    _in_loop(test)


def test_a_watch_registers_at_the_verified_position_not_past_an_assumed_marker_slot() -> None:
    """Review: registered at the checkpoint, past a marker slot a rewind may still fill, a watch
    dropped that record's change, and a progress event then said it had been delivered."""
    from kvstore.core.request_window import MemoryShard
    from kvstore.server.watch import registration_revision

    store = MemoryShard()
    store.applied_offset, store.unverified = 12, 11  # a batch at 8..10, its marker assumed at 11
    assert registration_revision(store) == 11
    store.unverified = None
    assert registration_revision(store) == 12
