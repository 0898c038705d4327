"""The WAL readers registry, its pure parts: the record format and what a listing makes of a
sequence of records (last per key wins, tombstones remove, malformed records skipped and counted).
The broker's side is tests/integration/test_wal_readers.py."""

from __future__ import annotations

import json

import pytest

from wal.readers import FORMAT, MAX_NAME_CHARS, Malformed, Reader, RegistryError, decode, latest

FEED = Reader("changes:/data/feed/_checkpoint", "change-feed", "/data/feed", {0: 12, 1: 7}, 1_700_000_000_000)


def test_a_record_round_trips() -> None:
    value = FEED.encode()
    assert json.loads(value) == {"format": FORMAT, "name": FEED.name, "kind": "change-feed", "where": "/data/feed",
                                 "positions": {"0": 12, "1": 7}, "updated_unix_ms": 1_700_000_000_000}
    assert decode(FEED.name.encode(), value) == FEED


@pytest.mark.parametrize(("key", "value", "why"), [
    (b"a", b"\xff", "not UTF-8 JSON"),
    (b"a", b"{", "not UTF-8 JSON"),
    (b"a", b"[1]", "not a JSON object"),
    (b"a", b'{"format": 2, "name": "a"}', "format 2"),
    (b"a", b'{"format": 1, "name": "b", "positions": {}}', "is not its name"),
    (b"a", b'{"format": 1, "name": "a", "positions": []}', "positions is not an object"),
    (b"a", b'{"format": 1, "name": "a", "positions": {"x": 1}}', "not a decimal number"),
    (b"a", b'{"format": 1, "name": "a", "positions": {"0": 1}}', "no field"),
    (b"a", b'{"format": 1, "name": "a", "kind": "k", "where": "w", "positions": {"0": -1}, "updated_unix_ms": 0}',
     "offsets >= 0"),
    (b"a", b'{"format": 1, "name": "a", "kind": "k", "where": "w", "positions": {"0": true}, "updated_unix_ms": 0}',
     "offsets >= 0"),
    (b"a", b'{"format": 1, "name": "a", "kind": "k", "where": "w", "positions": {"0": 1.5}, "updated_unix_ms": 0}',
     "offsets >= 0"),
    (b"a", b'{"format": 1, "name": "a", "kind": 3, "where": "w", "positions": {}, "updated_unix_ms": 0}',
     "must be strings"),
    (b"a", b'{"format": 1, "name": "a", "kind": "k", "where": "w", "positions": {}, "updated_unix_ms": "now"}',
     "updated_unix_ms"),
])
def test_a_malformed_record_says_why(key: bytes, value: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode(key, value)


def test_a_reader_is_checked_when_made() -> None:
    with pytest.raises(ValueError, match="MAX_NAME_CHARS"):
        Reader("x" * (MAX_NAME_CHARS + 1), "k", "w", {}, 0)
    with pytest.raises(ValueError, match="offsets >= 0"):
        Reader("x", "k", "w", {0: -5}, 0)


def reader(name: str, position: int, at_ms: int = 1) -> Reader:
    return Reader(name, "change-feed", f"/{name}", {0: position}, at_ms)


def test_a_listing_keeps_the_last_record_per_reader() -> None:
    a1, a2, b1 = reader("a", 10), reader("a", 20), reader("b", 5)
    records = [(0, b"a", a1.encode()), (1, b"b", b1.encode()), (2, b"a", a2.encode())]
    assert latest(records).readers == (a2, b1)


def test_a_tombstone_removes_a_reader_and_a_later_record_brings_it_back() -> None:
    a1, a2 = reader("a", 10), reader("a", 30)
    assert latest([(0, b"a", a1.encode()), (1, b"a", None)]).readers == ()
    assert latest([(0, b"a", a1.encode()), (1, b"a", None), (2, b"a", a2.encode())]).readers == (a2,)
    assert latest([(0, b"never-registered", None)]).readers == ()


def test_malformed_records_are_skipped_counted_and_never_fail_the_listing() -> None:
    a, b = reader("a", 10), reader("b", 5)
    listed = latest([(0, b"a", a.encode()), (1, b"a", b"garbage"), (2, b"b", b.encode()), (3, None, b"x"),
                     (4, b"c", b'{"format": 1}')])
    assert listed.readers == (a, b)  # a's earlier record still stands: skipping is as if never written
    assert [(m.offset, m.key) for m in listed.malformed] == [(1, "a"), (3, ""), (4, "c")]
    assert all(isinstance(m, Malformed) and m.why for m in listed.malformed)
    # A later good record (or a tombstone) of the key settles it: no longer listed as malformed.
    settled = latest([(1, b"a", b"garbage"), (2, b"a", a.encode()), (3, b"c", b"junk"), (4, b"c", None)])
    assert settled.readers == (a,) and settled.malformed == ()


def test_a_listing_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import wal.readers

    monkeypatch.setattr(wal.readers, "MAX_READERS", 3)
    records = [(i, f"r{i}".encode(), reader(f"r{i}", i).encode()) for i in range(4)]
    with pytest.raises(RegistryError, match="MAX_READERS"):
        latest(records)
