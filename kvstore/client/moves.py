"""Shard moves as a client sees them (`kvstore drain`, `kvstore move`; docs/design.md §9): the
changes a drain or move asked for, and how far they got, judged from the shard map. Pure.

A move is done when every changed shard's caught-up replicas are exactly the nodes it was moved
to, and no other node still holds a copy (a learner still loading, a retiring copy not dropped
yet). The map a node answers with lists every copy each node said it holds (`ShardInfo.replicas`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvstore.client.results import ShardMap
from kvstore.v1 import cluster_pb2


@dataclasses.dataclass(frozen=True, slots=True)
class PlacementChange:
    """A shard whose replicas change: from `before` to `after` (node ids)."""

    shard: int
    before: tuple[str, ...]
    after: tuple[str, ...]

    @classmethod
    def from_pb(cls, change: cluster_pb2.PlacementChange) -> PlacementChange:
        return cls(change.shard, tuple(change.before), tuple(change.after))


@dataclasses.dataclass(frozen=True, slots=True)
class ShardMove:
    """Where one changed shard stands: its caught-up replicas, learners (node, lag) and the
    copies still held by nodes it is moving away from."""

    shard: int
    want: tuple[str, ...]
    replicas: tuple[str, ...]
    learners: tuple[tuple[str, int], ...]
    leaving: tuple[str, ...]

    @property
    def done(self) -> bool:
        return set(self.replicas) == set(self.want) and not self.learners and not self.leaving


@dataclasses.dataclass(frozen=True, slots=True)
class MoveProgress:
    moves: tuple[ShardMove, ...]

    @property
    def left(self) -> tuple[ShardMove, ...]:
        return tuple(move for move in self.moves if not move.done)

    @property
    def done(self) -> bool:
        return not self.left


def progress(smap: ShardMap, changes: Sequence[PlacementChange]) -> MoveProgress:
    """How far `changes` got, as `smap` shows the shards' copies."""
    infos = {info.shard: info for info in smap.shards}
    moves = []
    for change in changes:
        info = infos.get(change.shard)
        copies = info.replicas if info is not None else ()
        want = set(change.after)
        moves.append(ShardMove(
            shard=change.shard, want=change.after,
            replicas=tuple(sorted(r.node_id for r in copies
                                  if r.state == "replica" and r.in_group and r.node_id in want)),
            learners=tuple(sorted((r.node_id, r.lag) for r in copies if r.state == "learner"
                                  or (r.state == "replica" and not r.in_group and r.node_id in want))),
            leaving=tuple(sorted(r.node_id for r in copies
                                 if r.state in ("replica", "retiring", "stray") and r.node_id not in want))))
    return MoveProgress(tuple(moves))


def describe(move: ShardMove) -> str:
    """One line for people: "shard 3: n4 learning (lag 120), n2 still holds a copy"."""
    parts = [f"{node} learning (lag {lag})" for node, lag in move.learners]
    missing = sorted(set(move.want) - set(move.replicas) - {node for node, _ in move.learners})
    parts += [f"{node} not started" for node in missing]
    parts += [f"{node} still holds a copy" for node in move.leaving]
    return f"shard {move.shard} -> {','.join(move.want)}: " + ("; ".join(parts) or "done")
