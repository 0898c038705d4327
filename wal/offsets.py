"""Where a committed batch leaves its partition (W1, docs/design.md §4): the one place that
knows a commit marker takes an offset.

Inside a transaction the single writer's records land consecutively; the commit marker then
takes one more offset, which no reader ever sees as a record. So a batch of n records at k
leaves the partition's upcoming offset at k + n + 1, and the marker's slot k + n is *assumed*
by the writer, never observed: a record a writer outside the guard slipped in there must still
be read by everyone (the "marker slot" rewind). The guard, the store's planner and role
machine, the replica's checkpoint and the simulation all ask here, so the rule cannot drift.

Pure: no imports, so the store's pure core may use it (tests/unit/test_layering.py).
"""

from __future__ import annotations

MARKER_SLOTS = 1  # offsets a transaction's commit marker takes after its last record


def marker_slot(last_record: int) -> int:
    """The offset the commit marker of a batch whose last record sits at `last_record` took."""
    assert last_record >= 0, f"a record offset is never negative: {last_record}"
    return last_record + 1


def upcoming_after(last_record: int) -> int:
    """The partition's upcoming offset once the batch ending at `last_record` committed."""
    return marker_slot(last_record) + MARKER_SLOTS


def batch_end(first: int, records: int) -> int:
    """The upcoming offset after a committed batch of `records` records starting at `first`."""
    assert first >= 0 and records > 0, f"a batch is at least one record at a real offset: {first}, {records}"
    return upcoming_after(first + records - 1)


def past_marker(checkpoint: int, marker: int) -> bool:
    """True when `checkpoint` sits right past the assumed marker slot `marker`: nothing was read
    beyond the batch, so moving back to `marker` re-reads exactly that slot."""
    return checkpoint == marker + MARKER_SLOTS
