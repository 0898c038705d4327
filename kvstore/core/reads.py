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

A scan page is bounded twice: by its `limit` and by bytes (`limits.MAX_RESPONSE_BYTES`, below
gRPC's send cap). Where a page stops and whether it says "more" is decided here (`take_page`,
`merge_pages`), over the rows the server reads lazily, so that a page of large values stops
reading where it is full instead of loading `limit` values first.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Iterable, Sequence

from kvstore import errors, limits
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


# ---- scan pages bounded by count and bytes -------------------------------------------------------

def field_bytes(size: int) -> int:
    """What a message of `size` bytes adds to the repeated field of its parent: the field's tag
    (one byte: every field number involved is below 16), its length as a varint, the message."""
    return 1 + max(1, (size.bit_length() + 6) // 7) + size


def kv_bytes(kv: kv_pb2.KeyValue) -> int:
    """What `kv` adds to a ScanResponse (exactly: the sum over a page is its `kvs` field's size)."""
    return field_bytes(kv.ByteSize())


def page_budget_bytes(headers: Iterable[kv_pb2.ReadHeader], budget_bytes: int = limits.MAX_RESPONSE_BYTES) -> int:
    """What a page's keys and values may take of `budget_bytes`: the rest is the response's fixed
    part, its headers (one per shard served) and the page token (counted at its longest, a key of
    MAX_KEY_BYTES and one byte), so that the whole ScanResponse stays within the budget."""
    fixed = sum(field_bytes(header.ByteSize()) for header in headers) + field_bytes(limits.MAX_KEY_BYTES + 1)
    return max(0, budget_bytes - fixed)


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    """A page of a scan, or of a part of it another node served: keys in order, and whether the
    range has keys after the last one (`more`, which the wire says with a page token)."""

    kvs: list[kv_pb2.KeyValue]
    more: bool

    def __post_init__(self) -> None:
        # "More" without a key would not say where to continue (and paging would not progress).
        assert self.kvs or not self.more, "a page that has more must hold its first key"

    def next_page_token(self) -> bytes:
        """The token of the page after this one: the smallest key above the last one; b"" at the end."""
        return self.kvs[-1].key + b"\x00" if self.more else b""


def take_page(rows: Iterable[kv_pb2.KeyValue], limit: int, budget_bytes: int) -> Page:
    """The page `rows` (in key order) start with: at most `limit` rows and at most `budget_bytes`
    of them encoded (`kv_bytes`), but always the first row, whatever its size: one key and value
    fit a response (`limits.MAX_KEY_VALUE_BYTES`), so every page makes progress. `more` when a
    row was left out, whichever bound left it out, as the client pages on the token alone. Reads
    at most one row past the page (a lazy reader behind `rows` stops there)."""
    assert limit > 0, limit
    kvs: list[kv_pb2.KeyValue] = []
    used = 0
    for kv in rows:
        size = kv_bytes(kv)
        if len(kvs) >= limit or (kvs and used + size > budget_bytes):
            return Page(kvs, more=True)
        kvs.append(kv)
        used += size
    return Page(kvs, more=False)


def merge_pages(streams: Sequence[Iterable[kv_pb2.KeyValue]], parts: Sequence[Page], limit: int,
                budget_bytes: int) -> Page:
    """One page of a scan gathered from sources of disjoint keys, each in key order: `streams`,
    read on demand to their end (the shards this node serves), and `parts`, pages other nodes
    served (each cut at its own limit or bytes). A part that has more says nothing about the keys
    after its last one, and a smaller key of another source may already fill the page's bytes
    sooner than the count did: so the page never goes past the smallest last key of a part that
    has more (its frontier), or the next page, which starts after this page's last key, would skip
    that part's unseen keys. Every part holds its first key, so the frontier is at or above the
    smallest key of all and the page is never empty while anything is left: global key order, no
    key skipped or repeated across pages, progress on every page."""
    frontier = min((part.kvs[-1].key for part in parts if part.more), default=None)
    merged: Iterable[kv_pb2.KeyValue] = heapq.merge(*streams, *(part.kvs for part in parts), key=_key)
    if frontier is not None:
        merged = itertools.takewhile(lambda kv: kv.key <= frontier, merged)
    page = take_page(merged, limit, budget_bytes)
    return Page(page.kvs, more=page.more or frontier is not None)


def _key(kv: kv_pb2.KeyValue) -> bytes:
    return kv.key
