"""Per-shard minimum revisions of a read (pure): what a stale read of each shard waits for.

A revision is an offset in one shard's WAL partition. Revision 120 of shard 0 says nothing
about shard 1, whose partition has its own offsets: a read that covers several shards can only
ask "at least revision r *of shard s*". So a scan names the shard of each minimum
(`ScanRequest.min_revisions`), and the shard-less `ReadOptions.min_revision` is accepted on a
scan only where it cannot be misread: in a cluster of one shard. A Get reads one shard, the
key's, so its `ReadOptions.min_revision` needs no name.

The server checks a scan here once, before it reads or forwards anything; a refusal is
INVALID_ARGUMENT (`errors.InvalidRequestError`) naming the rule, so a caller fixes the request
instead of retrying it.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore import errors
from kvstore.v1 import kv_pb2


def scan_floors(read: kv_pb2.ReadOptions, min_revisions: Iterable[kv_pb2.ShardRevision],
                shard_count: int) -> dict[int, int]:
    """shard -> the revision a stale read of that shard must have applied; shards without a
    minimum are absent. Refuses a shard-less minimum over more than one shard, a shard out of
    range, a negative revision and a shard named twice (which of the two would hold?)."""
    floors: dict[int, int] = {}
    if read.HasField("min_revision"):
        if shard_count > 1:
            raise errors.InvalidRequestError(
                f"ReadOptions.min_revision names no shard, but a scan reads all {shard_count} shards and a "
                f"revision is an offset of one shard's WAL: give ScanRequest.min_revisions (shard, revision) "
                f"instead")
        if read.min_revision < 0:
            raise errors.InvalidRequestError(f"min_revision must be >= 0, got {read.min_revision}")
        floors[0] = read.min_revision
    for shard, revision in _per_shard("min_revisions", min_revisions, shard_count).items():
        floors[shard] = max(revision, floors.get(shard, revision))
    return floors


def _per_shard(field: str, items: Iterable[kv_pb2.ShardRevision], shard_count: int) -> dict[int, int]:
    """(shard, revision) pairs checked: shards in range, revisions >= 0, each shard once."""
    out: dict[int, int] = {}
    for item in items:
        if item.shard >= shard_count:
            raise errors.InvalidRequestError(
                f"{field}: shard {item.shard} out of range (the cluster has {shard_count} shards)")
        if item.revision < 0:
            raise errors.InvalidRequestError(f"{field}: shard {item.shard}: revision must be >= 0, got {item.revision}")
        if item.shard in out:
            raise errors.InvalidRequestError(f"{field} names shard {item.shard} more than once")
        out[item.shard] = item.revision
    return out


def watch_starts(request: kv_pb2.WatchRequest, shards: Iterable[int], shard_count: int) -> dict[int, int]:
    """shard -> the revision a watch's history starts at, for the `shards` it watches; shards
    absent are watched from now on. The shard-less `start_revision` is refused on a watch over
    several shards unless it is 0 (every partition starts at offset 0: all history)."""
    watched = list(shards)
    if request.HasField("start_revision"):
        if request.start_revisions:
            raise errors.InvalidRequestError("give start_revision or start_revisions, not both")
        if request.start_revision < 0:
            raise errors.InvalidRequestError(f"start_revision must be >= 0, got {request.start_revision}")
        if request.start_revision > 0 and len(watched) > 1:
            raise errors.InvalidRequestError(
                f"start_revision {request.start_revision} names no shard, but this watch covers {len(watched)} "
                "shards and a revision is an offset of one shard's WAL: give WatchRequest.start_revisions "
                "(shard, revision) instead")
        return dict.fromkeys(watched, request.start_revision)
    starts = _per_shard("start_revisions", request.start_revisions, shard_count)
    unwatched = sorted(set(starts) - set(watched))
    if unwatched:
        raise errors.InvalidRequestError(f"start_revisions: shard {unwatched[0]} is not watched by this watch "
                                         f"(it watches shards {watched})")
    return starts
