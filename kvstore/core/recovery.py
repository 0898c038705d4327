"""How a replica recovers when the WAL and its checkpoint disagree; pure decisions.

Two disagreements need care (docs/design.md §4.1, `auto.offset.reset=error`: never a silent jump):

* the checkpoint lies **beyond the partition's end**: the WAL was recreated, or a restarted
  broker reports a stale high watermark for a moment. The shell waits (bounded, longer than the
  broker's own replica lag window) and reads the end again; `beyond_end` then says whether to
  carry on, wipe the replica and replay, or refuse to conclude;
* the checkpoint lies **below the log start** (truncated), or the replica is empty: only a
  snapshot helps. `snapshots_to_try` picks, newest first, the snapshots worth loading.

The shell (`kvstore.server.replica`) does the waiting, the reading and the loading.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence


class Beyond(enum.Enum):
    NO = "no"  # the checkpoint is within the partition: carry on
    WIPE = "wipe"  # still beyond a freshly read end after the grace period: the WAL was recreated
    UNCONFIRMED = "unconfirmed"  # the end could not be read again, or the node is stopping: retry later


def beyond_end(applied: int, end: int, *, end_fresh: bool, stopping: bool) -> Beyond:
    """After the bounded wait: what a checkpoint `applied` beyond the partition end `end` means.
    Never concludes "recreated" from an end it could not read again, nor while stopping (the
    end may just have been stale, and the wait was cut short)."""
    assert applied >= 0 and end >= 0, (applied, end)
    if applied <= end:
        return Beyond.NO
    if not end_fresh or stopping:
        return Beyond.UNCONFIRMED
    return Beyond.WIPE


@dataclasses.dataclass(frozen=True)
class SnapshotOffer:
    """One snapshot as listed: its name, and for this shard its WAL topic and cut (the offset it
    continues from). `topic` None: incomplete or unreadable manifest."""

    name: str
    topic: str | None
    cut: int = 0
    keys: int = 0


def snapshots_to_try(offers: Sequence[SnapshotOffer], *, topic: str, at_least: int, applied: int,
                     end: int) -> tuple[list[SnapshotOffer], list[str]]:
    """The snapshots worth loading, in the order to try them (a load that fails its own digest
    check moves on to the next), and a note for each one passed over.

    `offers` come newest first. Worth loading: complete, of this topic, with a cut at least
    `at_least` (a truncated log start) and beyond `applied` (else replaying is as good), and not
    beyond the partition's `end` (a cut beyond it belongs to another WAL, e.g. a recreated
    topic). The first complete one of this topic that is too old ends the search: the older
    ones are older still."""
    usable: list[SnapshotOffer] = []
    notes: list[str] = []
    for offer in offers:
        if offer.topic is None:
            notes.append(f"skipping snapshot {offer.name}: incomplete or unreadable")
            continue
        if offer.topic != topic:
            continue
        if offer.cut < at_least or offer.cut <= applied:
            notes.append(f"snapshot {offer.name} (cut {offer.cut}) does not help: it must reach at least "
                         f"{max(at_least, applied + 1)}")
            break
        if offer.cut > end:
            notes.append(f"skipping snapshot {offer.name}: its cut {offer.cut} is beyond the WAL's end {end} "
                         "(another WAL?)")
            continue
        usable.append(offer)
    return usable, notes
