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
        assert _drain(watcher) == [(0, 1), None, None]
        plain = Watcher(b"k", b"")
        plain.close()
        assert plain.ended_why is None and _drain(plain) == [None]

    _in_loop(test)
