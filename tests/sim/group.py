"""A model of the consumer group that hands out shard leadership (docs/design.md §6, wal/membership.py).

Why it matters to safety: the group gives liveness only. A member that stops heartbeating (a
crash, a pause, a slow network) keeps its shards until its session times out; then they move to
a live member. A paused member that wakes up still believes it leads until its next heartbeat
tells it otherwise: that is the zombie leader that fencing (W4) and expected offsets (W2) must
make harmless. The model keeps exactly those properties:

* members join and heartbeat; one not heard from for `session_timeout_ms` is expelled and its
  shards are given to the least loaded live members at once;
* static membership: a member that comes back under the same name before its session expired
  keeps its shards (no rebalance, as with `group.instance.id`);
* cooperative rebalancing: to even out the load, a shard is first revoked from its live owner
  (its heartbeat answer no longer lists it), and moves once the owner reports it released it
  (its replica stopped leading) or after `revoke_timeout_ms` (the owner is presumed stuck);
* members learn everything from heartbeat answers, which travel over the simulated network;
* per-shard leadership groups (kvstore.server.leadership) are modelled as one group in which each
  member says which shards' groups it is in (`eligible`: the replicas the placement log lets it
  join with, caught up: kvstore.core.placement_follower): a shard is only ever given to a member
  eligible for it, and a member that leaves a shard's group has the shard revoked as in a
  rebalance. The controller's role is a group of its own with one partition (the same model).
"""

from __future__ import annotations

import dataclasses

from tests.sim.scheduler import Scheduler

TICK_MS = 100


@dataclasses.dataclass
class _Member:
    name: str
    last_seen_ms: int
    eligible: frozenset[int] | None = None  # the shards' groups it is in (None: every shard's)

    def may_lead(self, shard: int) -> bool:
        return self.eligible is None or shard in self.eligible


@dataclasses.dataclass(frozen=True)
class GroupAnswer:
    """A heartbeat's answer. `known` False: the member was expelled (or never joined): it must
    drop every shard and join again."""

    known: bool
    assigned: frozenset[int]
    owners: tuple[str | None, ...]  # the group's view of who leads each shard (leader hints)


@dataclasses.dataclass
class GroupStats:
    joins: int = 0
    expirations: int = 0
    moves: int = 0
    forced_moves: int = 0  # revocations that timed out


class GroupCoordinator:
    def __init__(self, sched: Scheduler, shards: int, *, session_timeout_ms: int, revoke_timeout_ms: int) -> None:
        self.sched = sched
        self.session_timeout_ms = session_timeout_ms
        self.revoke_timeout_ms = revoke_timeout_ms
        self.members: dict[str, _Member] = {}
        self.owner: list[str | None] = [None] * shards
        self.moving: dict[int, tuple[str | None, int]] = {}  # shard -> (new owner, revoked at ms)
        self.stats = GroupStats()
        sched.at(TICK_MS, self._tick)

    def heartbeat(self, name: str, holding: frozenset[int], join: bool,
                  eligible: frozenset[int] | None = None) -> GroupAnswer:
        """`holding`: the shards the member's replicas still act as leader of; `eligible`: the
        shards whose leadership group it is in (None: all)."""
        member = self.members.get(name)
        if member is None:
            if not join:
                return self._answer(False, frozenset())
            member = self.members[name] = _Member(name, self.sched.now)
            self.stats.joins += 1
        member.last_seen_ms = self.sched.now
        member.eligible = eligible
        for shard in sorted(self.moving):
            if self.owner[shard] == name and shard not in holding:
                self._finish_move(shard)
        self._rebalance()
        return self._answer(True, self.assigned(name))

    def _answer(self, known: bool, assigned: frozenset[int]) -> GroupAnswer:
        return GroupAnswer(known, assigned, tuple(self.owner))

    def assigned(self, name: str) -> frozenset[int]:
        return frozenset(s for s, owner in enumerate(self.owner) if owner == name and s not in self.moving)

    def _tick(self) -> None:
        now = self.sched.now
        for name in sorted(self.members):
            if now - self.members[name].last_seen_ms > self.session_timeout_ms:
                del self.members[name]
                self.stats.expirations += 1
        for shard in sorted(self.moving):
            if self.owner[shard] not in self.members:
                self._finish_move(shard)
            elif now - self.moving[shard][1] > self.revoke_timeout_ms:
                self.stats.forced_moves += 1
                self._finish_move(shard)
        self._rebalance()
        self.sched.at(TICK_MS, self._tick)

    def _finish_move(self, shard: int) -> None:
        target, _ = self.moving.pop(shard)
        member = self.members.get(target) if target is not None else None
        self.owner[shard] = target if member is not None and member.may_lead(shard) else None
        self.stats.moves += 1

    def _loads(self) -> dict[str, int]:
        loads = {name: 0 for name in sorted(self.members)}
        for shard, owner in enumerate(self.owner):
            if owner in loads:
                target = self.moving[shard][0] if shard in self.moving else owner
                if target in loads:
                    loads[target] += 1
        return loads

    def _rebalance(self) -> None:
        if not self.members:
            return
        for shard, owner in enumerate(self.owner):
            if owner is None or owner not in self.members:
                self.moving.pop(shard, None)
                loads = {n: load for n, load in self._loads().items() if self.members[n].may_lead(shard)}
                self.owner[shard] = min(loads, key=lambda n: (loads[n], n)) if loads else None
        for shard, owner in enumerate(self.owner):
            # The owner left the shard's leadership group: revoked, given to an eligible member once
            # released (or to nobody, if none is eligible).
            if owner is not None and not self.members[owner].may_lead(shard) and shard not in self.moving:
                loads = {n: load for n, load in self._loads().items() if self.members[n].may_lead(shard)}
                self.moving[shard] = (min(loads, key=lambda n: (loads[n], n)) if loads else None, self.sched.now)
        if self.moving:
            return  # one move at a time
        loads = self._loads()
        most = max(loads, key=lambda n: (loads[n], n))
        for shard in sorted((s for s, owner in enumerate(self.owner) if owner == most), reverse=True):
            eligible = {n: load for n, load in loads.items() if self.members[n].may_lead(shard)}
            least = min(eligible, key=lambda n: (eligible[n], n))
            if loads[most] - eligible[least] >= 2:
                self.moving[shard] = (least, self.sched.now)
                return
