"""How far `kvstore wal truncate` may delete each shard, and who holds it back (issue 18, items 2
and 4): the pure decision, table-tested. The broker's side is tests/pipeline/test_truncate.py."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from kvstore.pipeline.changes import next_positions, reader_name, source_offsets
from kvstore.pipeline.truncate import Holder, ShardDecision, decide, kept_below_cut

H = Holder


def one(log_start: int, cut: int, readers: Mapping[str, Mapping[int, int]], *, force: bool = False,
        shard: int = 0) -> ShardDecision:
    (decision,) = decide({shard: (log_start, cut)}, readers, force=force)
    return decision


@pytest.mark.parametrize(("cut", "kept"), [(0, 0), (1, 0), (2, 1), (100, 99)])
def test_the_slot_below_the_cut_is_kept(cut: int, kept: int) -> None:
    assert kept_below_cut(cut) == kept


# (log start, cut, readers of shard 0 {name: position}, force) -> (delete below, held_by, overridden, broken)
CASES = [
    # No reader: below cut - 1, keeping the marker slot a quiet shard's leader assumed.
    ((0, 100, {}, False), (99, (), (), ())),
    # Nothing to delete: empty WAL, or already truncated as far as the cut allows (or further by hand).
    ((0, 0, {}, False), (0, (), (), ())),
    ((99, 100, {}, False), (99, (), (), ())),
    ((100, 100, {}, False), (100, (), (), ())),
    # A reader behind the cut holds the shard at its position; the oldest one decides, all are named.
    ((0, 100, {"feed": 40}, False), (40, (H("feed", 40),), (), ())),
    ((10, 100, {"b": 60, "a": 40, "c": 99}, False), (40, (H("a", 40), H("b", 60)), (), ())),
    # A reader exactly at the log start holds everything: nothing is deleted.
    ((10, 100, {"feed": 10}, False), (10, (H("feed", 10),), (), ())),
    # A reader at or beyond cut - 1 holds nothing back.
    ((0, 100, {"feed": 99}, False), (99, (), (), ())),
    ((0, 100, {"feed": 500}, False), (99, (), (), ())),
    # A reader below the log start lost its records already: reported broken, holds nothing back.
    ((50, 100, {"old": 10}, False), (99, (), (), (H("old", 10),))),
    ((50, 100, {"old": 10, "feed": 70}, False), (70, (H("feed", 70),), (), (H("old", 10),))),
    # --force: below cut - 1 whatever the readers need; the ones deleted past are listed.
    ((0, 100, {"feed": 40, "late": 99}, True), (99, (), (H("feed", 40),), ())),
    ((50, 100, {"old": 10, "feed": 70}, True), (99, (), (H("feed", 70),), (H("old", 10),))),
]


@pytest.mark.parametrize(("given", "expected"), CASES)
def test_decide(given: tuple[int, int, dict[str, int], bool],
                expected: tuple[int, tuple[Holder, ...], tuple[Holder, ...], tuple[Holder, ...]]) -> None:
    log_start, cut, positions, force = given
    d = one(log_start, cut, {name: {0: p} for name, p in positions.items()}, force=force)
    assert (d.delete_below, d.held_by, d.overridden, d.broken) == expected
    assert (d.log_start, d.cut, d.cut_allows) == (log_start, cut, kept_below_cut(cut))
    assert d.deletes == (d.delete_below > log_start)
    assert log_start <= d.delete_below <= max(log_start, cut - 1)  # never at or above the cut, never back


def test_a_reader_holds_only_the_shards_it_lists() -> None:
    decisions = decide({0: (0, 50), 1: (0, 80), 2: (5, 5)}, {"feed": {1: 30}, "other": {0: 49, 7: 1}}, force=False)
    assert [(d.shard, d.delete_below, d.held_by) for d in decisions] == [
        (0, 49, ()), (1, 30, (H("feed", 30),)), (2, 5, ())]


def test_the_change_feed_positions_from_spark_offsets() -> None:
    assert source_offsets('{"t.wal":{"1":7,"0":12}}', "t.wal") == {0: 12, 1: 7}
    assert source_offsets('{"other":{"0":1}}', "t.wal") is None
    for unusable in (None, "", "not json", "[]", '{"t.wal":{}}', '{"t.wal":{"0":-2}}', '{"t.wal":{"x":1}}',
                     '{"t.wal":{"0":true}}', '{"t.wal":{"0":"5"}}'):
        assert source_offsets(unusable, "t.wal") is None, unusable


@pytest.mark.parametrize(("recorded", "reported", "expected"), [
    ({0: 5, 1: 7}, None, None),  # no report: nothing to record
    ({0: 5, 1: 7}, {0: 5, 1: 7}, None),  # unchanged: no write
    ({0: 5, 1: 7}, {0: 9, 1: 7}, {0: 9, 1: 7}),
    ({0: 5, 1: 7}, {0: 9}, {0: 9, 1: 7}),  # a shard the report lacks keeps its position, never dropped
    ({}, {0: 3}, {0: 3}),
])
def test_next_positions(recorded: dict[int, int], reported: dict[int, int] | None,
                        expected: dict[int, int] | None) -> None:
    assert next_positions(recorded, reported) == expected


def test_a_feed_is_named_by_its_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/tmp")
    assert reader_name("feed/_checkpoint") == "changes:/tmp/feed/_checkpoint"
    assert reader_name("/data/feed/_checkpoint/") == "changes:/data/feed/_checkpoint"
    assert reader_name("s3a://bucket/feed/_checkpoint/") == "changes:s3a://bucket/feed/_checkpoint"
