"""`kvstore.core.recovery`: a checkpoint beyond the partition's end, and which snapshots to load."""

from __future__ import annotations

import pytest

from kvstore.core.recovery import Beyond, SnapshotOffer, beyond_end, snapshots_to_try

BEYOND = [
    # applied, end, end read again, stopping -> verdict
    ("within the partition", 10, 10, True, False, Beyond.NO),
    ("within, even if unread and stopping", 5, 10, False, True, Beyond.NO),
    ("beyond a freshly read end: recreated", 11, 10, True, False, Beyond.WIPE),
    ("beyond an end we could not read again", 11, 10, False, False, Beyond.UNCONFIRMED),
    ("beyond, but stopping cut the wait short", 11, 10, True, True, Beyond.UNCONFIRMED),
]


@pytest.mark.parametrize(("applied", "end", "fresh", "stopping", "verdict"), [b[1:] for b in BEYOND],
                         ids=[b[0] for b in BEYOND])
def test_beyond_end(applied: int, end: int, fresh: bool, stopping: bool, verdict: Beyond) -> None:
    assert beyond_end(applied, end, end_fresh=fresh, stopping=stopping) is verdict


def offer(name: str, cut: int, topic: str | None = "t") -> SnapshotOffer:
    return SnapshotOffer(name, topic, cut, keys=1)


SNAPSHOTS = [
    # offers (newest first), at_least, applied, end -> names to try, notes
    ("newest usable first, then older", [offer("s3", 30), offer("s2", 20)], 0, 0, 40, ["s3", "s2"], 0),
    ("incomplete skipped", [offer("s3", 30, None), offer("s2", 20)], 0, 0, 40, ["s2"], 1),
    ("another topic ignored silently", [offer("x", 35, "other"), offer("s2", 20)], 0, 0, 40, ["s2"], 0),
    ("beyond the end: another WAL", [offer("s3", 50), offer("s2", 20)], 0, 0, 40, ["s2"], 1),
    ("not beyond our checkpoint: nothing to gain", [offer("s3", 30), offer("s2", 20)], 0, 30, 40, [], 1),
    ("below the log start: useless, and so are older ones", [offer("s3", 30), offer("s2", 20)], 31, 0, 40, [], 1),
    ("stops at the first too-old one", [offer("s3", 30), offer("s2", 20), offer("s1", 10)], 0, 25, 40, ["s3"], 1),
    ("none", [], 0, 0, 40, [], 0),
]


@pytest.mark.parametrize(("offers", "at_least", "applied", "end", "names", "notes"), [s[1:] for s in SNAPSHOTS],
                         ids=[s[0] for s in SNAPSHOTS])
def test_snapshots_to_try(offers: list[SnapshotOffer], at_least: int, applied: int, end: int, names: list[str],
                          notes: int) -> None:
    usable, why = snapshots_to_try(offers, topic="t", at_least=at_least, applied=applied, end=end)
    assert [o.name for o in usable] == names
    assert len(why) == notes, why
