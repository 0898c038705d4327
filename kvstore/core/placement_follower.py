"""What a node does with its copies: only what the placement log says (P1, P2; docs/design.md §9).

Pure. The node's shell (kvstore.server.node) asks `acts` once its reader reached the log's end
and after every record since, performs them, and reports its copies to the controller. A node
opens a copy only when the log gives it one, joins a shard's leadership group only with a
replica that caught up, leaves it when the log retires the copy, and deletes data only when the
log's last word on that copy is a drop. A copy found on disk that the log does not mention is
kept (and reported, so that the controller can reuse or drop it): the node never decides to
lose data by itself.

Mutation (the simulation must catch it; tests only): `drop-reopened-copy` deletes every copy
found on disk at start-up, whatever the log says of it (the old rule's "a reopened copy is a
fresh learner").
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from kvstore.core.placement_log import CopyState, PlacementState

DROP_REOPENED_COPY = "drop-reopened-copy"


class Act(enum.Enum):
    OPEN = "open"  # open the copy (a learner, or a replica reopened): follow its partition
    JOIN = "join"  # join the shard's leadership group: a caught-up replica, may lead
    LEAVE = "leave"  # leave the group, keep the data
    DROP = "drop"  # leave the group, close the copy, remove its data


@dataclasses.dataclass(frozen=True)
class Local:
    """One shard's copy on this node, as the node has it now."""

    open: bool  # a replica runs (following the partition)
    in_group: bool  # in the shard's leadership group
    caught_up: bool  # `placement_controller.is_caught_up`
    on_disk: bool = True  # its store exists (a copy not open yet: found at start-up)
    found_at_start: bool = False  # on disk when the node started


def acts(state: PlacementState, me: str, local: Mapping[int, Local], *,
         mutations: frozenset[str] = frozenset()) -> list[tuple[int, Act]]:
    """Every next step of this node, by shard (at most one per shard)."""
    steps = []
    for shard in sorted({*state.held_by(me), *local}):
        act = _act(state.copy_state(shard, me), (shard, me) in state.dropped, local.get(shard), mutations)
        if act is not None:
            steps.append((shard, act))
    return steps


def _act(said: CopyState | None, dropped: bool, have: Local | None, mutations: frozenset[str]) -> Act | None:
    if have is not None and have.found_at_start and DROP_REOPENED_COPY in mutations:
        return Act.DROP  # the mutation: whatever the log says of it
    if said is None:
        if have is None:
            return None
        if dropped:
            return Act.DROP
        return Act.LEAVE if have.in_group else None  # a copy the log does not mention: kept
    if have is None or not have.open:
        return Act.OPEN
    if said is CopyState.REPLICA:
        return Act.JOIN if have.caught_up and not have.in_group else None
    return Act.LEAVE if have.in_group else None  # a learner or a retiring copy never leads
