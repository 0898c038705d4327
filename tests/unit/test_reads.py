"""`kvstore.core.reads`: a scan's minimum revisions are per shard (a revision is an offset of one
shard's WAL), and a shard-less minimum is refused where it would be ambiguous."""

from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.core.reads import scan_floors, watch_starts
from kvstore.v1 import kv_pb2


def read(min_revision: int | None = None) -> kv_pb2.ReadOptions:
    options = kv_pb2.ReadOptions(consistency=kv_pb2.CONSISTENCY_STALE)
    if min_revision is not None:
        options.min_revision = min_revision
    return options


def rev(shard: int, revision: int) -> kv_pb2.ShardRevision:
    return kv_pb2.ShardRevision(shard=shard, revision=revision)


@pytest.mark.parametrize(
    ("options", "revisions", "shards", "floors"),
    [
        pytest.param(read(), [], 4, {}, id="no-minimum"),
        pytest.param(read(), [rev(2, 40), rev(0, 7)], 4, {0: 7, 2: 40}, id="per-shard"),
        pytest.param(read(), [rev(3, 0)], 4, {3: 0}, id="revision-zero-is-real"),
        pytest.param(read(5), [], 1, {0: 5}, id="shard-less-on-one-shard"),
        pytest.param(read(5), [rev(0, 9)], 1, {0: 9}, id="one-shard-both-highest-wins"),
        pytest.param(read(9), [rev(0, 5)], 1, {0: 9}, id="one-shard-both-highest-wins-other-way"),
    ],
)
def test_scan_floors(options: kv_pb2.ReadOptions, revisions: list[kv_pb2.ShardRevision], shards: int,
                     floors: dict[int, int]) -> None:
    assert scan_floors(options, revisions, shards) == floors


@pytest.mark.parametrize(
    ("options", "revisions", "shards", "message"),
    [
        pytest.param(read(5), [], 4, "ReadOptions.min_revision names no shard, but a scan reads all 4 shards",
                     id="shard-less-on-many-shards"),
        pytest.param(read(0), [rev(0, 1)], 2, "give ScanRequest.min_revisions", id="shard-less-even-with-named"),
        pytest.param(read(), [rev(4, 1)], 4, "shard 4 out of range", id="shard-out-of-range"),
        pytest.param(read(), [rev(1, -1)], 4, "revision must be >= 0", id="negative"),
        pytest.param(read(), [rev(1, 3), rev(1, 4)], 4, "names shard 1 more than once", id="twice"),
        pytest.param(read(-1), [], 1, "min_revision must be >= 0", id="negative-shard-less"),
    ],
)
def test_scan_floors_refusals_name_the_rule(options: kv_pb2.ReadOptions, revisions: list[kv_pb2.ShardRevision],
                                            shards: int, message: str) -> None:
    with pytest.raises(errors.InvalidRequestError, match=message) as info:
        scan_floors(options, revisions, shards)
    code, _, _ = errors.to_status(info.value)
    assert code.name == "INVALID_ARGUMENT"


def watch(prefix: bool = True, start: int | None = None,
          starts: list[kv_pb2.ShardRevision] | None = None) -> kv_pb2.WatchRequest:
    request = kv_pb2.WatchRequest(prefix=b"p") if prefix else kv_pb2.WatchRequest(key=b"k")
    if start is not None:
        request.start_revision = start
    request.start_revisions.extend(starts or [])
    return request


@pytest.mark.parametrize(
    ("request_", "watched", "starts"),
    [
        pytest.param(watch(), [0, 1, 2], {}, id="from-now"),
        pytest.param(watch(start=0), [0, 1, 2], {0: 0, 1: 0, 2: 0}, id="all-history-names-no-shard"),
        pytest.param(watch(prefix=False, start=9), [2], {2: 9}, id="a-key-watch-reads-one-shard"),
        pytest.param(watch(start=9), [0], {0: 9}, id="prefix-on-one-shard"),
        pytest.param(watch(starts=[rev(2, 40), rev(0, 7)]), [0, 1, 2], {0: 7, 2: 40}, id="per-shard"),
    ],
)
def test_watch_starts(request_: kv_pb2.WatchRequest, watched: list[int], starts: dict[int, int]) -> None:
    assert watch_starts(request_, watched, 3) == starts


@pytest.mark.parametrize(
    ("request_", "watched", "message"),
    [
        pytest.param(watch(start=5), [0, 1, 2], "names no shard", id="shard-less-over-shards"),
        pytest.param(watch(start=-1), [0], ">= 0", id="negative"),
        pytest.param(watch(start=1, starts=[rev(0, 1)]), [0, 1, 2], "not both", id="both"),
        pytest.param(watch(starts=[rev(3, 1)]), [0, 1, 2], "out of range", id="shard-out-of-range"),
        pytest.param(watch(starts=[rev(0, 1), rev(0, 2)]), [0, 1, 2], "more than once", id="twice"),
        pytest.param(watch(prefix=False, starts=[rev(0, 1)]), [2], "not watched", id="unwatched-shard"),
        pytest.param(watch(starts=[rev(1, -2)]), [0, 1, 2], ">= 0", id="negative-per-shard"),
    ],
)
def test_watch_starts_refusals(request_: kv_pb2.WatchRequest, watched: list[int], message: str) -> None:
    with pytest.raises(errors.InvalidRequestError, match=message):
        watch_starts(request_, watched, 3)
