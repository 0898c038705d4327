"""Fault injection points for tests that run real store processes (etcd's gofail, in small).

Off unless the environment names them: `KVSTORE_FAILPOINTS="apply-after-commit=1"` makes the
next one check of `apply-after-commit` raise `FailpointError` (an OSError, like the disk full or
I/O error it stands for). Counts are per process; a point with no count left is a no-op, so the
cost in production is one dict lookup.
"""

from __future__ import annotations

import os

ENV = "KVSTORE_FAILPOINTS"
# txn-stop-after-decision: a cross-shard transaction's driver stops (as if its node died) right
# after its decision is in the WAL, before any resolve: the prepares stay locked (T3, T4).
KNOWN = frozenset({"apply-after-commit", "bookkeeping-after-commit", "txn-stop-after-decision"})


class FailpointError(OSError):
    """An injected failure."""


def _parse(raw: str) -> dict[str, int]:
    points: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        name, _, count = item.partition("=")
        if name not in KNOWN:
            raise ValueError(f"{ENV}: unknown failpoint {name!r}; known: {sorted(KNOWN)}")
        points[name] = int(count or "1")
        if points[name] < 0:
            raise ValueError(f"{ENV}: count of {name!r} must be >= 0")
    return points


_remaining = _parse(os.environ.get(ENV, ""))


def check(name: str) -> None:
    """Raise FailpointError if `name` is armed (and use up one of its failures)."""
    assert name in KNOWN, f"unknown failpoint {name!r}"
    left = _remaining.get(name, 0)
    if left > 0:
        _remaining[name] = left - 1
        raise FailpointError(f"failpoint {name} (injected by {ENV})")


def arm(name: str, count: int = 1) -> None:
    """Arm a point in this process (in-process tests)."""
    assert name in KNOWN and count >= 0
    _remaining[name] = count
