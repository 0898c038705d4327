"""A node's following of the placement log (P1, P2; docs/design.md §8): the shell around
`kvstore.core.placement_follower.acts`, as the real node's is.

Why a shell and nothing more: a node acts on the placement only as the log says it. Every node
reads the placement log's partition (read_committed), keeps the records W3 accepts exactly as the
shards' readers do (`wal.record.judge`), folds them with the one apply (`PlacementState.apply`)
and, once its reader reached the log's end after it started, performs what `acts` says: OPEN a
replica (a learner, or a copy reopened from its disk), JOIN the shard's leadership group (its
heartbeats' `eligible`), LEAVE it, DROP the copy's data. It decides nothing itself.

It answers the controller's asks for its report (`NodeReport`): every copy on its disk, whether it
is in the shard's group, and whether it is caught up (`is_caught_up` on its replica: reached the
partition's end, lag within the bound against the broker's high watermark, nothing keeping it from
leading). The high watermark is read from the broker at once: the real node's periodic query of it,
idealised.

For the checker it notes when each copy was really caught up (`Audit.caught_up_seen`, the same
judgement on the replica itself, whatever the node reports: under the `skip-caught-up` mutation
the node reports a copy caught up as soon as it is open) and every deletion of a copy's data
(`Audit.copy_deletes`, with the position in the log the node had read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.core import placement_follower
from kvstore.core.placement_controller import CopyReport, is_caught_up
from kvstore.core.placement_follower import Act, Local
from kvstore.core.placement_log import PlacementState
from tests.sim.kafka import FetchResult
from tests.sim.scheduler import Actor
from tests.sim.world import World
from wal.record import Verdict, judge

if TYPE_CHECKING:
    from tests.sim.node import Node


def fetch_log(world: World, actor: Actor, position: int, upto: int | None, wait_ms: int,
              done: Callable[[FetchResult | None], None]) -> None:
    """One read_committed fetch of the placement log from `position` (never past `upto`); its
    answer goes to `done` on `actor`, or None once the fetch timed out (its answer was lost)."""
    answered: list[bool] = []
    back = world.net.answer_to(actor)
    limit = world.timing.fetch_limit

    def finish(result: FetchResult | None) -> None:
        if not answered:
            answered.append(True)
            done(result)

    def at_broker() -> None:
        world.broker.fetch(world.placement_partition, position, upto, limit, wait_ms,
                           lambda result: back(lambda: finish(result)))

    world.net.send(at_broker, None, sender=actor)
    world.sched.at(world.timing.fetch_timeout_ms, lambda: finish(None), actor)


def fold(world: World, state: PlacementState, result: FetchResult) -> None:
    """Apply to `state` every record of `result` that W3 accepts (the others counted, as the
    shards' readers count them); what the apply skips is counted by the state itself."""
    counters = world.audit.counters
    for offset, value, headers in result.records:
        verdict, record = judge(offset, value, headers)
        if verdict is not Verdict.ACCEPTED:
            counters[f"placement_w3_{verdict.value}"] += 1
            continue
        assert record is not None
        if state.apply(offset, record.payload) is not None:
            counters["placement_skipped"] += 1


class Following:
    """One node process's reader of the placement log and follower of what it says."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.world = node.world
        self.state = PlacementState()
        self.position = 0  # the next offset to fetch: every record below it was read
        self.at_end = False  # the reader reached the log's end since this process started
        self.in_group: set[int] = set()  # the shards whose leadership group this node is in
        self.found_at_start: set[int] = set(node.stores)  # copies on its disk when it started

    def start(self) -> None:
        self._read()

    # ---- the reader ---------------------------------------------------------------------------------

    def _read(self) -> None:
        fetch_log(self.world, self.node, self.position, None, self.world.timing.placement_fetch_wait_ms,
                  self._fetched)

    def _fetched(self, result: FetchResult | None) -> None:
        if result is not None:
            fold(self.world, self.state, result)
            self.position = max(self.position, result.next_position)
            if len(result.records) < self.world.timing.fetch_limit:
                self.at_end = True
            self.follow()
        self._read()

    # ---- what the node has ---------------------------------------------------------------------------

    def really_caught_up(self, shard: int) -> bool:
        """P2's judgement on the replica itself (noted for the checker when true)."""
        replica = self.node.replicas.get(shard)
        if replica is None or replica.dead:
            return False
        _, end = self.world.broker.ends(shard)
        caught_up = is_caught_up(replica.caught_up, end - replica.store.applied_offset,
                                 bool(replica.machine.role.unable))
        if caught_up:
            seen = self.world.audit.caught_up_seen.setdefault((self.node.name, shard), [])
            now = self.world.sched.now
            if not seen or seen[-1] != now:
                seen.append(now)
        return caught_up

    def caught_up(self, shard: int) -> bool:
        """What the node says of its copy (to `acts` and in its report)."""
        really = self.really_caught_up(shard)
        if self.world.skip_caught_up:  # the mutation: "caught up" is "open" (the old "joined once")
            return shard in self.node.replicas
        return really

    def report(self) -> dict[int, CopyReport]:
        """Its copies, for the controller's `NodeReport`: every one on its disk."""
        return {shard: CopyReport(in_group=shard in self.in_group, caught_up=self.caught_up(shard))
                for shard in sorted(self.node.stores)}

    # ---- following -------------------------------------------------------------------------------------

    def follow(self) -> None:
        """Take the steps the log says, once the reader reached its end since the start."""
        if not self.at_end:
            return
        node, world = self.node, self.world
        local = {shard: Local(open=shard in node.replicas, in_group=shard in self.in_group,
                              caught_up=self.caught_up(shard), found_at_start=shard in self.found_at_start)
                 for shard in sorted(node.stores)}
        steps = placement_follower.acts(self.state, node.name, local, mutations=world.placement_mutations
                                        & {placement_follower.DROP_REOPENED_COPY})
        for shard, act in steps:
            world.audit.counters[f"placement_{act.value}"] += 1
            world.trace.log(f"{node.name} s{shard} placement {act.value} (the log says "
                            f"{self._said(shard)} at {self.position})")
            if act is Act.OPEN:
                node.open_copy(shard)
            elif act is Act.JOIN:
                self.in_group.add(shard)
            elif act is Act.LEAVE:
                self.in_group.discard(shard)
            else:
                assert act is Act.DROP, act
                self.in_group.discard(shard)
                self.found_at_start.discard(shard)
                node.drop_copy(shard)
                world.audit.copy_deletes.append((node.name, shard, self.position, world.sched.now))

    def _said(self, shard: int) -> str:
        held = self.state.copy_state(shard, self.node.name)
        if held is not None:
            return held.value
        return "drop" if (shard, self.node.name) in self.state.dropped else "nothing"
