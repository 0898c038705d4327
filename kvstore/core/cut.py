"""A read of several shards that is one consistent cut: read, validate, answer or read again; pure.

A linearizable Scan over several shards, and a read-only cross-shard Txn, read each shard at its
own moment (each through its leader's read barrier, waiting while a prepared transaction holds
an exclusive lock on what it reads: T4). A cross-shard transaction resolved at one shard between
two of those moments would show in part. There are no old versions to read at one instant, so
the read is optimistic (docs/design.md §10.5):

1. **read** every part: each shard reports the revision it was read at (its checkpoint then);
2. **validate** every part, once every read is done: each shard's leader, after a read barrier
   and the same lock wait, says whether any record at or after that revision wrote what it was
   read for (`kvstore.core.recent_writes`);
3. every part unchanged: the answer is the state at any instant between the last read and the
   first validation, for every shard at once: a cut. A transaction decided before that instant
   has all its effects in it (an effect applied after a shard's read is a write the validation
   sees, one pending is a lock it waits on); one decided after it has none. Otherwise read again,
   at most `max_rounds` times; then the caller falls back (a Txn takes locks) or refuses.

A read of one shard is one instant already: it is answered at once. Stale and leader-local reads
never validate (they promise no cut). Like the other machines, it decides and does nothing: the
shell reads and validates, reporting each round's results as one event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from kvstore import errors


@dataclasses.dataclass(frozen=True)
class CutConfig:
    max_rounds: int = 4  # reads before the caller falls back or refuses
    skip_validation: bool = False  # MUTATION `scan-without-cut`: answer every multi-shard read unvalidated

    def __post_init__(self) -> None:
        assert self.max_rounds > 0, self


@dataclasses.dataclass(frozen=True)
class ReadParts:
    """Read every part again (round `round`, from 1)."""

    round: int


@dataclasses.dataclass(frozen=True)
class ValidateParts:
    """Ask each shard whether anything read from it changed at or after its revision."""

    revisions: Mapping[int, int]


@dataclasses.dataclass(frozen=True)
class Answer:
    """The last round's reads are a cut: answer with them."""

    rounds: int


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """Every round saw a change: fall back to locks, or refuse (`error`, retriable)."""

    error: errors.StoreError


Action = ReadParts | ValidateParts | Answer | GiveUp


class Cut:
    """One cut read over `shards` (`start`, then one event per round's reads and validations)."""

    def __init__(self, shards: Sequence[int], config: CutConfig = CutConfig()) -> None:
        assert shards and len(set(shards)) == len(shards), shards
        self.shards = tuple(sorted(shards))
        self.config = config
        self.round = 0
        self.revisions: dict[int, int] = {}
        self.done = False

    def start(self) -> Action:
        assert self.round == 0, "started twice"
        return self._read()

    def read(self, revisions: Mapping[int, int]) -> Action:
        """Every part read: `revisions[shard]` is the revision it was read at."""
        assert not self.done and self.round > 0 and set(revisions) == set(self.shards), (revisions, self.shards)
        self.revisions = dict(revisions)
        if len(self.shards) == 1 or self.config.skip_validation:
            return self._answer()
        return ValidateParts(dict(self.revisions))

    def validated(self, changed: Sequence[int]) -> Action:
        """Every part validated: `changed` lists the shards where something read changed."""
        assert not self.done and self.revisions, "validated before read"
        assert set(changed) <= set(self.shards), (changed, self.shards)
        if not changed:
            return self._answer()
        if self.round >= self.config.max_rounds:
            self.done = True
            return GiveUp(errors.UnavailableError(
                f"shards {sorted(changed)} kept changing under this read for {self.round} rounds (a cut of shards "
                f"{list(self.shards)} needs one round in which nothing read changes); nothing was read: retry"))
        return self._read()

    def _read(self) -> ReadParts:
        self.round += 1
        self.revisions = {}
        return ReadParts(self.round)

    def _answer(self) -> Answer:
        self.done = True
        return Answer(self.round)
